"""drafter: one DFlash step for a dynamically batched list of requests (logic: trtllm_dflash.serve.triton.handlers)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.triton.handlers import DrafterStepModel
from trtllm_dflash.serve.triton.lifecycle import python_model

TritonPythonModel = python_model(DrafterStepModel, pb_utils)
