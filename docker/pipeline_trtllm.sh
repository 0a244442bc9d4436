#!/usr/bin/env bash
# Entry point of the TensorRT-LLM images: HF target + DFlash drafter -> a served Triton model repository.
#
#   pipeline_trtllm.sh engine  [--dry-run] [--force]   (docker/Dockerfile.trtllm, TensorRT-LLM 1.2.1)
#       convert -> quantize (fp8 | nvfp4 | none) -> build (trtllm-build) -> make-repo --backend trtllm-engine -> serve
#   pipeline_trtllm.sh pytorch [--dry-run] [--force]   (docker/Dockerfile.trtllm-pytorch, TensorRT-LLM >= 1.3)
#       convert -> quantize --export-hf (ModelOpt unified HF checkpoint) -> make-repo --backend trtllm-pytorch -> serve
#
# Every step is a `trtllm-dflash` command; this script only chooses paths and the recipe.
# A stage whose output directory already exists is reused, so a restarted container goes straight to serving;
# --force redoes every stage. --dry-run prints the commands (one per line, shell-quoted) and runs nothing.
#
# Paths and ports (environment; defaults are the container's mount points):
#   DFLASH_TARGET=/models/target    Hugging Face target (Llama / Qwen3)
#   DFLASH_DRAFTER=/models/drafter  z-lab DFlash drafter
#   DFLASH_WORK=/work               checkpoints, engines and the rendered repository
#   DFLASH_HTTP_PORT=8000 DFLASH_GRPC_PORT=8001 DFLASH_METRICS_PORT=8002 (bound on 0.0.0.0 inside the container)
# Recipe:
#   DFLASH_GPU=auto|hopper|blackwell  auto: nvidia-smi's compute capability (9.x hopper, >= 10 blackwell)
#   DFLASH_QUANT=auto|fp8|nvfp4|none  auto: fp8 on hopper, nvfp4 on blackwell (NVFP4 GEMMs need SM100+)
#   DFLASH_KV_CACHE=none|fp8          FP8 KV cache for the target (off by default: see trtllm_triton.md §8)
#   DFLASH_TP=1  DFLASH_CALIB=humaneval  DFLASH_CALIB_SIZE=64
#
# Exit status: 0 served and stopped; 2 bad configuration (one line on stderr); anything else: the failing stage's.
set -euo pipefail

PROG=pipeline_trtllm.sh

die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*" >&2; }

MODE=${1:-}
case $MODE in
  engine|pytorch) shift ;;
  *) die "first argument must be 'engine' or 'pytorch' (got '${MODE}')" ;;
esac
DRY_RUN=0
FORCE=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    --force) FORCE=1 ;;
    *) die "unknown argument '$arg' (allowed: --dry-run, --force)" ;;
  esac
done

TARGET=${DFLASH_TARGET:-/models/target}
DRAFTER=${DFLASH_DRAFTER:-/models/drafter}
WORK=${DFLASH_WORK:-/work}
GPU=${DFLASH_GPU:-auto}
QUANT=${DFLASH_QUANT:-auto}
KV_CACHE=${DFLASH_KV_CACHE:-none}
TP=${DFLASH_TP:-1}
CALIB=${DFLASH_CALIB:-humaneval}
CALIB_SIZE=${DFLASH_CALIB_SIZE:-64}
HTTP_PORT=${DFLASH_HTTP_PORT:-8000}
GRPC_PORT=${DFLASH_GRPC_PORT:-8001}
METRICS_PORT=${DFLASH_METRICS_PORT:-8002}
# Where Dockerfile.trtllm-pytorch put the llmapi model files (model.py and its helpers) from NVIDIA's image.
LLMAPI_DIR=${DFLASH_LLMAPI_DIR:-/opt/trtllm-dflash/llmapi}

# Print a command shell-quoted; run it unless --dry-run.
run() {
  printf '%q ' "$@" | sed 's/ $//'
  echo
  if [ "$DRY_RUN" = 0 ]; then "$@"; fi
}

# "9.0" -> hopper, "10.0" / "12.0" -> blackwell; anything older is refused.
gpu_from_compute_cap() {
  local major=${1%%.*}
  case $major in
    ''|*[!0-9]*) die "nvidia-smi reported compute capability '$1'; set DFLASH_GPU=hopper|blackwell" ;;
  esac
  if [ "$major" -ge 10 ]; then
    [ "$major" -lt 12 ] || say "compute capability $1 (consumer Blackwell): NVFP4 support there is partial"
    echo blackwell
  elif [ "$major" -eq 9 ]; then
    echo hopper
  else
    die "compute capability $1: FP8/NVFP4 engines need Hopper (9.0) or Blackwell (>= 10.0)"
  fi
}

case $GPU in
  hopper|blackwell) ;;
  auto)
    command -v nvidia-smi >/dev/null 2>&1 || die "DFLASH_GPU=auto needs nvidia-smi (run with --gpus all) or set DFLASH_GPU"
    CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' ')
    GPU=$(gpu_from_compute_cap "$CAP")
    say "GPU compute capability $CAP -> $GPU"
    ;;
  *) die "DFLASH_GPU=$GPU: must be auto, hopper or blackwell" ;;
