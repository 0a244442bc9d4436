"""The decoupled BLS model: one coroutine per request runs ``loop.run_generation`` over async BLS calls.

``execute`` only parses each request and schedules its coroutine, so one model instance serves many sequences at
once; the step models' dynamic batchers then batch the concurrent sequences' steps (continuous batching emerges from
the server). A request that fails gets one error response (INVALID_ARGUMENT for bad input) and the final flag.
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import torch

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.serve.loop import Update, run_generation
from trtllm_dflash.serve.protocol import GenerateRequest, decode_stops
from trtllm_dflash.serve.steps import SLOTS_EXHAUSTED
from trtllm_dflash.serve.triton_io import error_response, get, scalar, tensor

START, VERIFY, FREE = 0, 1, 2


class StepError(DFlashError):
    """A step model answered with an error (its message is passed on to the client)."""


class TritonSteps:
    """StepClient over BLS calls to the target_verify / kv_inject / drafter models."""

    def __init__(self, pb_utils, params: dict[str, str]) -> None:
        self.pb = pb_utils
        self.target = params["target_verify_model"]
        self.injector = params.get("kv_inject_model", "kv_inject")
        self.drafter = params.get("drafter_model", "drafter")
        self.slot_wait_s = float(params.get("slot_wait_s", "300"))
        # Where the step models run on a GPU, ask for their outputs in device memory: the taps and the injected K/V
        # then go target_verify -> kv_inject -> drafter without touching the host (see ``_call``).
        self.memory = {}
        if torch.cuda.is_available() and hasattr(pb_utils, "PreferredMemory"):
            self.memory = {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, 0)}

    async def _call(self, model: str, outputs: list[str], keep: tuple[str, ...] = (), **inputs) -> dict:
        """One BLS call. ``inputs`` are numpy arrays (given a batch dimension here) or tensors taken from an earlier
        response, passed on as they are; the outputs named in ``keep`` are returned as such tensors (opaque handles
        for the loop: taps, ctx_k, ctx_v), the others as numpy arrays without their batch dimension."""
        pb = self.pb
        request = pb.InferenceRequest(
            model_name=model, requested_output_names=outputs, **self.memory,
            inputs=[pb.Tensor(name, np.ascontiguousarray(arr[None])) if isinstance(arr, np.ndarray) else arr
                    for name, arr in inputs.items()])
        response = await request.async_exec()
        if response.has_error():
            raise StepError(response.error().message())
        return {n: pb.get_output_tensor_by_name(response, n) if n in keep
                else pb.get_output_tensor_by_name(response, n).as_numpy()[0] for n in outputs}

    @staticmethod
    def _seq(seq_id: int) -> np.ndarray:
        return np.array([seq_id], dtype=np.uint64)

    async def start(self, seq_id, prompt_ids, sampling: SamplingParams, want_taps):
        """Waits (up to ``slot_wait_s``) for a free sequence slot rather than failing: concurrency above the
        repository's max_sequences queues instead of erroring."""
        deadline = asyncio.get_running_loop().time() + self.slot_wait_s
        while True:
            try:
                return await self._start(seq_id, prompt_ids, sampling, want_taps)
            except StepError as exc:
                if SLOTS_EXHAUSTED not in str(exc) or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.05)

    async def _start(self, seq_id, prompt_ids, sampling: SamplingParams, want_taps):
        out = await self._call(
            self.target, ["out_tokens", "taps"], ("taps",), mode=np.array([START], np.int32), seq_id=self._seq(seq_id),
            tokens=np.array(prompt_ids, np.int32), want_taps=np.array([want_taps]),
            temperature=np.array([sampling.temperature], np.float32), top_k=np.array([sampling.top_k], np.int32),
            top_p=np.array([sampling.top_p], np.float32), seed=np.array([sampling.seed], np.uint64))
        return int(out["out_tokens"][0]), out["taps"] if want_taps else None

    async def verify(self, seq_id, block, want_taps):
        out = await self._call(self.target, ["out_tokens", "taps"], ("taps",), mode=np.array([VERIFY], np.int32),
                               seq_id=self._seq(seq_id), tokens=np.array(block, np.int32),
                               want_taps=np.array([want_taps]))
        return out["out_tokens"].tolist(), out["taps"] if want_taps else None

    async def inject(self, taps, start):
        out = await self._call(self.injector, ["ctx_k", "ctx_v"], ("ctx_k", "ctx_v"), taps=taps,
                               start=np.array([start], np.int32))
        return out["ctx_k"], out["ctx_v"]

    async def draft(self, seq_id, k, v, bonus, block_size):
        out = await self._call(self.drafter, ["drafts"], mode=np.array([0], np.int32), seq_id=self._seq(seq_id),
                               ctx_k=k, ctx_v=v, bonus=np.array([bonus], np.int32),
                               block_size=np.array([block_size], np.int32))
        return out["drafts"].tolist()

    async def free(self, seq_id, drafter):
        await self._call(self.target, ["num_active"], mode=np.array([FREE], np.int32), seq_id=self._seq(seq_id))
        if drafter:
            await self._call(self.drafter, ["num_active"], mode=np.array([FREE], np.int32), seq_id=self._seq(seq_id))


