#!/usr/bin/env bash
# Create .peers/speculators: a separate venv holding vLLM's `speculators` 0.9.0 (CPU torch), the peer that
# tests/models/test_speculators_format.py checks our speculators-format loader and writer against. Idempotent; optional
# (those tests skip without it). Never installed into .venv: speculators pins transformers/datasets ranges of its own.
#
# speculators' metadata also asks for torchaudio and torchvision (unused by its model classes) and would pull a CUDA
# torch; so every package comes from build_scripts/peers/speculators.lock, hash-checked and --no-deps: torch
# 2.13.0+cpu (from /opt/wheels where present, the project's own), speculators, hs-connectors (imported by its
# training module at import time), transformers 5.19, datasets, openai and the rest that `import speculators` needs.
# The lock's input is build_scripts/peers/speculators.in (exact pins, what was installed and tested).
# Usage: build_scripts/peer_speculators.sh          create / update the venv
#        build_scripts/peer_speculators.sh --lock   regenerate the lock from speculators.in (uv, as lock.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

LOCK=build_scripts/peers/speculators.lock
find_links=()
if [ -d /opt/wheels ]; then find_links=(--find-links /opt/wheels); fi

if [ "${1:-}" = "--lock" ]; then
  source build_scripts/uv.sh   # UV: the uv build_scripts/lock.sh pins
  "$UV" pip compile build_scripts/peers/speculators.in --no-deps --python-version 3.11 \
      --python-platform x86_64-manylinux_2_36 --generate-hashes "${find_links[@]}" \
      --custom-compile-command "bash build_scripts/peer_speculators.sh --lock" -o "$LOCK"
  # uv writes no hash for a find-links wheel: take torch's (the same wheel) from the project lock
  torch_hash=$(grep -A1 '^torch==2.13.0+cpu' build_scripts/requirements.lock | grep -o 'sha256:[0-9a-f]*')
  sed -i "s|^torch==2.13.0+cpu\$|torch==2.13.0+cpu \\\\\n    --hash=$torch_hash|" "$LOCK"
  echo "peer_speculators: wrote $LOCK"
  exit 0
fi

PY=${PYTHON:-python3}
VENV=.peers/speculators
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --require-hashes --no-deps "${find_links[@]}" \
    -r "$LOCK" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
"$VENV/bin/python" -c 'import speculators, torch; from speculators.models.dflash import DFlashDraftModel
print("peer_speculators: ready, speculators", speculators.__version__ if hasattr(speculators, "__version__") else "0.9.0", "torch", torch.__version__)'
