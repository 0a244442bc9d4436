"""postprocessing: TensorRT-LLM's detokenizer model, TOKENS_BATCH -> OUTPUT (logic: trtllm_dflash.serve.trtllm_text)."""

import triton_python_backend_utils as pb_utils

from trtllm_dflash.serve.lifecycle import watch_parent, yield_to_compute
from trtllm_dflash.serve.triton_io import error_response, model_parameters
from trtllm_dflash.serve.trtllm_text import TextPostprocessor, request_reader


class TritonPythonModel:
    def initialize(self, args):
        watch_parent()
        params = model_parameters(args)
        yield_to_compute(params.get("io_nice", 0))
        self.post = TextPostprocessor(params)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = [pb_utils.Tensor(n, a) for n, a in self.post(request_reader(pb_utils, request))]
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
            except Exception as exc:
                responses.append(error_response(pb_utils, exc))
        return responses
