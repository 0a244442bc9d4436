"""``python -m trtllm_dflash`` is the ``trtllm-dflash`` console script."""

import sys

from trtllm_dflash.cli import main

sys.exit(main())
