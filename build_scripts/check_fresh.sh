#!/usr/bin/env bash
# The fresh-machine check: clone the committed HEAD into a temporary directory and run the README's set-up commands
# there as a newcomer would: an empty HOME (so no pip cache, no ~/.cache/trtllm_dflash, no Hugging Face cache), no
# model cache variable, no standard input, a clone per command. Prints each command's wall time and result and a
# JSON summary line; exits non-zero if any command failed. Logs stay in the work directory it names; the clone and
# home of each command (a virtual environment and model cache, 3-6 GB: a dozen checks once filled the disk) are
# removed when it ends unless KEEP_FRESH=1.
# Usage: build_scripts/check_fresh.sh [demo] [test]     (default: both, demo first)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
commands=("$@")
[ ${#commands[@]} -gt 0 ] || commands=(demo test)
for c in "${commands[@]}"; do
  case $c in demo|test) ;; *) echo "check_fresh: unknown command '$c' (choose demo and/or test)" >&2; exit 2 ;; esac
done

# The real interpreter: a pyenv shim would look for its root under the (now empty) HOME.
python=$(python3 -c 'import sys; print(sys.executable)')
work=$(mktemp -d "${TMPDIR:-/tmp}/trtllm-dflash-fresh.XXXXXX")
commit=$(git -C "$repo" rev-parse HEAD)
echo "check_fresh: HEAD ${commit:0:7}, work directory $work, python $python"
if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no)" ]; then
  echo "check_fresh: note: uncommitted changes in $repo are not part of the check (it clones HEAD)"
fi

summary="{"
failed=0
for c in "${commands[@]}"; do
  git clone -q "$repo" "$work/$c"
  git -C "$work/$c" checkout -q "$commit"
  mkdir -p "$work/home-$c"
  start=$(date +%s)
  set +e
  (cd "$work/$c" && env -u TRTLLM_DFLASH_CACHE -u TRTLLM_DFLASH_TEST_CACHE -u HF_HOME -u XDG_CACHE_HOME \
      -u VIRTUAL_ENV -u PYTHONPATH HOME="$work/home-$c" PYTHON="$python" \
      bash "build_scripts/$c.sh" </dev/null >"$work/$c.log" 2>&1)
  rc=$?
  set -e
  wall=$(( $(date +%s) - start ))
  [ "$rc" -eq 0 ] || failed=1
  echo "check_fresh: bash build_scripts/$c.sh -> exit $rc in ${wall}s (log: $work/$c.log); last lines:"
  tail -n 5 "$work/$c.log" | sed 's/^/    /'
  [ "${KEEP_FRESH:-0}" = 1 ] || rm -rf "${work:?}/$c" "${work:?}/home-$c"
  summary+="\"$c\": {\"exit\": $rc, \"wall_s\": $wall}, "
done
echo "${summary%, }, \"commit\": \"$commit\"}"
exit "$failed"
