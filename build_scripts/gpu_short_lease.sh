#!/usr/bin/env bash
# The last device command of a short GPU lease (15 device-minutes: the `recv` calls that `pack` plans, then this one).
# It starts the drafter job (`gpu_train_drafter.sh start`, with the flags after `--`), runs perf/gpu_session.py's
# correctness steps beside it (env, kernel_tests, parity: they time nothing), waits for the job, returns its
# checkpoint, stops it if it is still running (so no timing below shares the GPU), then spends what is left of the
# command on gpu_session's timed steps with the drafter the job exported (the shipped one if it exported none).
#
#   bash build_scripts/gpu_short_lease.sh SECONDS COMMIT -- START_FLAGS...     (device tool: carry also .gpu)
#
# SECONDS: what this command may use (leave the device call's timeout_s some 30 s above it). Returns under $OUT:
# p/ (the job's checkpoint and status.json, 7 files: `gpu_train_drafter.sh merge --parts` takes it) and
# session.tgz (both gpu_session runs: gpu_session.json and its log each).
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
py=${PYTHON:-python3} device=${LEASE_DEVICE:-cuda}  # the CPU rehearsal sets both
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # perf scripts' subprocesses import trtllm_dflash from the tree
rm -rf /tmp/sess1 /tmp/sess2
mkdir -p /tmp/sess1 /tmp/sess2
bash build_scripts/gpu_train_drafter.sh start "$@"
echo "lease: job started at $((SECONDS - t0)) s"
OMP_NUM_THREADS=4 timeout -s INT 150 "$py" perf/gpu_session.py --device "$device" --out /tmp/sess1 --prompts .gpu/prompts \
    --target "$home/target" --drafter "$shipped" --steps "${LEASE_CHECKS:-env,kernel_tests,parity}" --budget-s 110 --commit "$commit"
echo "lease: correctness steps done at $((SECONDS - t0)) s"
wait_s=$(($(left) - 170))
bash build_scripts/gpu_train_drafter.sh poll --wait $((wait_s > 5 ? wait_s : 5)) --out "$OUT/p"
if pkill -f "trtllm_dflash.train.gpu_pipeline run"; then
    echo "lease: job still running at $((SECONDS - t0)) s: stopped (its last checkpoint is in p/)"
    sleep 3
fi
drafter=$home/drafter
[[ -f $drafter/model.safetensors ]] || drafter=$shipped
rem=$(($(left) - 20))
echo "lease: timed steps with $drafter, $rem s left"
if ((rem > 40)); then
    timeout -s INT "$rem" "$py" perf/gpu_session.py --device "$device" --out /tmp/sess2 --prompts .gpu/prompts --target "$home/target" \
        --drafter "$drafter" --steps dflash_vs_ar,bench_kernels,bench_gpu --limit 8 --budget-s $((rem - 75)) \
        --commit "$commit"
fi
tar czf "$OUT/session.tgz" -C /tmp sess1 sess2
echo "lease: done at $((SECONDS - t0)) s"
