"""postprocessing: TensorRT-LLM's detokenizer model, TOKENS_BATCH -> OUTPUT (logic: trtllm_dflash.serve.trtllm.text)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.trtllm.text import TextPostprocessor
from trtllm_dflash.serve.triton.lifecycle import python_model

TritonPythonModel = python_model(TextPostprocessor, pb_utils, nice=True)
