"""drafter: one DFlash step for a dynamically batched list of requests (logic: trtllm_dflash.serve.triton.handlers)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.triton.handlers import DrafterStepModel
from trtllm_dflash.serve.triton.lifecycle import watch_parent
from trtllm_dflash.serve.settings import ModelSettings


class TritonPythonModel:
    def initialize(self, args):
        watch_parent()
        self.model = DrafterStepModel(ModelSettings.from_args(args))

    def execute(self, requests):
        return self.model.execute(pb_utils, requests)
