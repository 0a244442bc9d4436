"""report.md and PNG plots from a sweep directory's records.jsonl (library: perf/_lib/report.py).

    python perf/report.py perf/results/my-sweep
"""

import sys

from _lib.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
