"""The decoupled BLS model: one coroutine per request runs ``loop.run_generation`` over async BLS calls.

``execute`` only parses each request and schedules its coroutine, so one model instance serves many sequences at
once; its step coalescer (``runtime/loop.py``'s ``StepCoalescer``, parameter ``coalesce``) sends the live sequences'
verify / inject / draft calls of one kind as one batched BLS request, so C concurrent sequences step like one batch of
C rows (continuous batching: a sequence joins at its next step and leaves when it ends). A request that fails gets one
error response (INVALID_ARGUMENT for bad input) and the final flag.

The same class is the user-facing entry point (``dflash`` / ``baseline``, ``frontend: on``): it then tokenizes and
validates the text request (handlers.Preprocessor) and detokenizes each response itself, so a client's cancellation
reaches the loop, which Triton 2.51 does not do through an ensemble. A cancelled request (or every request once the
server stops the model) ends before its next step and frees its slots. Past ``max_sequences`` live sequences a
request waits in a bounded queue (``max_queue`` waiting, ``queue_timeout_s`` at most), else it is refused with
UNAVAILABLE and a RESOURCE_EXHAUSTED message naming the limit.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from trtllm_dflash.errors import DFlashError, require
from trtllm_dflash.serve.settings import ModelSettings
from trtllm_dflash.models.layers import stack_padded
from trtllm_dflash.runtime.sampling import PENALTIES, SamplingParams
from trtllm_dflash.serve.trtllm.compat import Options, response_outputs
from trtllm_dflash.serve.triton.lifecycle import StubWatch
from trtllm_dflash.runtime.loop import Call, CoalescedSteps, StepCoalescer, Update, run_generation
from trtllm_dflash.runtime.protocol import GenerateRequest, decode_stops, encode_stops, generate_request
from trtllm_dflash.runtime.steps import SLOTS_EXHAUSTED
from trtllm_dflash.serve.trtllm.token_model import Row
from trtllm_dflash.serve.triton.io import (as_torch, error_response, get, row_views, scalar, tensor,
                                           torch_rows_output)

START, VERIFY, FREE = 0, 1, 2


class StepError(DFlashError):
    """A step model answered with an error (its message is passed on to the client)."""


class Overloaded(DFlashError):
    """Every sequence slot is taken and the wait queue is full (or the wait timed out): UNAVAILABLE."""

    triton_code = "UNAVAILABLE"


class Cancelled(Exception):
    """The client cancelled (or the server is stopping) while the request waited for a slot."""


class TritonSteps(CoalescedSteps):
    """StepClient over BLS calls to the target_verify / kv_inject / drafter models. Taps and K/V are handed to the
    loop as torch tensors (rows of a batched call's outputs; on a GPU they stay in device memory)."""

    def __init__(self, pb_utils, settings: ModelSettings, scored: bool = False) -> None:
        self.pb = pb_utils
        self.target = settings.target_verify_model
        self.injector = settings.kv_inject_model
        self.drafter = settings.drafter_model
        self.max_sequences = settings.max_sequences
        self.max_queue = settings.max_queue
        self.queue_timeout_s = settings.queue_timeout_s
        self.waiting = 0  # requests of this model instance waiting for a slot
        self.watch = StubWatch()
        self.coalescer = StepCoalescer(self._send, enabled=settings.coalesce, max_rows=settings.step_max_batch_size)
        self.on_batch: Callable[[str, int], None] | None = None  # (step kind, rows) per batched call: telemetry
        # ``scored``: a DSpark drafter's confidence head (make-repo's ``auto`` settings say so): the drafter model
        # returns its estimates for each drafted block, kept per sequence as the policy's forecast for its next step
        self.scored = scored
        self.forecasts: dict[int, list[float]] = {}
        # Where the step models run on a GPU, ask for their outputs in device memory: the taps and the injected K/V
        # then go target_verify -> kv_inject -> drafter without touching the host (see ``_rows``).
        self.memory = {}
        if torch.cuda.is_available() and hasattr(pb_utils, "PreferredMemory"):
            self.memory = {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, 0)}

    async def _exec(self, model: str, outputs: list[str], tensors: list):
        """One BLS call; fails fast when the called model's stub dies meanwhile."""
        pb = self.pb
        request = pb.InferenceRequest(model_name=model, requested_output_names=outputs, inputs=tensors, **self.memory)
        stubs = self.watch.current(model)
        call = asyncio.ensure_future(request.async_exec())
        while not (await asyncio.wait({call}, timeout=1.0))[0]:
            if self.watch.died(stubs):  # Triton 2.51 never answers a call whose stub was killed: fail it here
                call.cancel()
                raise StepError(f"step model '{model}' died: its python stub process (pid "
                                f"{', '.join(map(str, sorted(stubs)))}) exited during this request; `serve` "
                                "reloads it (see --on-model-failure), retry the request")
        response = call.result()
        if response.has_error():
            raise StepError(response.error().message())
        return response

    async def _rows(self, model: str, outputs: list[str], **inputs) -> dict:
        """A call with a row per sequence: ``inputs`` numpy arrays or torch tensors with their batch dimension;
        outputs as torch tensors (host copies, or device tensors through DLPack)."""
        pb = self.pb
        tensors = [pb.Tensor(n, np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else torch_rows_output(pb, n, x)
                   for n, x in inputs.items()]
        response = await self._exec(model, outputs, tensors)
        return {n: as_torch(pb.get_output_tensor_by_name(response, n), copy=True) for n in outputs}

    @staticmethod
    def _seq(seq_id: int) -> np.ndarray:
        return np.array([seq_id], dtype=np.uint64)

    def for_request(self, is_cancelled: Callable[[], bool], siblings: "Siblings | None" = None,
                    index: int = 0) -> "RequestSteps":
        return RequestSteps(self, is_cancelled, siblings, index)

    async def wait_for_slot(self, seq_id, prompt_ids, sampling: SamplingParams, want_taps,
                            is_cancelled: Callable[[], bool], keep: int = 0, attempts: list[int] | None = None):
        """``_start``, waiting for a free sequence slot when all are taken: at most ``max_queue`` requests wait, each
        at most ``queue_timeout_s``; beyond that the request is refused (Overloaded). A cancelled waiter leaves.
        ``keep``: siblings that will fork from this sequence (``Siblings``); ``attempts``: each start's send time is
        appended (time.monotonic_ns), so its last is when the sequence was scheduled."""
        attempts = [] if attempts is None else attempts

        async def attempt() -> tuple[bool, object]:
            """One start: (True, its result), or (False, None) when every slot is taken."""
            attempts.append(time.monotonic_ns())
            try:
                return True, await self._start(seq_id, prompt_ids, sampling, want_taps, keep)
            except StepError as exc:
                if SLOTS_EXHAUSTED not in str(exc):
                    raise
                return False, None

        started, result = await attempt()
        if started:
            return result
        limit = f"--max-sequences {self.max_sequences}" if self.max_sequences else "--max-sequences"
        if self.waiting >= self.max_queue:
            raise Overloaded(f"RESOURCE_EXHAUSTED: all sequence slots are in use ({limit}) and {self.waiting} "
                             f"requests already wait for one (--max-queue {self.max_queue}); retry later, or render "
                             "the repository with a larger --max-sequences or --max-queue")
        self.waiting += 1
        try:
            deadline = asyncio.get_running_loop().time() + self.queue_timeout_s
            delay = 0.05
            while True:
                await asyncio.sleep(delay)
                delay = min(0.5, delay * 1.5)  # many waiters must not flood target_verify with refused starts
                if is_cancelled():
                    raise Cancelled()
                started, result = await attempt()
                if started:
                    return result
                if asyncio.get_running_loop().time() > deadline:
                    raise Overloaded(f"RESOURCE_EXHAUSTED: no sequence slot freed within {self.queue_timeout_s:g} s "
                                     f"(--queue-timeout-s; all {limit} slots in use); retry later, or render the "
                                     "repository with a larger --max-sequences") from None
        finally:
            self.waiting -= 1

    def _coalesced(self, n: int) -> dict:
        """The ``coalesced`` input of a step request of n rows: this loop runs one stage at a time, so a CPU step
        model computes it on every core (``handlers.CpuThreads``)."""
        return {"coalesced": np.ones((n, 1), bool)} if self.coalescer.enabled else {}

    async def _start(self, seq_id, prompt_ids, sampling: SamplingParams, want_taps, keep: int = 0,
                     fork_of: int | None = None):
        """A sequence's prefill (``keep``: for that many siblings to fork; ``fork_of``: a sibling's fork of it); with
        the coalescer on, sent at the step barrier (before the step's other calls), so it never computes while this
        loop's draft or inject call does."""
        args = (seq_id, prompt_ids, sampling, want_taps, keep, fork_of)
        if self.coalescer.enabled:
            return await self.coalescer.submit("start", (seq_id,), *args)
        return await self._start_call(*args)

    @staticmethod
    def _start_inputs(sampling: SamplingParams) -> dict[str, np.ndarray]:
        """A sequence's min_tokens ban, penalties, bad words, embedding bias and log-probability request for
        target_verify's start (no inputs for what it has not)."""
        out = {"return_log_probs": np.array([[True]])} if sampling.logprobs else {}
        if sampling.bad_words:
            out["bad_sequences"] = np.array([encode_stops([list(w) for w in sampling.bad_words])], np.int32)
        if sampling.banned_ids:
            out.update({"banned_ids": np.array([sampling.banned_ids], np.int32),
                        "banned_before": np.array([[sampling.banned_before]], np.int32)})
        if sampling.penalized:
            out.update({name: np.array([[getattr(sampling, name)]], np.float32) for name in PENALTIES})
        if sampling.logit_bias:
            ids, weights = zip(*sampling.logit_bias)
            out.update({"bias_ids": np.array([ids], np.int32), "bias_weights": np.array([weights], np.float32)})
        return out

    async def _start_call(self, seq_id, prompt_ids, sampling: SamplingParams, want_taps, keep=0, fork_of=None):
        family = {"keep_prefill": np.array([[keep]], np.int32)} if keep else {}
        if fork_of is not None:
            family["fork_of"] = self._seq(fork_of)[None]
        out = await self._rows(
            self.target, ["out_tokens", "out_log_probs", "taps"], mode=np.array([[START]], np.int32),
            seq_id=self._seq(seq_id)[None],
            tokens=np.array([prompt_ids], np.int32), want_taps=np.array([[want_taps]]),
            temperature=np.array([[sampling.temperature]], np.float32), top_k=np.array([[sampling.top_k]], np.int32),
            top_p=np.array([[sampling.top_p]], np.float32), seed=np.array([[sampling.seed]], np.uint64),
            **self._start_inputs(sampling), **family, **self._coalesced(1))
        return (int(out["out_tokens"][0, 0]), out["taps"][0] if want_taps else None,
                out["out_log_probs"][0, :1].tolist() if sampling.logprobs else None)

    async def _step(self, kind: str, key: tuple, calls: list[Call]) -> list:
        """The coalescer's batched call: one request with a row per sequence, the results split back per row."""
        n = len(calls)

        def column(values, dtype):
            return np.array(values, dtype).reshape(n, 1)

        if kind == "start":  # one request per sequence (its key)
            return [await self._start_call(*calls[0].args)]
        if kind == "inject":
            taps = [c.args[0] for c in calls]
            out = await self._rows(self.injector, ["ctx_k", "ctx_v"], taps=stack_padded(taps, 0),
                                   start=column([c.args[1] for c in calls], np.int32))
            return [(out["ctx_k"][j, :, :len(t)], out["ctx_v"][j, :, :len(t)]) for j, t in enumerate(taps)]
        seqs = column([c.args[0] for c in calls], np.uint64)
        if kind == "verify":
            _, want, parents = key
            tree = {} if parents is None else {"parents": np.array([parents] * n, np.int32)}
            out = await self._rows(self.target, ["out_tokens", "out_log_probs", "taps"],
                                   mode=column([VERIFY] * n, np.int32), seq_id=seqs,
                                   tokens=np.array([c.args[1] for c in calls], np.int32),
                                   want_taps=column([want] * n, bool), **tree, **self._coalesced(n))
            tokens = out["out_tokens"].cpu().numpy()
            emitted = [[int(t) for t in row if t >= 0] for row in tokens]
            logprobs = out["out_log_probs"].tolist()  # NaN for a sequence that did not ask (the loop ignores them)
            return [(e, out["taps"][j, :len(e)] if want else None, logprobs[j][:len(e)])
                    for j, e in enumerate(emitted)]
        ks, vs = [c.args[1] for c in calls], [c.args[2] for c in calls]
        block, top = key
        choices = {} if top == 1 else {"top": column([top] * n, np.int32)}  # a repository rendered before: no input
        out = await self._rows(self.drafter, ["drafts", "confidence"] if self.scored else ["drafts"],
                               mode=column([0] * n, np.int32), seq_id=seqs,
                               ctx_k=stack_padded(ks, 1), ctx_v=stack_padded(vs, 1),
                               ctx_len=column([k.shape[1] for k in ks], np.int32),
                               bonus=column([c.args[3] for c in calls], np.int32),
                               block_size=column([block] * n, np.int32), **choices, **self._coalesced(n))
        drafts = out["drafts"].cpu().numpy()
        if self.scored:
            for c, row in zip(calls, out["confidence"].tolist()):
                self.forecasts[c.args[0]] = row
        return (drafts if top == 1 else drafts.reshape(n, block - 1, top)).tolist()

    def forecast(self, seq_id: int) -> list[float] | None:
        """The drafter's confidence estimates [K] for the sequence's latest drafted block (``BlockDrafter.forecast``,
        returned by the drafter model); None without a confidence head or before the sequence's first draft."""
        return self.forecasts.get(seq_id)

    async def free(self, seq_id, drafter):
        """Free the sequence in both stateful models; a model that cannot answer (it died) is skipped, so the
        request's own error is what the client sees and the other model's slot is still freed."""
        self.coalescer.leave()
        self.forecasts.pop(seq_id, None)
        for model in (self.target, self.drafter) if drafter else (self.target,):
            try:
                await self._rows(model, ["num_active"], mode=np.array([[FREE]], np.int32),
                                 seq_id=self._seq(seq_id)[None])
            except StepError:
                pass


class Siblings:
    """The sequences of one request (``num_return_sequences``): the first prefills the prompt and keeps its last hidden
    state (``keep_prefill``), the others fork it (``TargetVerifier.fork``: its K/V copied, their own first token) and
    take its taps, so the prompt is computed once. The first sequence waits until they have forked (the cache rows
    they copy are its own) before it steps; a sibling that cannot fork (no slot free, or a target that prefills every
    sequence itself) prefills after all."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.parent: asyncio.Future = asyncio.get_running_loop().create_future()  # (seq_id, taps) of the first
        self.pending = set(range(1, n))  # siblings that have not started (forked, prefilled or failed) yet
        self.forked = asyncio.Event()
        if not self.pending:
            self.forked.set()

    def started(self, index: int) -> None:
        """Sibling ``index`` no longer needs the first sequence's rows (idempotent: also called when it ends, so one
        that fails before its start never keeps the first waiting)."""
        self.pending.discard(index)
        if not self.pending:
            self.forked.set()


class RequestSteps:
    """One sequence's view of TritonSteps: the slot wait sees its request's cancellation, and its start shares the
    prefill with its ``siblings`` (sequence ``index`` of them)."""

    def __init__(self, steps: TritonSteps, is_cancelled: Callable[[], bool], siblings: Siblings | None = None,
                 index: int = 0) -> None:
        self._steps, self._is_cancelled = steps, is_cancelled
        self._siblings, self._index = siblings if siblings is not None and siblings.n > 1 else None, index
        self.attempts: list[int] = []  # time.monotonic_ns() of each start sent (the last one got the slot)
        self.first_token_ns = 0  # when the start returned the sequence's first token

    @property
    def scheduled_ns(self) -> int:
        return self.attempts[-1] if self.attempts else 0

    async def start(self, seq_id, prompt_ids, sampling, want_taps):
        started = await self._start(seq_id, prompt_ids, sampling, want_taps)
        self.first_token_ns = time.monotonic_ns()
        return started

    async def _start(self, seq_id, prompt_ids, sampling, want_taps):
        family, steps = self._siblings, self._steps
        if family is None:
            started = await steps.wait_for_slot(seq_id, prompt_ids, sampling, want_taps, self._is_cancelled,
                                                attempts=self.attempts)
        elif self._index == 0:
            try:
                started = await steps.wait_for_slot(seq_id, prompt_ids, sampling, want_taps, self._is_cancelled,
                                                    keep=family.n - 1, attempts=self.attempts)
            except BaseException as exc:
                family.parent.set_exception(exc)  # the siblings end with it
                raise
            family.parent.set_result((seq_id, started[1]))
            await family.forked.wait()
        else:
            started = await self._fork(seq_id, prompt_ids, sampling, want_taps)
        steps.coalescer.join()  # from here until its free, the step barrier waits for this sequence
        return started

    async def _fork(self, seq_id, prompt_ids, sampling, want_taps):
        family = self._siblings
        try:
            parent, taps = await family.parent
            self.attempts.append(time.monotonic_ns())
            first, _, logprobs = await self._steps._start(seq_id, prompt_ids, sampling, False, fork_of=parent)
            return first, taps, logprobs
        except StepError:  # no slot free now, or a target that cannot fork: this sequence prefills itself (below)
            pass
        finally:
            family.started(self._index)  # before any fallback: the first sequence need not wait for it
        return await self._steps.wait_for_slot(seq_id, prompt_ids, sampling, want_taps, self._is_cancelled,
                                               attempts=self.attempts)

    # the rest of the StepClient is the shared TritonSteps' (the calls of every sequence meet in its coalescer)
    async def plan(self, policy, tree, state, lookup_len, last_step):
        return await self._steps.plan(policy, tree, state, lookup_len, last_step)

    def ended(self, policy, tree, last_step) -> None:
        self._steps.ended(policy, tree, last_step)

    async def verify(self, seq_id, block, want_taps, parents=None):
        return await self._steps.verify(seq_id, block, want_taps, parents)

    async def inject(self, taps, start):
        return await self._steps.inject(taps, start)

    async def draft(self, seq_id, k, v, bonus, block_size, top=1):
        return await self._steps.draft(seq_id, k, v, bonus, block_size, top)

    def forecast(self, seq_id: int) -> list[float] | None:
        return self._steps.forecast(seq_id)

    async def free(self, seq_id, drafter):
        await self._steps.free(seq_id, drafter)


def parse_request(pb_utils, request) -> GenerateRequest:
    """The token-level loop's request (``dflash_bls``; preprocessing's outputs, plus an optional ``min_tokens``)."""
    from trtllm_dflash.serve.triton.handlers import sampling_from

    raw = np.asarray(get(pb_utils, request, "input_ids"))
    require(raw.ndim <= 1, "input_ids shape", [*raw.shape], "must be one prompt per request ([1, tokens])",
            "send one request per prompt (the tensorrt_llm model takes batches)")
    ids = tuple(int(t) for t in raw.reshape(-1))
    max_tokens = scalar(pb_utils, request, "max_tokens", None, int)
    stops = decode_stops(np.asarray(get(pb_utils, request, "stop_sequences", [])).reshape(-1).tolist())
    min_tokens = scalar(pb_utils, request, "min_tokens", 0, int)
    require(0 <= min_tokens <= (max_tokens or 0), "min_tokens", min_tokens, f"must be in [0, max_tokens={max_tokens}]")
    return generate_request(ids, max_tokens, sampling_from(pb_utils, request), stops,
                            bool(scalar(pb_utils, request, "stream", False, bool)), min_tokens)


def load_adaptive(path: str) -> dict:
    """The ``--block-size auto`` settings make-repo wrote next to a dflash_bls model (``render.adaptive_settings``)."""
    from trtllm_dflash.errors import read_json

    return read_json(path, "re-render the repository with `trtllm-dflash make-repo --block-size auto`")


def load_policy(path: str):
    """The ``--block-size auto`` policy of a dflash_bls model from the settings make-repo wrote next to it."""
    return policy_from_settings(load_adaptive(path))


def policy_from_settings(doc: dict):
    """An AdaptivePolicy from make-repo's ``auto`` settings (``serve.triton.render.adaptive_settings``)."""
    from trtllm_dflash.runtime.cost import CostModel
    from trtllm_dflash.runtime.policy import AdaptivePolicy

    return AdaptivePolicy(CostModel.from_json(doc["cost"]), int(doc["max_block_size"]), doc.get("prior"),
                          ngram=bool(doc.get("ngram", False)))


