"""preprocessing: TensorRT-LLM's tokenizer model, QUERY -> INPUT_ID and the rest (logic: trtllm_dflash.serve.trtllm.text)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.trtllm.text import TextPreprocessor
from trtllm_dflash.serve.triton.lifecycle import python_model

TritonPythonModel = python_model(TextPreprocessor, pb_utils, nice=True)
