"""Packaging: the top-level models/ folder must install as `surogate_jax.models`, from a wheel and
from an editable install. Builds run with the CUDA extension off (SUROGATE_JAX_CUDA=OFF), in a
private build dir, so they are quick and leave the developer's build/ alone."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK = "import surogate_jax.models as m, surogate_jax.ops as o; print(m.__file__)"


def _site_dirs() -> list[str]:
    """This interpreter's site-packages (where jax, flax, ... live)."""
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def _no_cuda_build_args(build_dir: Path) -> list[str]:
    return [
        "--no-build-isolation",
        "--no-deps",
        "-Ccmake.define.SUROGATE_JAX_CUDA=OFF",
        f"-Cbuild-dir={build_dir}",
    ]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_models_importable_here():
    import surogate_jax.models as models

    assert Path(models.__file__).parent.name == "models"
    assert hasattr(models, "__all__")


def test_wheel_contains_models(tmp_path):
    wheel_dir = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "-w", str(wheel_dir),
         *_no_cuda_build_args(tmp_path / "build")],
        cwd=tmp_path,
    )
    (wheel,) = wheel_dir.glob("surogate_jax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "surogate_jax/models/__init__.py" in names
    assert "surogate_jax/ops/rms_norm.py" in names
    assert not any(n.startswith("models/") for n in names)

    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    # -S: skip site-packages processing so an editable install's import hook cannot win; the
    # dependencies come from this interpreter's site dirs placed after the unpacked wheel.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(unpacked), *_site_dirs()])}
    out = _run([sys.executable, "-S", "-c", CHECK], cwd=tmp_path, env=env).stdout.strip()
    assert Path(out).is_relative_to(unpacked), out


def test_editable_install_in_fresh_venv(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=True).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = _run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).stdout.strip()
    # The fresh venv sees this interpreter's packages (jax, scikit-build-core, ...) as plain path
    # entries: their .pth files (e.g. an existing editable install's hook) are not processed.
    Path(purelib, "_parent_env.pth").write_text("\n".join(_site_dirs()) + "\n")
    _run(
        [str(py), "-m", "pip", "install", "-e", str(REPO), *_no_cuda_build_args(tmp_path / "build")],
        cwd=tmp_path,
    )
    # The editable hook's module is named _editable_skbc_surogate_jax (scikit-build-core >= 1.0)
    # or _surogate_jax_editable (older): find it through its finder on sys.meta_path.
    probe = CHECK + (
        "; import sys; print(*[sys.modules[type(f).__module__].__file__ for f in sys.meta_path"
        " if 'surogate_jax' in type(f).__module__])"
    )
    out = _run([str(py), "-c", probe], cwd=tmp_path).stdout.split()
    assert Path(out[0]) == REPO / "models" / "__init__.py", out
    assert len(out) == 2 and Path(out[1]).is_relative_to(env_dir), out  # the fresh venv's hook


@pytest.mark.skipif(sys.platform != "linux", reason="only checks linux build scripts")
def test_scripts_are_executable():
    for script in ("install.sh", ".ci/run"):
        assert os.access(REPO / script, os.X_OK), script


def _fake_df(tmp_path, free_kb: int) -> Path:
    """A `df -Pk` that reports `free_kb` available on one filesystem, for every path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    df = bin_dir / "df"
    df.write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted'\n"
                  f"echo '/dev/x 100000000 1 {free_kb} 1% /'\n")
    df.chmod(0o755)
    return bin_dir


@pytest.mark.skipif(sys.platform != "linux", reason="only checks linux build scripts")
@pytest.mark.parametrize("extras, torch_missing, need", [("dev", False, 3), ("", False, 3), ("dev", True, 12)])
def test_install_stops_on_a_short_disk_before_pip(tmp_path, extras, torch_missing, need):
    """install.sh checks the free disk before any pip call and stops with the numbers (a CI run out
    of disk otherwise dies half-way through pip with ENOSPC)."""
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copy2(REPO / "install.sh", work / "install.sh")
    # Its .venv/bin/python: this interpreter (>= 3.12, so the venv is reused), except that
    # `import torch` answers as torch_missing says (with torch missing the dev extras need 12 GB).
    (work / ".venv" / "bin").mkdir(parents=True)
    py = work / ".venv" / "bin" / "python"
    torch_rc = 1 if torch_missing else 0
    py.write_text(f'#!/bin/sh\ncase "$*" in *"import torch"*) exit {torch_rc};; esac\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    bin_dir = _fake_df(tmp_path, (need - 1) * 1024 * 1024)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SUROGATE_JAX_EXTRAS": extras}
    r = subprocess.run(["bash", str(work / "install.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"need about {need} GB" in r.stdout
    assert f"not enough free disk (need about {need} GB" in r.stderr
    assert "SUROGATE_JAX_EXTRAS=" in r.stderr
    assert "pip" not in r.stdout.replace("install.sh:", "")  # stopped before any pip output
