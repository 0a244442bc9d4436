#!/usr/bin/env bash
# The last device command of a short GPU lease (15 device-minutes: the `recv` calls that `pack` plans, then this one).
# It starts the drafter job (`gpu_train_drafter.sh start`, with the flags after `--`), runs perf/gpu_session.py's
# correctness steps beside it (env, kernel_tests, parity: they time nothing), waits for the job,
# returns its checkpoint, stops it if it is still running (so no timing below shares the GPU), then spends what is
# left of the command on gpu_session's timed steps with the drafter the job exported (the shipped one if it exported
# none).
#
#   bash build_scripts/gpu_short_lease.sh SECONDS COMMIT -- START_FLAGS...     (device tool: carry also .gpu)
#
# SECONDS: what this command may use (give the device call's timeout_s some 25 s more). Do not write anything else
# under $OUT: this returns exactly the 8 files the device tool gives back, p/ (the job's checkpoint, config.json,
# training_config.json and status.json: `gpu_train_drafter.sh merge --parts` takes it) and session.tgz (this
# script's log and both gpu_session runs). LEASE_CHECKS: the correctness steps (default env,kernel_tests,parity);
# LEASE_TIMED: the timed steps (default graphs,dflash_vs_ar,bench_kernels,bench_gpu; empty:
# none, and the job gets the time: a next device call within 30 s finds the machine warm, its target and drafter under
# /tmp/dflash-gpu, and runs them with perf/gpu_session.py itself); LEASE_BLOCK_SIZES, LEASE_LIMIT: dflash_vs_ar's
# --block-sizes (16,8,16+ngram,auto+ngram,16+tree,auto+tree) and prompts per dataset (8); LEASE_PROMPTS: gpu_session's --prompts
# (.gpu/prompts, from its --export-prompts); PYTHON, LEASE_DEVICE: the CPU rehearsal's.
set -u
cd "$(dirname "$0")/.." || exit 2
budget=$1 commit=$2
shift 2
[[ "${1:-}" == "--" ]] && shift
t0=$SECONDS
left() { echo $((budget - (SECONDS - t0))); }
home=${DFLASH_GPU_HOME:-/tmp/dflash-gpu}
shipped=trtllm_dflash/data/drafters/smollm2-135m-instruct-dflash
: "${OUT:?set OUT (the device tool sets it)}"
py=${PYTHON:-python3} device=${LEASE_DEVICE:-cuda} prompts=${LEASE_PROMPTS:-.gpu/prompts}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # perf scripts' subprocesses import trtllm_dflash from the tree
logs=$(mktemp -d)/lease
mkdir -p "$logs"
exec > >(tee "$logs/lease.log") 2>&1
bash build_scripts/gpu_train_drafter.sh start "$@"
echo "lease: job started at $((SECONDS - t0)) s"
OMP_NUM_THREADS=4 timeout -s INT 150 "$py" perf/gpu_session.py --device "$device" --out "$logs/checks" \
    --prompts "$prompts" --target "$home/target" --drafter "$shipped" \
    --steps "${LEASE_CHECKS:-env,kernel_tests,parity}" --budget-s 110 --commit "$commit"
echo "lease: correctness steps done at $((SECONDS - t0)) s"
timed=${LEASE_TIMED-graphs,dflash_vs_ar,bench_kernels,bench_gpu}
wait_s=$(($(left) - (${#timed} ? 170 : 30)))
bash build_scripts/gpu_train_drafter.sh poll --wait $((wait_s > 5 ? wait_s : 5)) --out "$OUT/p"
if pkill -f "build_scripts/gpu_pipeline.py run"; then
    echo "lease: job still running at $((SECONDS - t0)) s: stopped (its last checkpoint is in p/)"
    sleep 3
fi
drafter=$home/drafter
[[ -f $drafter/model.safetensors ]] || drafter=$shipped
rem=$(($(left) - 20))
echo "lease: timed steps with $drafter, $rem s left"
if ((rem > 40)) && [[ -n $timed ]]; then
    timeout -s INT "$rem" "$py" perf/gpu_session.py --device "$device" --out "$logs/timed" --prompts "$prompts" \
        --target "$home/target" --drafter "$drafter" --steps "$timed" \
        --block-sizes "${LEASE_BLOCK_SIZES:-16,8,16+ngram,auto+ngram,16+tree,auto+tree}" --limit "${LEASE_LIMIT:-8}" \
        --budget-s $((rem - 75)) \
        --commit "$commit"
fi
echo "lease: done at $((SECONDS - t0)) s; returning $(find "$OUT" -type f | wc -l) files + session.tgz"
tar czf "$OUT/session.tgz" -C "$(dirname "$logs")" lease
