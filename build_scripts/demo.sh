#!/usr/bin/env bash
# README command (a): set up and run the demo on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash build_scripts/setup.sh
exec .venv/bin/trtllm-dflash demo "$@"
