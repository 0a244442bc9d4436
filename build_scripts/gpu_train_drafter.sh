#!/usr/bin/env bash
# Drafter training on a borrowed GPU machine, one <=10-minute command at a time (build_scripts/gpu_pipeline.py;
# the exact sequence of device `run` calls is in README "Training a drafter on a GPU").
#
#   here:  build_scripts/gpu_train_drafter.sh pack --source GGUF --prompts POOL.jsonl --eval-prompts humaneval --wheel gguf-*.whl
#   GPU:   build_scripts/gpu_train_drafter.sh recv                 (once per carried part)
#          build_scripts/gpu_train_drafter.sh start --wait 480 --out "$OUT" [--resume-from DIR] [run settings]
#          build_scripts/gpu_train_drafter.sh poll --wait 540 --out "$OUT"
#   here:  build_scripts/gpu_train_drafter.sh merge --parts RETURNED_DIR --out artifacts/drafters/NAME
#
# Runs from the source tree (no pip install of this package): PYTHONPATH is the repository root. Python: $PYTHON, else
# the repository's .venv when it exists here, else python3 (the GPU machine's preinstalled interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$PY" build_scripts/gpu_pipeline.py "$@"
