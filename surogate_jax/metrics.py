"""Run logging: metrics.jsonl, the progress bar, training_plot.png, TensorBoard / W&B; and the
throughput accounting they report (tokens/s, model FLOPs per token, MFU, peak device memory).

Every logged step appends one JSON object to <output_dir>/metrics.jsonl (step, loss, lr,
grad_norm, tokens_per_s, mfu, ...; eval steps add eval_loss), so a resumed run continues the same
file: on start it is cut back to the step the run resumes from (`truncate`), so re-done steps are
not logged twice, and a partial last line (a kill mid-write) is dropped rather than failing every
later read. The plot is redrawn from that file, so it covers the whole run across restarts.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections import deque
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from .atomic import atomic_file
from .config import ConfigError, RunConfig
from .models import DecoderConfig

log = logging.getLogger("surogate_jax")


class RunLogger:
    def __init__(self, out_dir: Path, run: RunConfig, *, total_steps: int, start_step: int, config_flat: dict):
        self.out = out_dir
        self.path = out_dir / "metrics.jsonl"
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        file=sys.stderr, disable=None)
        self.backends = []
        for name in run.report_to or []:
            self.backends.append(_backend(name, out_dir, run, config_flat))

    def log(self, record: dict) -> None:
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for b in self.backends:
            b(record)

    def progress(self, step: int, m: dict) -> None:
        post = {"loss": f"{m['loss']:.4f}", "lr": f"{m['lr']:.2e}", "gnorm": f"{m['grad_norm']:.3f}"}
        if m.get("tokens_per_s"):
            post["tok/s"] = f"{m['tokens_per_s']:,.0f}"
        if m.get("mfu") is not None:
            post["mfu"] = f"{100 * m['mfu']:.1f}%"
        if m.get("aux_loss") is not None:  # MoE: the router's balance (aux 1 x top-k and load 1 = even)
            post["aux"] = f"{m['aux_loss']:.3f}"
            post["load"] = f"{m['expert_load']:.2f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(step - self.bar.n)

    def write(self, msg: str) -> None:
        self.bar.write(msg, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        plot(self.path, self.out / "training_plot.png")


def check_backends(run: RunConfig) -> None:
    """Fails fast (ConfigError) when a report_to backend is not installed."""
    import importlib.util

    for name in run.report_to or []:
        mods = ("wandb",) if name == "wandb" else ("tensorboard", "tensorboardX")
        if not any(importlib.util.find_spec(m) for m in mods):
            raise ConfigError(f"report_to: {name} needs `pip install {mods[0]}`")


def _backend(name: str, out_dir: Path, run: RunConfig, config_flat: dict):
    if name == "wandb":
        try:
            import wandb
        except ImportError:
            raise ConfigError("report_to: wandb needs `pip install wandb`") from None
        wb = wandb.init(project=run.wandb_project, name=run.wandb_name or run.run_name, config=config_flat)
        return lambda r: wb.log({k: v for k, v in r.items() if v is not None and k != "step"}, step=r["step"])
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("report_to: tensorboard needs `pip install tensorboard` (with torch) "
                              "or tensorboardX") from None
    writer = SummaryWriter(str(out_dir / "tensorboard"))

    def log(r):
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and v is not None:
                writer.add_scalar(k, v, r["step"])
        writer.flush()
    return log


def _lines(path: Path) -> list[str]:
    return [x for x in path.read_text(encoding="utf-8", errors="replace").splitlines() if x.strip()]


def _record(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; lines that are not whole JSON objects are skipped."""
    if not path.is_file():
        return []
    return [r for r in map(_record, _lines(path)) if r is not None]


def truncate(path: Path, step: int) -> int:
    """Keeps the records of steps <= `step` (the step a run starts from), rewriting the file
    atomically; returns how many lines were dropped (partial ones included)."""
    if not path.is_file():
        return 0
    lines = _lines(path)
    keep = [r for r in map(_record, lines) if r is not None and isinstance(r.get("step"), int) and r["step"] <= step]
    if len(keep) < len(lines):
        with atomic_file(path) as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
    return len(lines) - len(keep)


