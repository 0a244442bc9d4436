"""dflash / baseline: the entry point. Text in, streamed text out (the ensemble's I/O), with tokenization, the
decoupled speculative loop and detokenization in this one model, so a client's cancellation reaches the loop
(logic: trtllm_dflash.serve.bls)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.bls import LoopModel
from trtllm_dflash.serve.lifecycle import watch_parent
from trtllm_dflash.serve.triton_io import model_parameters


class TritonPythonModel:
    def initialize(self, args):
        watch_parent(needs=("target_verify", "kv_inject", "drafter"))
        self.loop = LoopModel(model_parameters(args), pb_utils)

    async def execute(self, requests):
        await self.loop.execute(requests)
        return None

    def finalize(self):
        self.loop.finalize()
