#!/usr/bin/env bash
# Installs surogate_jax for development: .venv (Python >= 3.12) + editable install with extras.
# When nvcc is found the CUDA extension surogate_jax._ffi is compiled and a compile error fails
# the install; without nvcc the package installs and every op runs its pure-JAX reference.
#
# Environment:
#   SUROGATE_JAX_EXTRAS   extras to install (default "dev"; "" for none; e.g. "dev,cuda13")
#   SUROGATE_JAX_PYTHON   interpreter to build .venv from (default: searched, see find_python)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

EXTRAS="${SUROGATE_JAX_EXTRAS-dev}"

py_ok() {  # $1 runs and is CPython >= 3.12 (pyenv shims for missing versions fail here)
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local c root
  if [[ -n "${SUROGATE_JAX_PYTHON:-}" ]]; then
    py_ok "$SUROGATE_JAX_PYTHON" && { echo "$SUROGATE_JAX_PYTHON"; return 0; }
    echo "error: SUROGATE_JAX_PYTHON=$SUROGATE_JAX_PYTHON is not a Python >= 3.12" >&2
    exit 2
  fi
  for c in python3.13 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && py_ok "$c"; then command -v "$c"; return 0; fi
  done
  local roots=()
  if command -v pyenv >/dev/null 2>&1; then roots+=("$(pyenv root 2>/dev/null || true)"); fi
  roots+=("${PYENV_ROOT:-}" "$HOME/.pyenv")
  for root in "${roots[@]}"; do
    [[ -n "$root" && -d "$root/versions" ]] || continue
    # Newest first: 3.19 ... 3.12.
    while read -r c; do
      if [[ -n "$c" ]] && py_ok "$c"; then echo "$c"; return 0; fi
    done < <(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV)
  done
  return 1
}

if [[ -x .venv/bin/python ]] && py_ok .venv/bin/python; then
  echo "install.sh: reusing .venv ($(.venv/bin/python --version))"
else
  if ! PY="$(find_python)"; then
    echo "error: surogate_jax needs Python >= 3.12; install it (e.g. 'pyenv install 3.12' or your OS package python3.12) and re-run" >&2
    exit 2
  fi
  [[ -e .venv ]] && { echo "install.sh: .venv has no usable Python >= 3.12; recreating it"; rm -rf .venv; }
  echo "install.sh: creating .venv with $PY ($("$PY" --version))"
  "$PY" -m venv .venv
fi
VPY="$PWD/.venv/bin/python"
pip_install() { "$VPY" -m pip install --disable-pip-version-check "$@"; }

# Disk: the dev extras pull PyTorch (for the Hugging Face parity and PEFT tests), whose CUDA build
# from PyPI is ~5.5 GB installed plus ~3.5 GB of downloads unpacked in the temp folder; the rest
# (jax, transformers, datasets, the extension's build folder) is ~2.5 GB. Check before starting so
# a short disk fails here with the numbers instead of half-way through pip.
free_gb() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}'; }
need_gb=3
if [[ ",$EXTRAS," == *,dev,* ]] && ! "$VPY" -c 'import torch' >/dev/null 2>&1; then need_gb=12; fi
tmp_dir="${TMPDIR:-/tmp}"
have_gb="$(free_gb .)"
tmp_gb="$(free_gb "$tmp_dir")"
echo "install.sh: free disk: ${have_gb:-?} GB here, ${tmp_gb:-?} GB in $tmp_dir; need about $need_gb GB"
if [[ -n "$have_gb" && -n "$tmp_gb" ]] && ((have_gb < need_gb || tmp_gb < need_gb)); then
  echo "error: not enough free disk (need about $need_gb GB in $PWD and in $tmp_dir; have $have_gb GB and $tmp_gb GB)." >&2
  echo "       Free some space, point TMPDIR at a larger disk, or install without the test extras" >&2
  echo "       (SUROGATE_JAX_EXTRAS= ./install.sh; tests that need torch/peft are then skipped)." >&2
  exit 2
fi

pip_install --upgrade pip
# Build requirements installed up front so the editable build can skip isolation (fast rebuilds).
build_reqs=("scikit-build-core>=0.10" "nanobind>=2.0" "jax>=0.11.2")
if ! cmake_version="$(cmake --version 2>/dev/null | head -n1 | awk '{print $3}')" ||
  [[ -z "$cmake_version" ]] ||
  [[ "$(printf '%s\n' 3.24 "$cmake_version" | sort -V | head -n1)" != 3.24 ]]; then
  build_reqs+=("cmake>=3.24")
fi
command -v ninja >/dev/null 2>&1 || build_reqs+=("ninja")
pip_install "${build_reqs[@]}"

# nvcc: PATH first, then the usual toolkit location.
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
config=()
if command -v nvcc >/dev/null 2>&1; then
  echo "install.sh: nvcc found ($(command -v nvcc)); compiling the CUDA extension"
  config+=("-Ccmake.define.SUROGATE_JAX_REQUIRE_CUDA=ON")
else
  echo "install.sh: nvcc not found; installing without the CUDA extension"
fi

target="."
[[ -n "$EXTRAS" ]] && target=".[${EXTRAS}]"
start=$SECONDS
pip_install --no-build-isolation ${config[@]+"${config[@]}"} -e "$target"
echo "install.sh: pip install -e took $((SECONDS - start)) s"

"$VPY" - <<'EOF'
try:
    import surogate_jax._ffi as ext
    print("install.sh: CUDA extension built:", ext.__file__)
except ModuleNotFoundError as e:
    print("install.sh: CUDA extension NOT built (ops use their pure-JAX references):", e)
EOF
