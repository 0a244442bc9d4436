"""dflash_bls / baseline_bls, and the entry points dflash / baseline (rendered from the ``entry`` template with this
same file; their ``frontend: on`` parameter adds tokenization and detokenization): the decoupled speculative loop,
BLS calls to the step models (logic: trtllm_dflash.serve.triton.bls)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.triton.bls import LoopModel
from trtllm_dflash.serve.triton.lifecycle import python_model

TritonPythonModel = python_model(LoopModel, pb_utils, needs=("target_verify", "kv_inject", "drafter"), nice=True)
