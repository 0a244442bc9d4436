#!/usr/bin/env bash
# Build step of docker/Dockerfile.trtllm-pytorch: copy NVIDIA's llmapi Triton model files (tensorrt_llm/1/: model.py
# and the modules it imports; never model.yaml, which make-repo renders) into DEST.
# Source, in order: the image itself when it ships TensorRT-LLM's triton_backend/ tree; else a one-directory sparse
# checkout of the TensorRT-LLM git tag matching the installed tensorrt_llm, so model.py and library stay in step.
set -euo pipefail

DEST=${1:?usage: fetch_llmapi.sh DEST}
SUB=triton_backend/all_models/llmapi/tensorrt_llm/1
say() { echo "fetch_llmapi: $*" >&2; }

SRC=""
for root in /app/tensorrt_llm /opt/tensorrt_llm /opt/tritonserver /workspace; do
  if [ -f "$root/$SUB/model.py" ]; then SRC=$root/$SUB; break; fi
done
if [ -z "$SRC" ]; then
  hit=$(find /app /opt /usr/local /workspace -path "*/$SUB/model.py" -print -quit 2>/dev/null || true)
  if [ -n "$hit" ]; then SRC=$(dirname "$hit"); fi
fi
CLONE=""
if [ -z "$SRC" ]; then
  VERSION=$(python3 -c "import importlib.metadata as m; print(m.version('tensorrt_llm'))")
  command -v git >/dev/null 2>&1 || { say "no llmapi model in the image and no git to fetch v$VERSION"; exit 1; }
  CLONE=$(mktemp -d)
  say "not in the image; fetching $SUB from TensorRT-LLM v$VERSION"
  git clone --quiet --depth 1 --filter=blob:none --sparse --branch "v$VERSION" \
    https://github.com/NVIDIA/TensorRT-LLM.git "$CLONE"
  git -C "$CLONE" sparse-checkout set "$SUB"
  SRC=$CLONE/$SUB
fi
[ -f "$SRC/model.py" ] || { say "no model.py in $SRC"; exit 1; }

mkdir -p "$DEST"
for f in "$SRC"/*; do
  [ "$(basename "$f")" = model.yaml ] || cp -r "$f" "$DEST/"
done
if [ -n "$CLONE" ]; then rm -rf "$CLONE"; fi
say "llmapi model files from $SRC -> $DEST: $(cd "$DEST" && echo *)"
