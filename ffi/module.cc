// The nanobind module `surogate_jax._ffi`: one registration table for every FFI handler in ffi/.
// Python (surogate_jax/ops/_loader.py) calls registrations() and hands each capsule to
// jax.ffi.register_ffi_target(name, capsule, platform="CUDA").
// Adding an op: declare its `Targets <Op>Targets();` below and list it in kOps.
#include <nanobind/nanobind.h>

#include "ffi/ffi_common.h"

namespace nb = nanobind;

namespace surogate::ffi_bind {
Targets RmsNormTargets();
Targets SwigluTargets();
Targets SwigluLoraTargets();
Targets AddRmsNormTargets();
Targets LmHeadCeTargets();
Targets RopeTargets();
Targets Fp8MatmulTargets();
Targets Nvfp4QuantizeTargets();
Targets Nvfp4MatmulTargets();
Targets Adamw8bitTargets();
Targets Nf4DequantizeTargets();
Targets TileDequantizeTargets();
Targets GroupedMatmulTargets();
}  // namespace surogate::ffi_bind

namespace {

using surogate::ffi_bind::Targets;
constexpr Targets (*kOps[])() = {
    &surogate::ffi_bind::RmsNormTargets,       &surogate::ffi_bind::SwigluTargets,
    &surogate::ffi_bind::SwigluLoraTargets,    &surogate::ffi_bind::AddRmsNormTargets,
    &surogate::ffi_bind::LmHeadCeTargets,      &surogate::ffi_bind::RopeTargets,
    &surogate::ffi_bind::Fp8MatmulTargets,     &surogate::ffi_bind::Nvfp4QuantizeTargets,
    &surogate::ffi_bind::Nvfp4MatmulTargets,   &surogate::ffi_bind::Adamw8bitTargets,
    &surogate::ffi_bind::Nf4DequantizeTargets, &surogate::ffi_bind::TileDequantizeTargets,
    &surogate::ffi_bind::GroupedMatmulTargets};

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "surogate_jax CUDA kernels as XLA FFI handlers (see registrations()).";
  m.def(
      "registrations",
      [](bool graph_safe) {
        nb::dict out;
        for (auto targets : kOps) {
          for (const auto& t : targets()) {
            out[t.name] =
                nb::capsule(reinterpret_cast<void*>(graph_safe ? t.graph_safe : t.no_graph));
          }
        }
        return out;
      },
      nb::arg("graph_safe") = true,
      "Dict of FFI target name -> PyCapsule of its XLA_FFI_Handler, for platform CUDA. graph_safe: "
      "the handlers declare command-buffer compatibility (XLA may record them into CUDA graphs).");
}
