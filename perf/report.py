"""report.md and PNG plots from a sweep directory's records.jsonl (library: trtllm_dflash.perf.report).

    python perf/report.py perf/results/my-sweep
"""

import sys

from trtllm_dflash.perf.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
