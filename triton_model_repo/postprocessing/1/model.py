"""postprocessing: TensorRT-LLM's detokenizer model, TOKENS_BATCH -> OUTPUT (logic: trtllm_dflash.serve.trtllm.text)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.triton.lifecycle import watch_parent, yield_to_compute
from trtllm_dflash.serve.triton.io import model_parameters
from trtllm_dflash.serve.trtllm.text import TextPostprocessor


class TritonPythonModel:
    def initialize(self, args):
        watch_parent()
        params = model_parameters(args)
        yield_to_compute(params.get("io_nice", 0))
        self.model = TextPostprocessor(params)

    def execute(self, requests):
        return self.model.execute(pb_utils, requests)
