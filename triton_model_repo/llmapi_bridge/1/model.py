"""dflash_llmapi / baseline_llmapi: our ensemble I/O over NVIDIA's LLM-API model (logic: trtllm_dflash.serve.trtllm.llmapi)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.trtllm.llmapi import LlmApiBridge
from trtllm_dflash.serve.triton.lifecycle import python_model

TritonPythonModel = python_model(LlmApiBridge, pb_utils)
