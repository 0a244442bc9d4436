#!/usr/bin/env bash
# Build the target, kv_inject and drafter TensorRT engines from a `trtllm-dflash convert` / `quantize` output.
# Runs inside NVIDIA's tritonserver:26.07-trtllm-python-py3 container (TensorRT-LLM 1.2.1, see docker/).
# Usage: build_scripts/build_engines.sh CKPT_DIR OUT_DIR hopper|blackwell [extra `trtllm-dflash build` args]
# e.g.   build_scripts/build_engines.sh artifacts/ckpt_fp8 artifacts/engines hopper --max-batch-size 16 --dry-run
set -euo pipefail

if [[ $# -lt 3 ]]; then
    echo "usage: $0 CKPT_DIR OUT_DIR hopper|blackwell [extra trtllm-dflash build args]" >&2
    exit 2
fi
ckpt_dir=$1
out_dir=$2
gpu=$3
shift 3

if command -v trtllm-dflash >/dev/null 2>&1; then
    cli=(trtllm-dflash)
else
    cli=(python3 -m trtllm_dflash)
fi
exec "${cli[@]}" build --ckpt "$ckpt_dir" --out "$out_dir" --gpu "$gpu" "$@"
