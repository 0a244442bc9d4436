"""preprocessing: text -> token ids and validated generation parameters (logic: trtllm_dflash.serve.handlers)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.handlers import Preprocessor
from trtllm_dflash.serve.lifecycle import watch_parent, yield_to_compute
from trtllm_dflash.serve.triton_io import error_response, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        watch_parent()
        params = model_parameters(args)
        yield_to_compute(params.get("io_nice", 0))
        self.pre = Preprocessor(params)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self.pre(pb_utils, request)))
            except Exception as exc:  # every failure becomes this request's error response
                responses.append(error_response(pb_utils, exc))
        return responses
