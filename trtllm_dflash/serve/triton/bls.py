"""The decoupled BLS model: the model's ``Stepper`` steps every live request's sequences over BLS calls.

``execute`` only parses each request and adds its sequences to the model instance's stepper (``runtime.stepper``);
one task steps them all: each step is one start call per new sequence, one ``kv_inject``, one ``drafter`` and one
``target_verify`` request for every live row, so C concurrent sequences step like one batch of C rows (continuous
batching: a sequence joins at the next step and leaves when it ends). A request that fails gets one error response
(INVALID_ARGUMENT for bad input) and the final flag.

The same class is the user-facing entry point (``dflash`` / ``baseline``, ``frontend: on``): it then tokenizes and
validates the text request (handlers.Preprocessor) and detokenizes each response itself, so a client's cancellation
reaches the stepper, which Triton 2.51 does not do through an ensemble. A cancelled request (or every request once the
server stops the model) ends before its next step and frees its slots. Past ``max_sequences`` live sequences a
request waits for a slot (``max_queue`` waiting, ``queue_timeout_s`` at most), else it is refused with UNAVAILABLE
and a RESOURCE_EXHAUSTED message naming the limit.
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
from trtllm_dflash.runtime.mode import DecodeMode
from trtllm_dflash.runtime.protocol import GenerateRequest, decode_stops, encode_stops, generate_request
from trtllm_dflash.runtime.stepper import Admission, Sequence, Start, Stepper, Update
from trtllm_dflash.serve.trtllm.token_model import Row
from trtllm_dflash.serve.triton.io import (as_torch, error_response, get, row_views, scalar, tensor,
                                           torch_rows_output)

START, VERIFY, FREE = 0, 1, 2


class StepError(DFlashError):
    """A step model answered with an error (its message is passed on to the client)."""


class Overloaded(DFlashError):
    """Every sequence slot is taken and the wait queue is full (or the wait timed out): UNAVAILABLE."""

    triton_code = "UNAVAILABLE"


class TritonSteps:
    """The stepper's ``StepEngines`` over BLS calls to the target_verify / kv_inject / drafter models: one request per
    batch of rows (at most ``step_max_batch_size``; with ``coalesce: off`` one request per row, sent together). Taps
    and K/V are handed to the stepper as torch tensors (rows of a batched call's outputs; on a GPU they stay in
    device memory)."""

    def __init__(self, pb_utils, settings: ModelSettings, scored: bool = False) -> None:
        self.pb = pb_utils
        self.target = settings.target_verify_model
        self.injector = settings.kv_inject_model
        self.drafter = settings.drafter_model
        self.max_sequences = settings.max_sequences
        self.coalesce = settings.coalesce
        self.max_rows = settings.step_max_batch_size if settings.coalesce else 1
        self.watch = StubWatch()
        self.on_batch: Callable[[str, int], None] | None = None  # (step kind, rows) per request sent: telemetry
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

    def _coalesced(self, n: int) -> dict:
        """The ``coalesced`` input of a step request of n rows: the stepper runs one stage at a time, so a CPU step
        model computes it on every core (``handlers.CpuThreads``)."""
        return {"coalesced": np.ones((n, 1), bool)} if self.coalesce else {}

    async def _batched(self, kind: str, call, *columns) -> list:
        """``call(*chunk)`` for each chunk of at most ``max_rows`` rows of the ``columns``, sent together; the rows'
        results in order."""
        n = len(columns[0])
        chunks = [[c[i:i + self.max_rows] for c in columns] for i in range(0, n, self.max_rows)]
        if self.on_batch is not None:
            for chunk in chunks:
                self.on_batch(kind, len(chunk[0]))
        if len(chunks) == 1:  # awaited in the stepper's own task: no task of its own to schedule
            return await call(*chunks[0])
        results = await asyncio.gather(*(call(*chunk) for chunk in chunks))
        return [r for chunk in results for r in chunk]

    def planned(self, rows: int) -> None:
        if self.on_batch is not None:
            self.on_batch("plan", rows)

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

    async def batch_start(self, starts: list[Start]) -> list:
        """One start request per sequence (its prefill, or a fork of a sibling's), sent together; a row whose start
        fails gets its error."""
        if self.on_batch is not None:
            for _ in starts:
                self.on_batch("start", 1)
        if len(starts) == 1:
            try:
                return [await self._start(starts[0])]
            except Exception as exc:  # noqa: BLE001 - the stepper ends or queues that sequence
                return [exc]
        return list(await asyncio.gather(*(self._start(s) for s in starts), return_exceptions=True))

    async def _start(self, s: Start):
        family = {"keep_prefill": np.array([[s.keep]], np.int32)} if s.keep else {}
        if s.fork_of is not None:
            family["fork_of"] = self._seq(s.fork_of)[None]
        sampling = s.sampling
        out = await self._rows(
            self.target, ["out_tokens", "out_log_probs", "taps"], mode=np.array([[START]], np.int32),
            seq_id=self._seq(s.seq_id)[None],
            tokens=np.array([s.prompt], np.int32), want_taps=np.array([[s.want_taps]]),
            temperature=np.array([[sampling.temperature]], np.float32), top_k=np.array([[sampling.top_k]], np.int32),
            top_p=np.array([[sampling.top_p]], np.float32), seed=np.array([[sampling.seed]], np.uint64),
            **self._start_inputs(sampling), **family, **self._coalesced(1))
        return (int(out["out_tokens"][0, 0]), out["taps"][0] if s.want_taps else None,
                out["out_log_probs"][0, :1].tolist() if sampling.logprobs else None)

    async def batch_inject(self, taps: list, starts: list[int]) -> list[tuple]:
        async def call(taps, starts):
            out = await self._rows(self.injector, ["ctx_k", "ctx_v"], taps=stack_padded(taps, 0),
                                   start=np.array(starts, np.int32).reshape(-1, 1))
            return [(out["ctx_k"][j, :, :len(t)], out["ctx_v"][j, :, :len(t)]) for j, t in enumerate(taps)]

        return await self._batched("inject", call, taps, starts)

    async def batch_verify(self, seq_ids, blocks, want_taps, parents=None) -> list:
        async def call(seq_ids, blocks):
            n = len(seq_ids)
            tree = {} if parents is None else {"parents": np.array([parents] * n, np.int32)}
            out = await self._rows(self.target, ["out_tokens", "out_log_probs", "taps"],
                                   mode=np.full((n, 1), VERIFY, np.int32), seq_id=_column(seq_ids, np.uint64),
                                   tokens=np.array(blocks, np.int32), want_taps=np.full((n, 1), want_taps, bool),
                                   **tree, **self._coalesced(n))
            tokens = out["out_tokens"].cpu().numpy()
            emitted = [[int(t) for t in row if t >= 0] for row in tokens]
            logprobs = out["out_log_probs"].tolist()  # NaN for a sequence that did not ask (the stepper ignores them)
            return [(e, out["taps"][j, :len(e)] if want_taps else None, logprobs[j][:len(e)], None)
                    for j, e in enumerate(emitted)]

        return await self._batched("verify", call, seq_ids, blocks)

    async def batch_draft(self, seq_ids, ks, vs, bonuses, width, top=1) -> list:
        async def call(seq_ids, ks, vs, bonuses):
            n = len(seq_ids)
            choices = {} if top == 1 else {"top": np.full((n, 1), top, np.int32)}  # older repositories: no input
            out = await self._rows(self.drafter, ["drafts", "confidence"] if self.scored else ["drafts"],
                                   mode=np.zeros((n, 1), np.int32), seq_id=_column(seq_ids, np.uint64),
                                   ctx_k=stack_padded(ks, 1), ctx_v=stack_padded(vs, 1),
                                   ctx_len=_column([k.shape[1] for k in ks], np.int32),
                                   bonus=_column(bonuses, np.int32), block_size=np.full((n, 1), width, np.int32),
                                   **choices, **self._coalesced(n))
            drafts = out["drafts"].cpu().numpy()
            if self.scored:
                for seq, row in zip(seq_ids, out["confidence"].tolist()):
                    self.forecasts[seq] = row
            return (drafts if top == 1 else drafts.reshape(n, width - 1, top)).tolist()

        return await self._batched("draft", call, seq_ids, ks, vs, bonuses)

    def forecast(self, seq_id: int) -> list[float] | None:
        """The drafter's confidence estimates [K] for the sequence's latest drafted block (``BlockDrafter.forecast``,
        returned by the drafter model); None without a confidence head or before the sequence's first draft."""
        return self.forecasts.get(seq_id)

    async def batch_free(self, seq_ids, drafter) -> None:
        """Free the sequences in both stateful models; a model that cannot answer (it died) is skipped, so the
        request's own error is what the client sees and the other model's slot is still freed."""
        async def free(seq_id: int, model: str) -> None:
            try:
                await self._rows(model, ["num_active"], mode=np.array([[FREE]], np.int32),
                                 seq_id=self._seq(seq_id)[None])
            except StepError:
                pass

        for seq_id in seq_ids:
            self.forecasts.pop(seq_id, None)
        await asyncio.gather(*(free(s, m) for s in seq_ids
                               for m in ((self.target, self.drafter) if drafter else (self.target,))))

    def admission(self, max_queue: int, queue_timeout_s: float) -> Admission:
        """How long this model's sequences wait for a slot, and the UNAVAILABLE error of one refused."""
        limit = f"--max-sequences {self.max_sequences}" if self.max_sequences else "--max-sequences"

        def refuse(reason: str, waiting: int) -> Exception:
            if reason == "full":
                return Overloaded(f"RESOURCE_EXHAUSTED: all sequence slots are in use ({limit}) and {waiting} "
                                  f"requests already wait for one (--max-queue {max_queue}); retry later, or render "
                                  "the repository with a larger --max-sequences or --max-queue")
            return Overloaded(f"RESOURCE_EXHAUSTED: no sequence slot freed within {queue_timeout_s:g} s "
                              f"(--queue-timeout-s; all {limit} slots in use); retry later, or render the "
                              "repository with a larger --max-sequences")

        return Admission(max_queue, queue_timeout_s, refuse)


def _column(values, dtype) -> np.ndarray:
    return np.array(values, dtype).reshape(-1, 1)


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
        block = self.block_size if self.policy is None else "auto"
        mode = DecodeMode(block, ngram=self.ngram and block != 1, tree=self.tree is not None)
        self.stepper = Stepper(self.steps, mode, self.policy, self.tree, self.datastore,
                               admission=self.steps.admission(s.max_queue, s.queue_timeout_s))
        self.runner: asyncio.Task | None = None  # the task stepping the stepper while it has sequences
        self.stopping = False  # set by finalize: every live request ends before its next step
        self.frontend = self.tokens = None
        if s.frontend == "on":  # the entry point: text in, text out (no ensemble around it)
            from trtllm_dflash.serve.triton.handlers import Preprocessor

            self.frontend = Preprocessor(s)
        elif s.frontend == "tokens":  # tensorrt_llm: TensorRT-LLM's token-level model
            from trtllm_dflash.serve.trtllm.token_model import TokenFrontend

            self.tokens = TokenFrontend(s)
        self.live_ids: dict[str, list[_Served]] = {}  # request id -> its live requests (tensorrt_llm's stop)
        self.telemetry = None
        if s.metrics:
            from trtllm_dflash.serve.triton.telemetry import LoopTelemetry

            self.telemetry = LoopTelemetry(pb_utils, s.model_name or "dflash_bls",
                                           self.policy.max_k + 1 if self.policy is not None else self.block_size)
            self.steps.on_batch = self.telemetry.step_call

    async def execute(self, requests) -> None:
        """Add each request's sequences to the stepper and return at once: their responses go through the request's
        response sender (also on the unary ``tensorrt_llm`` model, rendered ``--tensorrt-llm-unary``: one final
        response per request)."""
        for request in requests:
            self._serve(request)
        if self.stepper.busy and (self.runner is None or self.runner.done()):
            self.runner = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """Step while any sequence is live or waits for a slot. A step that raises ends every sequence with its
        error (each request gets it); the model keeps serving."""
        while self.stepper.busy:
            wait = self.stepper.retry_in()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                await self.stepper.step()
            except Exception as exc:  # noqa: BLE001 - the clients get the message
                await self.stepper.fail_all(exc)

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

    def _serve(self, request) -> None:
        """One request: its rows (the ``tensorrt_llm`` model's batch; one otherwise) and each row's
        ``num_return_sequences`` sequences (TensorRT-LLM's: sequence i samples with seed + i, its responses carry
        ``sequence_index`` i when there are several) join the stepper; a row's siblings fork its first sequence's
        prefill. The final flag goes with the last sequence's last response. A sequence that fails ends the others
        at their next step and the request with its error."""
        pb, sender = self.pb, request.get_response_sender()
        if self.tokens is not None and self.tokens.is_stop(pb, request):
            return self._stop(request, sender)
        served = _Served(self, sender, request.request_id() if self.tokens is not None else "")
        try:
            rows = self._rows(request)
        except Exception as exc:  # the client gets the message; the server keeps serving
            served.final_sent = _send_final(pb, sender, error_response(pb, exc))
            return
        if served.request_id:
            self.live_ids.setdefault(served.request_id, []).append(served)
        served.running = sum(row.opts.sequences for row in rows)
        for row in rows:
            first = None
            for i in range(row.opts.sequences):
                seq = served.sequence(row, i, len(rows), first)
                first = first or seq
                self.stepper.add(seq)

    def _rows(self, request) -> list[Row]:
        """A request's rows, validated."""
        pb = self.pb
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
        return rows

    def _stop(self, request, sender) -> None:
        """TensorRT-LLM's stop request: the live requests with its request id end at their next step, each sequence
        with a final response of its tokens so far; the stop request gets one empty final response (or an error naming
        what is missing)."""
        pb, request_id = self.pb, request.request_id()
        try:
            require(bool(request_id), "stop", True, "needs the request id of the request to stop",
                    "send the stop request with that request's id (tritonclient: request_id=...)")
            for served in self.live_ids.get(request_id, ()):
                served.stopped = True
            _send_final(pb, sender, pb.InferenceResponse(output_tensors=[]))
        except Exception as exc:  # noqa: BLE001 - the client gets the message
            _send_final(pb, sender, error_response(pb, exc))


class _Served:
    """One client request in the stepper: its response sender, its sequences' callbacks, and what it has sent."""

    def __init__(self, model: LoopModel, sender, request_id: str) -> None:
        self.model, self.sender, self.request_id = model, sender, request_id
        self.arrival_ns = time.monotonic_ns()
        self.running = 0  # sequences not yet ended
        self.live = 0  # sequences whose final update is not sent yet
        self.final_sent = False
        self.failed: Exception | None = None
        self.stopped = False  # TensorRT-LLM's stop request: each sequence ends with its tokens so far

    def cancelled(self) -> bool:
        return self.model.stopping or self.sender.is_cancelled() or self.failed is not None or self.stopped

    def sequence(self, row: Row, index: int, batch: int, first: Sequence | None) -> Sequence:
        """Sequence ``index`` of ``row`` (its first, which its siblings fork, or one of them)."""
        model, pb = self.model, self.model.pb
        gen, opts = row.gen, row.opts
        detok = None
        if model.frontend is not None:
            from trtllm_dflash.runtime.text import IncrementalDetokenizer

            detok = IncrementalDetokenizer(model.frontend.tokenizer)
        if index:
            gen = replace(gen, sampling=replace(gen.sampling, seed=(gen.sampling.seed + index) % 2 ** 64))
        totals = [0, 0]  # draft tokens proposed, accepted (return_perf_metrics)
        labels = [("sequence_index", np.array([[index]], np.int32))] if opts.sequences > 1 else []
        if batch > 1:
            labels.append(("batch_index", np.array([[row.index]], np.int32)))
        self.live += 1
        if model.telemetry is not None:
            model.telemetry.active(+1)

        def on_update(u: Update) -> None:
            self.live -= u.final
            last = u.final and self.live == 0
            if model.telemetry is not None:
                model.telemetry.record(u, last)
            totals[0] += u.num_draft_tokens
            totals[1] += u.num_accepted_draft_tokens
            times = (self.arrival_ns, seq.scheduled_ns, seq.first_token_ns, time.monotonic_ns() if u.final else 0)
            if model.tokens is not None:
                response = pb.InferenceResponse(output_tensors=[
                    pb.Tensor(n, v) for n, v in model.tokens.outputs(row, u, *totals, times, labels)])
            else:
                extra = response_outputs(opts, len(gen.input_ids), len(u.tokens) - u.prev_len, *totals,
                                         u.logprobs, times)
                text = None
                if u.final and not opts.exclude_input and not gen.stream:  # TRT-LLM decodes prompt and answer
                    text = model.frontend.tokenizer.decode(list(gen.input_ids) + u.tokens, skip_special_tokens=True)
                response = model._response(u, detok, text, [*extra, *labels])
            self.sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)
            self.final_sent = self.final_sent or last

        seq = Sequence(secrets.randbits(62), gen, on_update, self.cancelled, lambda: self.stopped, self.ended,
                       keep=opts.sequences - 1 if first is None else 0, fork_of=first)
        return seq

    def ended(self, seq: Sequence) -> None:
        """A sequence left the stepper; after the last, the request's error (or its bare final flag) if its final
        response is not sent."""
        model = self.model
        if model.telemetry is not None:
            model.telemetry.active(-1)
        if seq.error is not None and self.failed is None:
            self.failed = seq.error
        self.running -= 1
        if self.running:
            return
        pb = model.pb
        if not self.final_sent:
            self.final_sent = _send_final(pb, self.sender, error_response(pb, self.failed)
                                          if self.failed is not None else None)
        if self.request_id:
            live = model.live_ids[self.request_id]
            live.remove(self)
            if not live:
                del model.live_ids[self.request_id]


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