class PlateauWatch:
    """Warns once when the training loss has not moved over `window` steps at a learning rate of
    at least `min_lr`: a run whose weights blew up (say, learning_rate 1e6) sits at a flat loss,
    often ln(vocab), with every value finite. Real training moves far more than `rel_tol`."""

    def __init__(self, window: int = 50, rel_tol: float = 1e-4, min_lr: float = 1e-6):
        self.window, self.rel_tol, self.min_lr = window, rel_tol, min_lr
        self.points: deque = deque()
        self.warned = False

    def update(self, step: int, loss: float, lr: float) -> str | None:
        """The warning to print, once, else None."""
        if self.warned or not (math.isfinite(loss) and lr >= self.min_lr):
            self.points.clear()
            return None
        self.points.append((step, loss))
        while self.points and self.points[0][0] < step - self.window:
            self.points.popleft()
        first, losses = self.points[0][0], [x for _, x in self.points]
        if step - first < self.window or len(losses) < 5:
            return None
        spread = max(losses) - min(losses)
        if spread > self.rel_tol * max(1.0, abs(losses[-1])):
            return None
        self.warned = True
        return (f"the training loss has not moved for {step - first} steps ({losses[-1]:.6g} +- {spread:.2g}) at "
                f"learning rate {lr:.3g}: the run has likely diverged or stalled; lower learning_rate or check "
                "the data")


def plot(metrics_path: Path, out_png: Path) -> Path | None:
    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("loss") is not None]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    ev = [r for r in rows if r.get("eval_loss") is not None]
    if ev:
        ax1.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss")
    ax1.set_ylabel("loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    lr = [r for r in train if r.get("lr") is not None]
    ax2.plot([r["step"] for r in lr], [r["lr"] for r in lr], color="tab:green")
    ax2.set_ylabel("lr")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


# ---------------------------------------------------------------------------------------------
# Throughput accounting (ARCHITECTURE.md "Measuring")

H100_BF16_PEAK = 989e12


def router_note(m: dict) -> str:
    """' (router at step N: aux ..., load ..., z ...)' from a logged step's metrics of an MoE model, else ''."""
    if m.get("aux_loss") is None:
        return ""
    return (f" (router at step {m['step']}: aux loss {m['aux_loss']:.3f}, expert load {m['expert_load']:.2f}, "
            f"z-loss {m['router_z_loss']:.3f})")


def linear_params(cfg: DecoderConfig) -> int:
    """The linear-layer weights one token multiplies by (lm_head included); MoE: the router and its top-k experts."""
    D, H, KV, K, F, L = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.intermediate_size, cfg.num_layers)
    sparse = sum(cfg.sparse_layer(i) for i in range(L))
    mlp = (L - sparse) * 3 * D * F + sparse * (D * cfg.num_experts + cfg.num_experts_per_tok * 3 * D *
                                               cfg.moe_intermediate_size)
    return L * (2 * D * H * K + 2 * D * KV * K) + mlp + D * cfg.vocab_size


def flops_per_token(cfg: DecoderConfig, seq_len: int, frozen_base: bool) -> float:
    k = 4 if frozen_base else 6
    return k * linear_params(cfg) + 6 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim


def device_peak_flops() -> float | None:
    """Dense bf16 peak of the local devices when they are H100/H200 class GPUs, else None."""
    devs = jax.local_devices()
    if devs and devs[0].platform == "gpu" and any(s in devs[0].device_kind for s in ("H100", "H200", "H800", "GH200")):
        return H100_BF16_PEAK * len(jax.devices())
    return None


def peak_memory_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


class Throughput:
    """Median seconds per optimizer step over the recent logging intervals; the interval that
    holds the compile (the first one seen) is never counted."""

    def __init__(self):
        self.t: float | None = None
        self.step = 0
        self.rates: list[float] = []

    def update(self, step: int) -> float | None:
        now = time.perf_counter()
        if self.t is not None and step > self.step:
            self.rates.append((now - self.t) / (step - self.step))
        self.t, self.step = now, step
        return float(np.median(self.rates[-20:])) if self.rates else None
