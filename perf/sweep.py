"""perf_analyzer sweep over the served dflash/baseline ensembles (library: trtllm_dflash.perf.sweep).

    python perf/sweep.py --serve --models dflash,baseline --dataset humaneval --concurrency 1,2,4 \
        --max-tokens 64 --requests-per-point 4 --out perf/results/my-sweep
"""

import sys

from trtllm_dflash.perf.sweep import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
