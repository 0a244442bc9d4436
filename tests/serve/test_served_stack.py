"""The served loop in one process: ``dflash_bls``'s ``LoopModel`` over the real step-model handlers, its BLS calls
answered in-process by a stand-in for Triton's python-backend utilities. It gives the tokens of the in-process API,
and one draft call's stack says which files of the package it passes through (docs/architecture.md counts them)."""

import asyncio
import traceback
from pathlib import Path

import numpy as np
import torch

import trtllm_dflash
from conftest import greedy_reference

PACKAGE = Path(trtllm_dflash.__file__).parent


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array

    def is_cpu(self):
        return True


class Response:
    def __init__(self, output_tensors=(), error=None):
        self.outputs, self._error = {t.name(): t for t in output_tensors}, error

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


class Error:
    INVALID_ARG, INTERNAL, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "UNAVAILABLE"

    def __init__(self, message, code=None):
        self._message = message

    def message(self):
        return self._message


class Sender:
    def __init__(self):
        self.responses, self.finished = [], asyncio.Event()

    def send(self, response=None, flags=0):
        if response is not None:
            self.responses.append(response)
        if flags:
            self.finished.set()

    def is_cancelled(self):
        return False


class Request:
    def __init__(self, inputs, sender=None):
        self.inputs, self.sender = {t.name(): t for t in inputs}, sender

    def get_response_sender(self):
        return self.sender


class Pb:
    """What the handlers and the loop model use of ``triton_python_backend_utils``; BLS requests go to ``models``."""

    Tensor, InferenceResponse, TritonError = Tensor, Response, Error
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    def __init__(self):
        self.models = {}
        self.sent: dict[str, list] = {}  # model -> the stack of each BLS request made to it, where it was made
        pb = self

        class InferenceRequest:
            def __init__(self, model_name, requested_output_names, inputs, **_):
                self.model, self.request = model_name, Request(inputs)
                pb.sent.setdefault(model_name, []).append(traceback.extract_stack())

            async def async_exec(self):
                return pb.models[self.model].execute([self.request])[0]

        self.InferenceRequest = InferenceRequest

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.inputs.get(name)

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return response.outputs.get(name)


def test_a_served_draft_call_passes_through_at_most_six_files_and_the_loop_is_lossless(tiny_dirs, tmp_path,
                                                                                         monkeypatch):
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.models import drafter as drafter_module
    from trtllm_dflash.serve.triton.bls import LoopModel
    from trtllm_dflash.serve.triton.handlers import DrafterStepModel, KVInjectModel, TargetVerifyModel
    from trtllm_dflash.serve.triton.render import RepoConfig, config_parameters, make_repo

    tdir, ddir = map(str, tiny_dirs["llama"])
    repo = make_repo(RepoConfig(tdir, ddir, block_size=4, max_seq_len=96, max_sequences=2, ngram=False),
                     tmp_path / "repo")
    params = {m.name: config_parameters((m / "config.pbtxt").read_text()) for m in repo.iterdir()
              if (m / "config.pbtxt").is_file()}
    pb = Pb()
    pb.models = {"target_verify": TargetVerifyModel(params["target_verify"], pb),
                 "kv_inject": KVInjectModel(params["kv_inject"], pb),
                 "drafter": DrafterStepModel(params["drafter"], pb)}
    loop = LoopModel({**params["dflash_bls"], "metrics": "off"}, pb)  # Triton's metric families are not stood in for
    stacks = []
    real = drafter_module.DrafterModel.draft

    def draft(self, *args, **kwargs):  # the drafter's forward over a block: where the draft pass computes
        stacks.append(traceback.extract_stack())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(drafter_module.DrafterModel, "draft", draft)
    prompt = [5, 9, 14, 3, 7, 22, 5, 9]
    sender = Sender()
    request = Request([Tensor("input_ids", np.array([prompt], np.int32)),
                       Tensor("max_tokens", np.array([[24]], np.int32))], sender)

    async def serve():
        await loop.execute([request])
        await asyncio.wait_for(sender.finished.wait(), 120)

    asyncio.run(serve())
    tokens = sender.responses[-1].outputs["output_ids"].as_numpy().reshape(-1).tolist()
    target, _ = load_pair(tdir, ddir, dtype=torch.float32)
    assert tokens == list(greedy_reference(target, [prompt], 24)[0])
    assert stacks, "no draft call reached the drafter"

    def files(stack) -> set[str]:
        return {str(Path(f.filename).relative_to(PACKAGE)) for f in stack if Path(f.filename).is_relative_to(PACKAGE)}

    # the loop model's process, up to the BLS request, and the drafter model's, from its execute to the drafter
    loop_side, drafter_side = files(pb.sent["drafter"][0]), files(stacks[0])
    print("a served draft call's frames: loop model", sorted(loop_side), "drafter model", sorted(drafter_side))
    files = sorted(loop_side | drafter_side)
    assert {"serve/triton/bls.py", "runtime/stepper.py", "serve/triton/handlers.py", "runtime/steps.py"} <= set(files)
    assert len(files) <= 6, files
