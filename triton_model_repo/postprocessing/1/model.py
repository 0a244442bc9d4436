"""postprocessing: TensorRT-LLM's detokenizer model, TOKENS_BATCH -> OUTPUT (logic: trtllm_dflash.serve.trtllm.text)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.triton.lifecycle import watch_parent, yield_to_compute
from trtllm_dflash.serve.trtllm.text import TextPostprocessor
from trtllm_dflash.serve.settings import ModelSettings


class TritonPythonModel:
    def initialize(self, args):
        watch_parent()
        settings = ModelSettings.from_args(args)
        yield_to_compute(settings.io_nice)
        self.model = TextPostprocessor(settings)

    def execute(self, requests):
        return self.model.execute(pb_utils, requests)
