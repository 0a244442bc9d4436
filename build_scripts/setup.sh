#!/usr/bin/env bash
# Create .venv with everything the embedded (CPU) runtime, the demo and the tests need. Idempotent.
# Every package comes from the committed, hash-checked locks (build_scripts/lock.sh regenerates them), installed with
# --no-deps so that nothing outside the locks can enter: a new release upstream cannot change what a fresh machine
# gets. torch is locked to 2.13.0+cpu (the CPU build, found in /opt/wheels on our machines); on a machine with CUDA
# and a working torch already in .venv, that torch is kept instead.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

# pip with the machine's unreachable extra-index warnings filtered out; keeps pip's exit status.
pip_q() {
  .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

find_links=()
if [ -d /opt/wheels ]; then find_links=(--find-links /opt/wheels); fi

lock=build_scripts/requirements.lock
if command -v nvidia-smi >/dev/null 2>&1 \
   && .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  # Keep the CUDA torch already installed: drop the locked CPU build (its line and its hash lines) from the lock.
  lock=.venv/requirements-no-torch.lock
  awk '/^torch==/{skip=1; next} skip && /^[[:space:]]/{next} {skip=0; print}' build_scripts/requirements.lock > "$lock"
fi

pip_q install --require-hashes --no-deps "${find_links[@]}" -r "$lock"
pip_q install --require-hashes --no-deps "${find_links[@]}" -r build_scripts/requirements-nodeps.lock
# This package itself, editable, built with the locked setuptools (no isolated build environment to download).
pip_q install --no-deps --no-build-isolation -e .
# The real perf_analyzer (through a private C library); optional: only perf/sweep.py needs it, and its test skips
# loudly when the Debian archive cannot be reached.
bash build_scripts/install_perf_analyzer.sh >/dev/null || echo "setup: perf_analyzer not installed (only perf/sweep.py needs it)" >&2
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
