#!/usr/bin/env bash
# README command (b): set up and run the whole test suite. .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash build_scripts/setup.sh
.venv/bin/trtllm-dflash demo-assets   # the real SmolLM2 target the tests use (converted once, cached)
if command -v shellcheck >/dev/null 2>&1; then
  shellcheck build_scripts/*.sh .ci/run
fi
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