def parse_request(pb_utils, request) -> GenerateRequest:
    return GenerateRequest(
        input_ids=tuple(int(t) for t in np.asarray(get(pb_utils, request, "input_ids")).reshape(-1)),
        max_tokens=scalar(pb_utils, request, "max_tokens", None, int),
        sampling=SamplingParams(scalar(pb_utils, request, "temperature", 0.0, float),
                                scalar(pb_utils, request, "top_k", 0, int),
                                scalar(pb_utils, request, "top_p", 1.0, float),
                                scalar(pb_utils, request, "seed", 0, int)),
        stop_sequences=decode_stops(np.asarray(get(pb_utils, request, "stop_sequences", [])).reshape(-1).tolist()),
        stream=bool(scalar(pb_utils, request, "stream", False, bool)),
    )


def load_policy(path: str):
    """The ``--block-size auto`` policy of a dflash_bls model from the settings make-repo wrote next to it."""
    from trtllm_dflash.errors import read_json
    from trtllm_dflash.runtime.adaptive import AdaptivePolicy, CostModel

    doc = read_json(path, "re-render the repository with `trtllm-dflash make-repo --block-size auto`")
    return AdaptivePolicy(CostModel.from_json(doc["cost"]), int(doc["max_block_size"]), doc.get("prior"),
                          ngram=bool(doc.get("ngram", False)))


class LoopModel:
    def __init__(self, params: dict[str, str], pb_utils) -> None:
        self.pb = pb_utils
        self.block_size = params["block_size"] if params["block_size"] == "auto" else int(params["block_size"])
        self.policy = load_policy(params["adaptive"]) if self.block_size == "auto" else None
        self.steps = TritonSteps(pb_utils, params)
        self.tasks: set[asyncio.Task] = set()
        self.telemetry = None
        if params.get("metrics", "on") == "on":
            from trtllm_dflash.serve.telemetry import LoopTelemetry

            self.telemetry = LoopTelemetry(pb_utils, params.get("model_name", "dflash_bls"),
                                           self.policy.max_k + 1 if self.policy is not None else self.block_size)

    async def execute(self, requests) -> None:
        for request in requests:
            task = asyncio.get_running_loop().create_task(self._serve(request))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _response(self, u: Update):
        pb = self.pb
        return pb.InferenceResponse(output_tensors=[
            tensor(pb, "output_ids", np.array(u.tokens, dtype=np.int32)),
            tensor(pb, "prev_len", np.array([u.prev_len], dtype=np.int32)),
            tensor(pb, "is_final", np.array([u.final], dtype=bool)),
            tensor(pb, "acceptance_lengths", np.array(u.acceptance_lengths, dtype=np.int32)),
            tensor(pb, "num_draft_tokens", np.array([u.num_draft_tokens], dtype=np.int32)),
            tensor(pb, "num_accepted_draft_tokens", np.array([u.num_accepted_draft_tokens], dtype=np.int32)),
        ])

    async def _serve(self, request) -> None:
        pb, sender = self.pb, request.get_response_sender()
        final_sent = False

        async def on_update(u: Update) -> None:
            nonlocal final_sent
            if self.telemetry is not None:
                self.telemetry.record(u)
            flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if u.final else 0
            sender.send(self._response(u), flags=flags)
            final_sent = final_sent or u.final

        if self.telemetry is not None:
            self.telemetry.active(+1)
        try:
            gen = parse_request(pb, request)
            await run_generation(self.steps, gen, self.block_size, secrets.randbits(62), on_update,
                                 is_cancelled=sender.is_cancelled, policy=self.policy)
        except Exception as exc:  # the client gets the message; the server keeps serving
            if not final_sent:
                sender.send(error_response(pb, exc), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                final_sent = True
        finally:
            if not final_sent:  # cancelled: no more data, but the stream must still be closed
                sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            if self.telemetry is not None:
                self.telemetry.active(-1)
