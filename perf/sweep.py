"""perf_analyzer sweep over the served dflash/baseline ensembles (library: perf/_lib/sweep.py).

    python perf/sweep.py --serve --models dflash,baseline --dataset humaneval --concurrency 1,2,4 \
        --max-tokens 64 --requests-per-point 4 --out perf/results/my-sweep
"""

import sys

from _lib.sweep import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
