"""`python -m surogate_jax.export` on user mistakes: one `error:` line, exit 2, no traceback, and the
adapter and any existing --out left byte for byte as they were. Tiny models are built here with our
own Decoder (no downloads, no torch)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax import ModelLoadError
from surogate_jax import export as E
from surogate_jax import lora as L
from surogate_jax.hf import save_pretrained
from surogate_jax.models import Decoder, DecoderConfig, LoraSpec
from surogate_jax.safetensors_io import CheckpointReader, write_file

ROOT = Path(__file__).parents[1]
BASE = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, qk_norm=True)
TARGETS = ("q_proj", "v_proj", "down_proj")
IDS = jnp.zeros((1, 1), jnp.int32)


def write_base(d: Path, **over) -> DecoderConfig:
    cfg = DecoderConfig(**{**BASE, **over})
    model = Decoder(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(0), IDS)["params"])
    save_pretrained(d, model, params)
    return cfg


def write_adapter(d: Path, cfg: DecoderConfig, rank: int = 4) -> Path:
    model = Decoder(cfg.replace(lora=LoraSpec(rank=rank, alpha=8.0, targets=TARGETS)))
    adapters = L.init_adapters(model, jax.random.key(1), IDS)
    adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # non-zero B, so the merge changes the weights
    return L.save_peft(d, model, adapters, base_model="tiny")


def tree_hash(d: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under d ({} when d does not exist)."""
    if not d.exists():
        return {}
    if d.is_file():
        return {".": hashlib.sha256(d.read_bytes()).hexdigest()}
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*"))
            if f.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A base model, its adapter, and adapters of two other bases (wider, deeper)."""
    t = tmp_path_factory.mktemp("export")
    cfg = write_base(t / "base")
    write_adapter(t / "adapter", cfg)
    write_adapter(t / "adapter_wide", DecoderConfig(**{**BASE, "hidden_size": 40}))
    write_adapter(t / "adapter_deep", DecoderConfig(**{**BASE, "num_layers": 3}))
    return t


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def export_fails(base, adapter, out, *, watch=()) -> str:
    """Runs the CLI expecting a user error; returns the error line. `watch`: paths that must not change."""
    before = {str(p): tree_hash(Path(p)) for p in (adapter, out, *watch)}
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "surogate_jax.export", "--base", str(base), "--adapter", str(adapter),
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert {str(p): tree_hash(Path(p)) for p in (adapter, out, *watch)} == before
    return errors[0]


# --- --out is checked before anything loads --------------------------------------------------------

def test_out_under_a_file_fails_before_loading(tiny, tmp_path):
    blocker = tmp_path / "somefile"
    blocker.write_text("keep me")
    out = blocker / "sub" / "merged"
    # The base does not exist: the --out error must come first, so nothing was loaded.
    line = export_fails(tmp_path / "no-such-base", tiny / "adapter", out, watch=[blocker])
    assert str(out) in line and str(blocker) in line and "--out" in line, line


def test_out_not_empty_is_untouched(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("do not lose")
    line = export_fails(tiny / "base", tiny / "adapter", out)
    assert str(out) in line and "not empty" in line, line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_out_in_read_only_dir(tiny, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        line = export_fails(tiny / "base", tiny / "adapter", ro / "out")
    finally:
        ro.chmod(0o755)
    assert str(ro / "out") in line and "not writable" in line, line
    assert not (ro / "out").exists()


def test_out_check_in_process(tmp_path):
    """The cases above without a subprocess, including a file at --out itself."""
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        E.check_out(f)
    with pytest.raises(NotADirectoryError, match="is a file"):
        E.check_out(f / "a" / "b")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        E.check_out(tmp_path / "full")
    E.check_out(tmp_path / "new" / "deeper")  # creatable: fine, and nothing is created by the check
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "full"]


# --- the adapter -----------------------------------------------------------------------------------

def test_adapter_config_not_json(tiny, tmp_path):
    a = copy_dir(tiny / "adapter", tmp_path / "a")
    (a / "adapter_config.json").write_text("{not json")
    line = export_fails(tiny / "base", a, tmp_path / "out")
    assert str(a / "adapter_config.json") in line and "not valid JSON" in line, line
    assert not (tmp_path / "out").exists()


def test_adapter_of_a_wider_base(tiny, tmp_path):
    line = export_fails(tiny / "base", tiny / "adapter_wide", tmp_path / "out")
    assert "has shape [40, 4], the model expects [32, 4]" in line and "another base model" in line, line
    assert not (tmp_path / "out").exists()


def test_adapter_of_a_deeper_base(tiny, tmp_path):
    line = export_fails(tiny / "base", tiny / "adapter_deep", tmp_path / "out")
    assert "3 layers but the base model has 2" in line, line


def test_adapter_rank_differs_from_its_config(tiny, tmp_path):
    a = copy_dir(tiny / "adapter", tmp_path / "a")
    cfg = json.loads((a / "adapter_config.json").read_text())
    (a / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))
    line = export_fails(tiny / "base", a, tmp_path / "out")
    assert "its rank is 4, not r=8" in line and "lora_A.weight" in line, line


def test_truncated_adapter_weights(tiny, tmp_path):
    a = copy_dir(tiny / "adapter", tmp_path / "a")
    f = a / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    line = export_fails(tiny / "base", a, tmp_path / "out")
    assert str(f) in line and "truncated" in line, line


# --- in process: adapter_config.json fields, tensors, the atomic write -----------------------------

@pytest.mark.parametrize("edit, match", [
    (lambda c: [c], "expected a JSON object"),
    (lambda c: {k: v for k, v in c.items() if k != "r"}, "'r' is missing"),
    (lambda c: {k: v for k, v in c.items() if k != "lora_alpha"}, "'lora_alpha' is missing"),
    (lambda c: {**c, "r": "4"}, "r='4' must be a positive integer"),
    (lambda c: {**c, "r": True}, "r=True must be a positive integer"),
    (lambda c: {**c, "r": 0}, "r=0 must be a positive integer"),
    (lambda c: {**c, "lora_alpha": "8"}, "lora_alpha='8' must be a number"),
    (lambda c: {**c, "target_modules": "all-linear"}, "target_modules must be a list"),
    (lambda c: {**c, "target_modules": ["q_proj", "lm_head"]}, r"target_modules \['lm_head'\] cannot be adapted"),
    (lambda c: {**c, "rank_pattern": {"q_proj": 8}}, "rank_pattern="),
    (lambda c: {**c, "use_dora": True}, "only plain LoRA"),
])
def test_bad_adapter_config(tiny, tmp_path, edit, match):
    a = copy_dir(tiny / "adapter", tmp_path / "a")
    cfg = json.loads((a / "adapter_config.json").read_text())
    (a / "adapter_config.json").write_text(json.dumps(edit(cfg)))
    model = Decoder(DecoderConfig(**BASE, lora=LoraSpec(rank=4, alpha=8.0, targets=TARGETS)))
    with pytest.raises(ModelLoadError, match=match) as e:
        L.load_peft(a, model)
    assert "adapter_config.json" in str(e.value)


def _rewrite(a: Path, drop: str | None = None, add: tuple[str, np.ndarray] | None = None) -> None:
    r = CheckpointReader(a)
    keep = [n for n in r.names() if n != drop]
    arrays = [r.get(n).copy() for n in keep]
    if add:
        keep.append(add[0])
        arrays.append(add[1])
    del r
    (a / "adapter_model.safetensors").unlink()
    write_file(a / "adapter_model.safetensors", [(n, x.dtype, x.shape) for n, x in zip(keep, arrays)], arrays)


def test_missing_and_extra_tensors(tiny, tmp_path):
    model = Decoder(DecoderConfig(**BASE, lora=LoraSpec(rank=4, alpha=8.0, targets=TARGETS)))
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    a = copy_dir(tiny / "adapter", tmp_path / "a")
    _rewrite(a, drop=name)
    with pytest.raises(ModelLoadError, match=f"'{name}' is missing"):
        L.load_peft(a, model)
    b = copy_dir(tiny / "adapter", tmp_path / "b")
    _rewrite(b, add=("base_model.model.lm_head.lora_A.weight", np.zeros((4, 32), np.float32)))
    with pytest.raises(ModelLoadError, match="lm_head.lora_A.weight"):
        L.load_peft(b, model)


def test_safetensors_header_not_an_object(tiny, tmp_path):
    a = copy_dir(tiny / "adapter", tmp_path / "a")
    head = b"[1, 2]  "
    (a / "adapter_model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head)
    model = Decoder(DecoderConfig(**BASE, lora=LoraSpec(rank=4, alpha=8.0, targets=TARGETS)))
    with pytest.raises(ModelLoadError, match="adapter_model.safetensors: corrupt safetensors header .* not an object"):
        L.load_peft(a, model)


def test_export_merges_and_a_failed_write_leaves_nothing(tiny, tmp_path, monkeypatch):
    assert E.main(["--base", str(tiny / "base"), "--adapter", str(tiny / "adapter"), "--out",
                   str(tmp_path / "ok"), "--dtype", "fp32"]) == 0
    assert (tmp_path / "ok" / "model.safetensors").is_file()
    merged, base = CheckpointReader(tmp_path / "ok"), CheckpointReader(tiny / "base")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not np.allclose(merged.get(name), base.get(name))  # the adapter was folded in

    import surogate_jax.hf as hf

    def broken(path, entries, arrays, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf, "write_file", broken)
    with pytest.raises(OSError, match="No space left"):
        E.main(["--base", str(tiny / "base"), "--adapter", str(tiny / "adapter"), "--out", str(tmp_path / "bad")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]  # no --out, no temporary sibling
