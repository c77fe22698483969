// The rounding a dequantization kernel may apply to each value before its output scale: the weight
// as the model dtype holds it (fp8-hybrid's frozen cache quantizes the weight in that dtype).
// Shared by the nf4_dequantize and tile_dequantize launchers (host-visible, no device code).
#pragma once

namespace surogate {

enum class DequantVia : int { kNone = 0, kBf16 = 1, kF16 = 2 };

}  // namespace surogate
