# Sourced by the scripts in this folder. Makes .venv ready on a fresh machine with nothing but
# Python 3.11+, and does nothing slow when it already is. Sets ROOT, VENV and VPY.
set -euo pipefail
# pip's wheel cache would hold a second copy of every download (torch's alone is hundreds of
# MB), so installs skip it: a CI machine's disk can be small.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HOTSWAP_VENV:-$ROOT/.venv}"
VPY="$VENV/bin/python"
TORCH_VERSION="${HOTSWAP_TORCH_VERSION:-2.13.0}"

if [ ! -x "$VPY" ]; then
  echo "[hotswap] creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# Whether torch is installed, without importing it (an import costs 2-5 s of every script).
if ! "$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
    >/dev/null 2>&1; then
  # A bare `torch` requirement would pull multi-GB CUDA builds: ask for the CPU build by its
  # local version first (a wheel cache or CPU index already configured for pip), then from
  # PyTorch's CPU index.
  echo "[hotswap] installing torch $TORCH_VERSION (CPU build)" >&2
  "$VPY" -m pip install --quiet --no-cache-dir --disable-pip-version-check "torch==$TORCH_VERSION+cpu" 2>/dev/null \
    || "$VPY" -m pip install --quiet --no-cache-dir --disable-pip-version-check "torch==$TORCH_VERSION" \
         --index-url "${HOTSWAP_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
fi
stamp="$VENV/.hotswap-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[hotswap] installing hotswap[dev,models,fleet,serve-bench] into $VENV" >&2
  "$VPY" -m pip install --quiet --no-cache-dir --disable-pip-version-check -e "$ROOT[dev,models,fleet,serve-bench]"
  echo "$want" > "$stamp"
fi
cd "$ROOT"
