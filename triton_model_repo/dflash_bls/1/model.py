"""dflash_bls / baseline_bls, and the entry points dflash / baseline (rendered from the ``entry`` template with this
same file; their ``frontend: on`` parameter adds tokenization and detokenization): the decoupled speculative loop,
BLS calls to the step models (logic: trtllm_dflash.serve.triton.bls)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.triton.bls import LoopModel
from trtllm_dflash.serve.triton.lifecycle import watch_parent, yield_to_compute
from trtllm_dflash.serve.settings import ModelSettings


class TritonPythonModel:
    def initialize(self, args):
        watch_parent(needs=("target_verify", "kv_inject", "drafter"))
        settings = ModelSettings.from_args(args)
        yield_to_compute(settings.io_nice)
        self.loop = LoopModel(settings, pb_utils)

    async def execute(self, requests):
        await self.loop.execute(requests)
        return None

    def finalize(self):
        self.loop.finalize()
