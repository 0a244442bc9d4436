"""dflash_llmapi / baseline_llmapi: our ensemble I/O over NVIDIA's LLM-API model (logic: trtllm_dflash.serve.trtllm.llmapi)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.trtllm.llmapi import LlmApiBridge
from trtllm_dflash.serve.triton.lifecycle import watch_parent
from trtllm_dflash.serve.settings import ModelSettings


class TritonPythonModel:
    def initialize(self, args):
        watch_parent()
        self.bridge = LlmApiBridge(ModelSettings.from_args(args), pb_utils)

    async def execute(self, requests):
        await self.bridge.execute(requests)
        return None