esac
case $QUANT in
  auto) if [ "$GPU" = blackwell ]; then QUANT=nvfp4; else QUANT=fp8; fi ;;
  fp8|none) ;;
  nvfp4) [ "$GPU" = blackwell ] || die "DFLASH_QUANT=nvfp4 needs Blackwell (FP4 GEMMs need SM100+); use fp8 on Hopper" ;;
  *) die "DFLASH_QUANT=$QUANT: must be auto, fp8, nvfp4 or none" ;;
esac
case $KV_CACHE in
  none|fp8) ;;
  *) die "DFLASH_KV_CACHE=$KV_CACHE: must be none or fp8" ;;
esac
if [ "$KV_CACHE" = fp8 ] && [ "$QUANT" = none ]; then die "DFLASH_KV_CACHE=fp8 needs DFLASH_QUANT fp8 or nvfp4"; fi
KV_ARGS=()
if [ "$KV_CACHE" = fp8 ]; then KV_ARGS=(--kv-cache fp8); fi
if [ "$DRY_RUN" = 0 ]; then
  [ -f "$TARGET/config.json" ] || die "no Hugging Face target at $TARGET (mount it: -v HOST_DIR:$TARGET:ro)"
  [ -f "$DRAFTER/config.json" ] || die "no DFlash drafter at $DRAFTER (mount it: -v HOST_DIR:$DRAFTER:ro)"
fi
say "mode=$MODE gpu=$GPU quant=$QUANT kv_cache=$KV_CACHE tp=$TP work=$WORK"

# stage NAME OUT_DIR: true when the stage must run (no output yet, or --force).
stage() {
  if [ "$FORCE" = 1 ] || [ ! -e "$2" ] || [ "$DRY_RUN" = 1 ]; then say "stage $1 -> $2"; return 0; fi
  say "stage $1: reusing $2 (--force redoes it)"
  return 1
}
FORCE_ARGS=()
if [ "$FORCE" = 1 ]; then FORCE_ARGS=(--force); fi

REPO=$WORK/repo
if [ "$MODE" = engine ]; then
  CKPT=$WORK/ckpt
  if stage convert "$CKPT"; then
    run trtllm-dflash convert --target "$TARGET" --drafter "$DRAFTER" --out "$CKPT" --tp "$TP" "${FORCE_ARGS[@]}"
  fi
  if [ "$QUANT" != none ]; then
    QCKPT=$WORK/ckpt_$QUANT
    if stage quantize "$QCKPT"; then
      run trtllm-dflash quantize --in "$CKPT" --format "$QUANT" "${KV_ARGS[@]}" --calib "$CALIB" \
        --calib-size "$CALIB_SIZE" --out "$QCKPT" "${FORCE_ARGS[@]}"
    fi
    CKPT=$QCKPT
  fi
  ENGINES=$WORK/engines_$QUANT
  if stage build "$ENGINES"; then
    run trtllm-dflash build --ckpt "$CKPT" --out "$ENGINES" --gpu "$GPU"
  fi
  run trtllm-dflash make-repo --backend trtllm-engine --engines "$ENGINES" --target "$TARGET" --drafter "$DRAFTER" \
    --out "$REPO" --force
else
  HF=$TARGET
  if [ "$QUANT" != none ]; then
    # One quantization path for both images: quantize the converted checkpoint and export the target as modelopt's
    # unified Hugging Face checkpoint, which TensorRT-LLM's PyTorch backend loads.
    CKPT=$WORK/ckpt
    HF=$WORK/target_$QUANT
    if stage convert "$CKPT"; then
      run trtllm-dflash convert --target "$TARGET" --drafter "$DRAFTER" --out "$CKPT" "${FORCE_ARGS[@]}"
    fi
    if stage quantize "$HF"; then
      run trtllm-dflash quantize --in "$CKPT" --format "$QUANT" "${KV_ARGS[@]}" --calib "$CALIB" \
        --calib-size "$CALIB_SIZE" --out "$WORK/ckpt_$QUANT" --export-hf "$HF" "${FORCE_ARGS[@]}"
    fi
  fi
  run trtllm-dflash make-repo --backend trtllm-pytorch --checkpoint "$HF" --drafter "$DRAFTER" --out "$REPO" --force
  # NVIDIA's llmapi model (model.py and its helper modules) goes next to every model.yaml the renderer wrote
  # without a model.py; the rendered model.yaml itself is never replaced.
  for yaml in "$REPO"/*/1/model.yaml; do
    [ "$DRY_RUN" = 0 ] || break
    [ -e "$yaml" ] || continue
    [ -f "$LLMAPI_DIR/model.py" ] || die "no llmapi model.py in $LLMAPI_DIR (Dockerfile.trtllm-pytorch copies it there)"
    dir=$(dirname "$yaml")
    [ ! -e "$dir/model.py" ] || continue
    for f in "$LLMAPI_DIR"/*; do
      [ "$(basename "$f")" = model.yaml ] || run cp -r "$f" "$dir/"
    done
  done
fi

SERVE=(trtllm-dflash serve --repo "$REPO" --host 0.0.0.0 --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT"
       --metrics-port "$METRICS_PORT")
printf '%q ' "${SERVE[@]}" | sed 's/ $//'
echo
if [ "$DRY_RUN" = 0 ]; then exec "${SERVE[@]}"; fi