def load_tree(settings: ModelSettings, block_size, ngram: bool):
    """The tree a dflash loop verifies with (``tree: on``; the same ``runtime.tree.tree_for`` shape
    make-repo sized target_verify's cache for) and its retrieval datastore; (None, None) without one."""
    if not settings.tree:
        return None, None
    from trtllm_dflash.runtime.datastore import Datastore
    from trtllm_dflash.runtime.tree import tree_for

    store = Datastore.load(settings.datastore) if settings.datastore else None
    return tree_for(int(block_size) - 1, ngram, store is not None), store


class LoopModel:
    def __init__(self, params: ModelSettings | dict[str, str], pb_utils) -> None:
        s = ModelSettings.of(params)
        self.pb = pb_utils
        self.block_size = s.block_size
        doc = load_adaptive(s.adaptive) if s.adaptive_block else None
        self.policy = policy_from_settings(doc) if doc is not None else None
        self.ngram = s.ngram
        longest = self.policy.max_k + 1 if self.policy is not None else self.block_size  # auto: its longest block
        self.tree, self.datastore = load_tree(s, longest, self.ngram)
        self.steps = TritonSteps(pb_utils, s, scored=bool(doc and doc.get("confidence")))
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False  # set by finalize: every live request ends before its next step
        self.frontend = self.tokens = None
        if s.frontend == "on":  # the entry point: text in, text out (no ensemble around it)
            from trtllm_dflash.serve.triton.handlers import Preprocessor

            self.frontend = Preprocessor(s)
        elif s.frontend == "tokens":  # tensorrt_llm: TensorRT-LLM's token-level model
            from trtllm_dflash.serve.trtllm.token_model import TokenFrontend

            self.tokens = TokenFrontend(s)
        self.live_ids: dict[str, list[dict]] = {}  # request id -> its live requests' state (tensorrt_llm's stop)
        self.telemetry = None
        if s.metrics:
            from trtllm_dflash.serve.triton.telemetry import LoopTelemetry

            self.telemetry = LoopTelemetry(pb_utils, s.model_name or "dflash_bls",
                                           self.policy.max_k + 1 if self.policy is not None else self.block_size)
            self.steps.on_batch = self.telemetry.step_call

    async def execute(self, requests) -> None:
        """Schedule each request's coroutine and return at once: its responses go through its response sender (also
        on the unary ``tensorrt_llm`` model, rendered ``--tensorrt-llm-unary``: one final response per request)."""
        for request in requests:
            task = asyncio.get_running_loop().create_task(self._serve(request))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def finalize(self) -> None:
        """Server shutdown or unload: live generations stop at their next step instead of running to max_tokens."""
        self.stopping = True

    def _response(self, u: Update, detok=None, text=None, extra=()):
        """``detok``: the request's ``IncrementalDetokenizer`` (entry models: a text delta of the new tokens);
        ``text``: the response's text instead (the prompt echoed: ``exclude_input_in_output`` false); ``extra``:
        (name, array) outputs asked for (``compat.response_outputs``; the token-level model: the log-probabilities)."""
        pb = self.pb
        if detok is not None:  # the ensemble's outputs: text_output is the text delta postprocessing would send
            if text is None:
                text = detok.push(u.tokens[u.prev_len:]) + (detok.flush() if u.final else "")
            # 1-D like TensorRT-LLM's postprocessing (its clients read as_numpy("text_output")[0].decode())
            tensors = [pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object)),
                       *(pb.Tensor(name, value) for name, value in extra)]
        else:
            tensors = [tensor(pb, "prev_len", np.array([u.prev_len], dtype=np.int32)),
                       tensor(pb, "is_final", np.array([u.final], dtype=bool)),
                       *(pb.Tensor(name, value) for name, value in extra)]
        return pb.InferenceResponse(output_tensors=[
            *tensors,
            tensor(pb, "output_ids", np.array(u.tokens, dtype=np.int32)),
            tensor(pb, "acceptance_lengths", np.array(u.acceptance_lengths, dtype=np.int32)),
            tensor(pb, "num_draft_tokens", np.array([u.num_draft_tokens], dtype=np.int32)),
            tensor(pb, "num_accepted_draft_tokens", np.array([u.num_accepted_draft_tokens], dtype=np.int32)),
        ])

    async def _serve(self, request) -> None:
        """One request: its rows (the ``tensorrt_llm`` model's batch; one otherwise), each of its
        ``num_return_sequences`` sequences (TensorRT-LLM's: sequence i samples with seed + i, its responses carry
        ``sequence_index`` i when there are several) run as concurrent loops sharing the row's prefill
        (``Siblings``), so they step as rows of the same batched calls; the final flag goes with the last sequence's
        last response. A sequence that fails ends the others at their next step and the request with its error."""
        pb, sender = self.pb, request.get_response_sender()
        if self.tokens is not None and self.tokens.is_stop(pb, request):
            return self._stop(request, sender)
        done = {"final_sent": False, "failed": None, "live": 1, "stopped": False}
        arrival_ns = time.monotonic_ns()
        request_id = request.request_id() if self.tokens is not None else ""
        if request_id:
            self.live_ids.setdefault(request_id, []).append(done)

        def cancelled() -> bool:
            return self.stopping or sender.is_cancelled() or done["failed"] is not None or done["stopped"]

        async def sequence(row: Row, siblings: Siblings, index: int, batch: int) -> None:
            gen, opts = row.gen, row.opts
            detok = None
            if self.frontend is not None:
                from trtllm_dflash.runtime.text import IncrementalDetokenizer

                detok = IncrementalDetokenizer(self.frontend.tokenizer)
            if index:
                gen = replace(gen, sampling=replace(gen.sampling, seed=(gen.sampling.seed + index) % 2 ** 64))
            totals = [0, 0]  # draft tokens proposed, accepted (return_perf_metrics)
            steps = self.steps.for_request(cancelled, siblings, index)
            labels = [("sequence_index", np.array([[index]], np.int32))] if opts.sequences > 1 else []
            if batch > 1:
                labels.append(("batch_index", np.array([[row.index]], np.int32)))

            ended = []  # this sequence's final update, once sent

            async def on_update(u: Update) -> None:
                done["live"] -= u.final
                if u.final:
                    ended.append(u)
                last = u.final and done["live"] == 0
                if self.telemetry is not None:
                    self.telemetry.record(u, last)
                totals[0] += u.num_draft_tokens
                totals[1] += u.num_accepted_draft_tokens
                times = (arrival_ns, steps.scheduled_ns, steps.first_token_ns, time.monotonic_ns() if u.final else 0)
                if self.tokens is not None:
                    response = pb.InferenceResponse(output_tensors=[
                        pb.Tensor(n, v) for n, v in self.tokens.outputs(row, u, *totals, times, labels)])
                else:
                    extra = response_outputs(opts, len(gen.input_ids), len(u.tokens) - u.prev_len, *totals,
                                             u.logprobs, times)
                    text = None
                    if u.final and not opts.exclude_input and not gen.stream:  # TRT-LLM decodes prompt and answer
                        text = self.frontend.tokenizer.decode(list(gen.input_ids) + u.tokens, skip_special_tokens=True)
                    response = self._response(u, detok, text, [*extra, *labels])
                sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)
                done["final_sent"] = done["final_sent"] or last

            if self.telemetry is not None:
                self.telemetry.active(+1)
            try:
                try:
                    await run_generation(steps, gen, self.block_size, secrets.randbits(62), on_update,
                                         is_cancelled=cancelled, policy=self.policy, ngram=self.ngram, tree=self.tree,
                                         datastore=self.datastore, report_cancelled=lambda: done["stopped"])
                except Cancelled:
                    pass
                if done["stopped"] and not ended:  # stopped before its start: an empty result, as TensorRT-LLM's
                    await on_update(Update([], 0, [], 0, 0, True, "cancelled"))
            except Exception as exc:  # the first failure ends the request; the other sequences stop at their next step
                if done["failed"] is None:
                    done["failed"] = exc
            finally:
                siblings.started(index)  # one that ended before its start keeps the first sequence waiting no more
                if self.telemetry is not None:
                    self.telemetry.active(-1)

        try:
            if self.frontend is not None:  # a batch of texts: one row each (TensorRT-LLM's batch_index on responses)
                rows = [Row(*self.frontend.parse_options(view, request), b)
                        for b, view in enumerate(row_views(pb, request, "text_input"))]
            elif self.tokens is not None:
                rows = self.tokens.parse(pb, request)
            else:  # the token-level loop: of TensorRT-LLM's options, the log-probabilities and the sequences only
                gen = parse_request(pb, request)
                n = scalar(pb, request, "num_return_sequences", 1, int)
                require(n >= 1, "num_return_sequences", n, "must be at least 1")
                rows = [Row(gen, Options(log_probs=gen.sampling.logprobs, sequences=n), 0)]
            limit = self.steps.max_sequences
            for row in rows:
                require(not limit or row.opts.sequences <= limit, "num_return_sequences", row.opts.sequences,
                        f"must be at most --max-sequences {limit} (every sequence of a request holds a slot at once)",
                        f"ask for at most {limit}, or render the repository with a larger --max-sequences")
            done["live"] = sum(row.opts.sequences for row in rows)
            families = [Siblings(row.opts.sequences) for row in rows]  # each row's prompt is prefilled once
            await asyncio.gather(*(sequence(row, family, i, len(rows)) for row, family in zip(rows, families)
                                   for i in range(row.opts.sequences)))
            if done["failed"] is not None:
                raise done["failed"]
        except Exception as exc:  # the client gets the message; the server keeps serving
            if not done["final_sent"]:
                done["final_sent"] = _send_final(pb, sender, error_response(pb, exc))
        finally:
            if not done["final_sent"]:  # cancelled: no more data, but the stream must still be closed
                _send_final(pb, sender, None)
            if request_id:
                live = self.live_ids[request_id]
                live.remove(done)
                if not live:
                    del self.live_ids[request_id]

    def _stop(self, request, sender) -> None:
        """TensorRT-LLM's stop request: the live requests with its request id end at their next step, each sequence
        with a final response of its tokens so far; the stop request gets one empty final response (or an error naming
        what is missing)."""
        pb, request_id = self.pb, request.request_id()
        try:
            require(bool(request_id), "stop", True, "needs the request id of the request to stop",
                    "send the stop request with that request's id (tritonclient: request_id=...)")
            for done in self.live_ids.get(request_id, ()):
                done["stopped"] = True
            _send_final(pb, sender, pb.InferenceResponse(output_tensors=[]))
        except Exception as exc:  # noqa: BLE001 - the client gets the message
            _send_final(pb, sender, error_response(pb, exc))


def _send_final(pb, sender, response) -> bool:
    """The last response of a request (or just the final flag); a stream the client already closed is no error."""
    try:
        if response is None:
            sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return True
    except Exception:  # noqa: BLE001 - nothing left to tell the client
        return False
