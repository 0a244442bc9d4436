"""The step models of the repository: target_verify, kv_inject and drafter (each template's ``model.py`` names one
of these classes for ``lifecycle.python_model``), and the entry models' text preprocessing.

The step models run the torch step engines (``runtime/steps.py``) or, when rendered with ``backend: trtllm-engine``,
the TensorRT-LLM engines (``serve/trtllm/engine.py``); only their construction differs, the Triton I/O below is the
same.

Step-model protocol (tensors carry a leading batch dimension: one row per sequence; START and STATS take one row,
VERIFY, DRAFT, FREE and kv_inject any number, which is how the loop models' stepper (``runtime/stepper.py``)
sends the live sequences' calls of one kind as one request; every row of a request has the same
mode):

    target_verify  mode INT32 [1]: 0 START (tokens = prompt, sampling inputs, want_taps) -> out_tokens = [x_0], taps
                                     (keep_prefill INT32 [1] n: n siblings will fork from it; fork_of UINT64 [1]:
                                     this START is such a sibling's, no prefill: its prompt's K/V copied, no taps)
                                   1 VERIFY (tokens = [bonus, d_1..d_{B−1}], want_taps) -> out_tokens = emitted, taps
                                     (rows of several sequences: emitted padded with −1, taps with zeros, to the
                                     longest row); both also out_log_probs, the tokens' log-probabilities for a
                                     sequence started with return_log_probs (else, and in padding, NaN)
                                   2 FREE, 3 STATS              -> num_active, freed, timed_out, forked
    kv_inject      taps FP32 [T, K·H], start INT32 [1] -> ctx_k, ctx_v FP32 [L, T, kv_heads, head_dim]
    drafter        mode INT32 [1]: 0 DRAFT (ctx_k, ctx_v, bonus, block_size; ctx_len INT32 [1]: the row's real
                                     context length when rows are padded) -> drafts INT32 [block_size − 1]
                                   2 FREE, 3 STATS
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from trtllm_dflash.errors import ConfigError, require
from trtllm_dflash.runtime.sampling import SamplingParams, bias_pairs
from trtllm_dflash.serve.settings import ModelSettings
from trtllm_dflash.serve.trtllm.compat import Options, request_options
from trtllm_dflash.runtime.protocol import (MAX_STOP_WORDS, GenerateRequest, decode_stops, decode_text, encode_stops,
                                         generate_request, validate_generation)
from trtllm_dflash.serve.triton.io import (error_response, get, rows, rows_torch, scalar, tensor, torch_output,
                                           torch_rows_output)

START, VERIFY, FREE, STATS = 0, 1, 2, 3


class CpuThreads:
    """The torch threads a CPU step model computes with, chosen per execution.

    The step models are separate processes sharing the cores. With one live DFlash sequence the step runs one stage
    at a time (verify, inject, draft), so the stage computing gets every core. With more, the target's and the
    drafter's forwards overlap in time; two OpenMP teams on the same cores then wait at each op's barrier for a
    thread the other process holds, so each stage drops to one thread. The baseline ensemble has no
    second stage: target_verify counts only DFlash sequences and keeps every core for it. A request from a loop
    model's stepper (several rows, or the ``coalesced`` input: its one-row drafts and its sequences' starts,
    which it sends at the step barrier too) comes from a loop that runs one stage at a time for all its sequences:
    every core again (counted as overlapping, such a one-row request would run every prefill on one thread with 16
    DFlash sequences live). ``torch_threads`` > 0 fixes the count instead; on a GPU the count is left alone.
    """

    def __init__(self, params: ModelSettings | dict[str, str]) -> None:
        n = ModelSettings.of(params).torch_threads
        self.fixed = n > 0 or _device() != "cpu"
        if n > 0:
            torch.set_num_threads(n)
        self.alone = torch.get_num_threads()  # when not fixed: torch's default (the cores, or OMP_NUM_THREADS)

    def threads_for(self, live: int, coalesced: bool = False) -> int:
        """Threads for an execution while ``live`` sequences hold state in this model (or arrive in its batch);
        ``coalesced``: the execution holds a request of a loop model's stepper (the stages do not overlap)."""
        return torch.get_num_threads() if self.fixed else (self.alone if live <= 1 or coalesced else 1)

    def __call__(self, live: int, coalesced: bool = False) -> None:
        n = self.threads_for(live, coalesced)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sampling_from(pb_utils, request) -> SamplingParams:
    """A request's sampling inputs (TensorRT-LLM's names, the penalties and ``return_log_probs`` included);
    ``target_verify``'s start and ``dflash_bls`` also take the bad words as token ids (``bad_sequences`` INT32 [-1],
    ``protocol.encode_stops``' format), and ``target_verify``'s start the sequence's min_tokens ban (``banned_ids``
    INT32 [-1], ``banned_before`` INT32: ``SamplingParams.with_min_tokens``), and both the embedding bias as token ids
    (``bias_ids`` INT32 [-1], ``bias_weights`` FP32 [-1]: ``SamplingParams.logit_bias``)."""
    banned = get(pb_utils, request, "banned_ids")
    bad = get(pb_utils, request, "bad_sequences")
    ids, weights = ([] if x is None else np.asarray(x).reshape(-1).tolist()
                    for x in (get(pb_utils, request, "bias_ids"), get(pb_utils, request, "bias_weights")))
    require(len(ids) == len(weights), "number of bias_weights", len(weights),
            f"must equal the number of bias_ids ({len(ids)}): one weight per token id", "send as many weights as ids")
    return SamplingParams(
        temperature=scalar(pb_utils, request, "temperature", 0.0, float),
        top_k=scalar(pb_utils, request, "top_k", 0, int),
        top_p=scalar(pb_utils, request, "top_p", 1.0, float),
        seed=scalar(pb_utils, request, "seed", 0, int),
        banned_ids=() if banned is None else tuple(int(t) for t in np.asarray(banned).reshape(-1)),
        banned_before=scalar(pb_utils, request, "banned_before", 0, int),
        repetition_penalty=scalar(pb_utils, request, "repetition_penalty", 1.0, float),
        presence_penalty=scalar(pb_utils, request, "presence_penalty", 0.0, float),
        frequency_penalty=scalar(pb_utils, request, "frequency_penalty", 0.0, float),
        logprobs=bool(scalar(pb_utils, request, "return_log_probs", False, bool)),
        bad_words=() if bad is None else decode_stops(np.asarray(bad).reshape(-1).tolist()),
        logit_bias=bias_pairs(ids, weights),
    )


class Preprocessor:
    """The entry models' text request: text_input (+ options) -> the loop's GenerateRequest and response options."""

    def __init__(self, params: ModelSettings | dict[str, str]) -> None:
        from trtllm_dflash.runtime.text import load_tokenizer
        from trtllm_dflash.specs import TargetSpec

        s = ModelSettings.of(params)
        self.tokenizer = load_tokenizer(s.tokenizer_dir)
        self.max_seq_len = s.max_seq_len
        eos = set(TargetSpec.load(s.tokenizer_dir).eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.default_stops = [[e] for e in sorted(eos)]

    def parse_options(self, pb_utils, request) -> tuple[GenerateRequest, Options]:
        """Validate a request's inputs (each error names its field) into what the loop runs, and what it asks of its
        responses (TensorRT-LLM's optional inputs: serve/trtllm/compat.py)."""
        from trtllm_dflash.runtime.text import encode_prompt, encode_words

        raw = get(pb_utils, request, "text_input")
        require(raw is not None, "text_input", None, "is required")
        flat = np.asarray(raw).reshape(-1)
        require(flat.size == 1, "text_input", list(np.asarray(raw).shape), "must hold exactly one string")
        text = decode_text(flat[0], "text_input")
        require(text != "", "text_input", "", "must not be empty")
        chat = bool(scalar(pb_utils, request, "apply_chat_template", False, bool))
        ids = encode_prompt(self.tokenizer, text, chat)
        max_tokens = scalar(pb_utils, request, "max_tokens", None, int)
        require(max_tokens is not None, "max_tokens", None, "is required")
        sampling = sampling_from(pb_utils, request)
        validate_generation(max_tokens, sampling, len(ids), self.max_seq_len)
        stops = self.default_stops
        end_id = scalar(pb_utils, request, "end_id", None, int)
        if end_id is not None:
            require(0 <= end_id < len(self.tokenizer), "end_id", end_id, f"must be a token id in [0, {len(self.tokenizer)})")
            stops = [[end_id]]
        words = get(pb_utils, request, "stop_words")
        if words is not None:
            words = np.asarray(words).reshape(-1)
            require(len(words) <= MAX_STOP_WORDS, "number of stop_words", len(words),
                    f"must be at most {MAX_STOP_WORDS}", "send fewer stop words")
            stops = list(stops)
            for i, w in enumerate(words):
                word = decode_text(w, f"stop_words[{i}]")
                if word:
                    stops.append(self.tokenizer.encode(word, add_special_tokens=False))
        stream = bool(scalar(pb_utils, request, "stream", False, bool))
        opts = request_options(pb_utils, request, max_tokens, len(self.tokenizer))
        bad = get(pb_utils, request, "bad_words")  # TensorRT-LLM's: strings, tokenized as its preprocessing does
        if bad is not None:
            words = [decode_text(w, f"bad_words[{i}]") for i, w in enumerate(np.asarray(bad).reshape(-1))]
            require(len(words) <= MAX_STOP_WORDS, "number of bad_words", len(words),
                    f"must be at most {MAX_STOP_WORDS}", "send fewer bad words")
            sampling = replace(sampling, bad_words=encode_words(self.tokenizer, words))
        sampling = self._embedding_bias(pb_utils, request, sampling)
        return generate_request(ids, max_tokens, sampling, decode_stops(encode_stops(stops)), stream,
                                opts.min_tokens), opts

    def _embedding_bias(self, pb_utils, request, sampling: SamplingParams) -> SamplingParams:
        """TensorRT-LLM's ``embedding_bias_words`` (strings) and ``embedding_bias_weights`` (FP32, one per word) as
        ``sampling.logit_bias`` (``runtime.text.encode_bias``: tokenized as its preprocessing model does)."""
        from trtllm_dflash.runtime.text import encode_bias

        words = get(pb_utils, request, "embedding_bias_words")
        weights = get(pb_utils, request, "embedding_bias_weights")
        if words is None and weights is None:
            return sampling
        words = [] if words is None else [decode_text(w, f"embedding_bias_words[{i}]")
                                          for i, w in enumerate(np.asarray(words).reshape(-1))]
        weights = [] if weights is None else [float(w) for w in np.asarray(weights).reshape(-1)]
        require(len(words) == len(weights), "number of embedding_bias_weights", len(weights),
                f"must equal the number of embedding_bias_words ({len(words)}): one weight per word",
                "send as many weights as words")
        require(len(words) <= MAX_STOP_WORDS, "number of embedding_bias_words", len(words),
                f"must be at most {MAX_STOP_WORDS}", "send fewer words")
        for i, w in enumerate(weights):
            require(np.isfinite(w), f"embedding_bias_weights[{i}]", w, "must be finite")
        return replace(sampling, logit_bias=encode_bias(self.tokenizer, zip(words, weights)))


def _step_rows(pb_utils, request) -> tuple[int, list[int]]:
    """(mode, seq_id of every row) of a step-model request."""
    modes = rows(pb_utils, request, "mode")
    require(modes is not None, "mode", None, "is required")
    modes = np.asarray(modes).reshape(-1)
    require(modes.size >= 1 and bool((modes == modes[0]).all()), "mode", modes.tolist(),
            "must be one mode, the same for every row of a request")
    seqs = np.asarray(rows(pb_utils, request, "seq_id", np.zeros(modes.size, np.uint64))).reshape(-1)
    require(seqs.size == modes.size, "seq_id", seqs.tolist(), f"must have one value per row ({modes.size})")
    return int(modes[0]), [int(x) for x in seqs]


def _shared(pb_utils, request, name: str, default, kind):
    """An input every row of a request has in common (one value per row, all equal)."""
    arr = rows(pb_utils, request, name)
    if arr is None:
        return default
    flat = np.asarray(arr).reshape(-1)
    require(flat.size >= 1 and bool((flat == flat[0]).all()), name, flat.tolist(), "must be one value for every row")
    return kind(flat[0])


def _coalesced(pb_utils, request, seqs: list[int]) -> bool:
    """Whether a step request comes from a loop model's stepper (``CpuThreads``): several rows, or it says so."""
    return len(seqs) > 1 or bool(_shared(pb_utils, request, "coalesced", False, bool))


def _parents(pb_utils, request, seqs: list[int]) -> tuple[int, ...] | None:
    """A tree verify's ``parents`` (one row per sequence, all equal: a batched call verifies one tree; checked to be
    a tree), or None."""
    from trtllm_dflash.runtime.steps import tree_topology

    arr = rows(pb_utils, request, "parents")
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(len(seqs), -1)
    require(flat.shape[1] >= 1 and bool((flat == flat[0]).all()), "parents", flat.tolist()[:2],
            "must be one tree for every row of a request", "send each tree's rows in their own request")
    return tree_topology(tuple(int(x) for x in flat[0])).parents


def _stats(slots) -> list[tuple[str, np.ndarray]]:
    return [("num_active", np.array([len(slots.rows)], dtype=np.int32)),
            ("freed", np.array([slots.freed], dtype=np.int32)),
            ("timed_out", np.array([slots.timed_out], dtype=np.int32))]


class TargetVerifyModel:
    def __init__(self, params: ModelSettings | dict[str, str], pb_utils=None) -> None:
        from trtllm_dflash.models.target import TargetModel
        from trtllm_dflash.runtime.steps import TargetVerifier

        s = ModelSettings.of(params)
        self.pb = pb_utils  # Triton's python-backend utilities (None where a test only builds the model)
        self.threads, self.drafting = CpuThreads(s), set()
        taps = s.tap_layers
        self.tree_capable = not s.engine_backend
        if s.engine_backend:
            from trtllm_dflash.serve.trtllm.engine import EngineTargetVerifier, load_engine_set
            from trtllm_dflash.specs import TargetSpec

            self.tap_width = len(taps) * TargetSpec.load(s.target_dir).hidden_size
            self.verifier = EngineTargetVerifier(load_engine_set(s.engine_dir, s.max_block_size), self.tap_width,
                                                 s.max_sequences, s.max_seq_len, s.idle_timeout_s, s.max_batch_size)
            return
        target = TargetModel.from_pretrained(s.target_dir, device=_device())
        target.warm_decode()  # the compiled step, where this machine's table asks for it: compiled at load
        self.verifier = TargetVerifier(target, taps, s.max_sequences, s.max_seq_len, s.max_block_size,
                                       s.idle_timeout_s, s.max_tree_nodes, cuda_graphs=s.cuda_graphs)
        self.tap_width = len(taps) * target.spec.hidden_size

    def _outputs(self, pb_utils, tokens, taps, extra=(), logprobs=None):
        taps = torch.zeros((0, self.tap_width)) if taps is None else taps.float()  # stays on the target's device
        outs = [("out_tokens", np.array(tokens, dtype=np.int32)),
                ("out_log_probs", np.array(logprobs if logprobs is not None else [np.nan] * len(tokens), np.float32)),
                *extra]
        return pb_utils.InferenceResponse(output_tensors=[tensor(pb_utils, n, a) for n, a in outs]
                                          + [torch_output(pb_utils, "taps", taps)])

    def _verify_response(self, pb_utils, results):
        """One response for a request's rows: emitted tokens padded with −1, taps with zeros, to the longest row."""
        width = max(len(r.emitted) for r in results)
        tokens = np.full((len(results), width), -1, np.int32)
        logprobs = np.full((len(results), width), np.nan, np.float32)
        have = results[0].taps is not None
        taps = torch.zeros((len(results), width if have else 0, self.tap_width),
                           device=results[0].taps.device if have else "cpu")
        for j, r in enumerate(results):
            tokens[j, :len(r.emitted)] = r.emitted
            if r.logprobs is not None:
                logprobs[j, :len(r.logprobs)] = r.logprobs
            if have:
                taps[j, :len(r.emitted)] = r.taps.float()
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("out_tokens", tokens),
                                                          pb_utils.Tensor("out_log_probs", logprobs),
                                                          torch_rows_output(pb_utils, "taps", taps)])

    def _start(self, pb_utils, request, seq: int, prompt: list[int], want_taps: bool):
        """A START: a prefill (kept for ``keep_prefill`` siblings), or with ``fork_of`` a sibling's copy of one."""
        sampling = sampling_from(pb_utils, request)
        parent = scalar(pb_utils, request, "fork_of", None, int)
        keep = scalar(pb_utils, request, "keep_prefill", 0, int)
        if not self.verifier.forks:  # keep_prefill ignored: its siblings will prefill themselves
            require(parent is None, "fork_of", parent, "the trtllm-engine target prefills every sequence itself",
                    "start the sequence with its own prefill")
            return self.verifier.start(seq, prompt, sampling, want_taps)
        if parent is not None:
            return self.verifier.fork(seq, parent, prompt, sampling)
        return self.verifier.start(seq, prompt, sampling, want_taps, keep=keep)

    def execute(self, requests) -> list:
        pb_utils = self.pb
        self.verifier.expire()
        responses: list = [None] * len(requests)
        # index -> (mode, seqs, rows, taps?, the tree's parents or None)
        parsed: dict[int, tuple[int, list[int], list[list[int]], bool, tuple[int, ...] | None]] = {}
        for i, req in enumerate(requests):
            try:
                mode, seqs = _step_rows(pb_utils, req)
                tokens = np.asarray(rows(pb_utils, req, "tokens", np.zeros((len(seqs), 0), np.int32)))
                parsed[i] = (mode, seqs, tokens.reshape(len(seqs), -1).tolist(),
                             bool(_shared(pb_utils, req, "want_taps", False, bool)), _parents(pb_utils, req, seqs))
            except Exception as exc:
                responses[i] = error_response(pb_utils, exc)
        # Live sequences with a drafter in their loop (they ask for taps), this batch's included: while there are
        # several, the drafter model computes alongside this one. Baseline sequences don't count (nothing overlaps).
        self.drafting &= self.verifier.slots.rows.keys()  # freed or timed out since
        self.drafting.update(seq for _, seqs, _, want, _ in parsed.values() if want for seq in seqs)
        self.threads(len(self.drafting), coalesced=any(_coalesced(pb_utils, requests[i], seqs)
                                                        for i, (_, seqs, *_) in parsed.items()))
        groups: dict[tuple, list[tuple[int, int]]] = {}  # (block length, taps?, parents) -> (request, row)
        results: dict[int, list] = {}
        for i, (mode, seqs, tokens, want, parents) in parsed.items():
            try:
                if mode == START:
                    require(len(seqs) == 1, "seq_id", seqs, "must be one sequence per start request")
                    r = self._start(pb_utils, requests[i], seqs[0], tokens[0], want)
                    responses[i] = self._outputs(pb_utils, [r.first_token], r.taps, logprobs=r.logprobs)
                elif mode == VERIFY:
                    require(parents is None or self.tree_capable, "parents", list(parents or ())[:8],
                            "the tree verify runs on the torch backend only", "render without --tree")
                    results[i] = [None] * len(seqs)
                    for j, row in enumerate(tokens):
                        groups.setdefault((len(row), want, parents), []).append((i, j))
                elif mode in (FREE, STATS):
                    if mode == FREE:
                        for seq in seqs:
                            self.verifier.free(seq)
                    forked = [("forked", np.array([self.verifier.forked], dtype=np.int32))]
                    responses[i] = self._outputs(pb_utils, [], None, _stats(self.verifier.slots) + forked)
                else:
                    raise ConfigError("mode", mode, "must be 0 (start), 1 (verify), 2 (free) or 3 (stats)")
            except Exception as exc:
                responses[i] = error_response(pb_utils, exc)
        for (_, want, parents), idx in groups.items():
            try:  # one batched forward for all verify rows of the same block length (and tree)
                seqs, blocks = [parsed[i][1][j] for i, j in idx], [parsed[i][2][j] for i, j in idx]
                out = (self.verifier.verify(seqs, blocks, want) if parents is None
                       else self.verifier.verify(seqs, blocks, want, parents))
                for (i, j), r in zip(idx, out):
                    results[i][j] = r
            except Exception as exc:
                for i, _ in idx:
                    responses[i] = error_response(pb_utils, exc)
        for i, rs in results.items():
            if responses[i] is None:
                responses[i] = self._verify_response(pb_utils, rs)
        return responses


class KVInjectModel:
    def __init__(self, params: ModelSettings | dict[str, str], pb_utils=None) -> None:
        from trtllm_dflash.checkpoints import load_drafter
        from trtllm_dflash.runtime.steps import KVInjector

        s = ModelSettings.of(params)
        self.pb = pb_utils  # Triton's python-backend utilities (None where a test only builds the model)
        CpuThreads(s)(live=2)  # a few ms per step, as fast on one thread: one thread at any load
        if s.engine_backend:
            from trtllm_dflash.serve.trtllm.engine import EngineKVInjector, load_engine_set

            self.inject = EngineKVInjector(load_engine_set(s.engine_dir, s.block_size))
            self.dtype, self.device = self.inject.dtype, "cuda"
            return
        drafter = load_drafter(s.target_dir, s.drafter_dir, device=_device(), draft_vocab="full")  # no target copy
        self.inject = KVInjector(drafter)
        self.dtype, self.device = drafter.dtype, _device()

    def execute(self, requests) -> list:
        pb_utils = self.pb
        responses = []
        for req in requests:
            try:
                taps = rows_torch(pb_utils, req, "taps")
                require(taps is not None and taps.dim() == 3, "taps", None if taps is None else list(taps.shape),
                        "must be [rows, tokens, taps width]")
                starts = np.asarray(rows(pb_utils, req, "start", np.zeros(taps.shape[0], np.int32))).reshape(-1)
                require(starts.size == taps.shape[0], "start", starts.tolist(), "must have one value per row")
                taps = taps.to(self.device, self.dtype)
                k, v = self.inject.rows(taps, torch.as_tensor(starts, dtype=torch.long))
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    torch_rows_output(pb_utils, "ctx_k", k.float()), torch_rows_output(pb_utils, "ctx_v", v.float())]))
            except Exception as exc:
                responses.append(error_response(pb_utils, exc))
        return responses


class DrafterStepModel:
    def __init__(self, params: ModelSettings | dict[str, str], pb_utils=None) -> None:
        from trtllm_dflash.checkpoints import load_drafter
        from trtllm_dflash.runtime.steps import BlockDrafter, TargetHead

        s = ModelSettings.of(params)
        self.pb = pb_utils  # Triton's python-backend utilities (None where a test only builds the model)
        self.threads = CpuThreads(s)
        self.tree_capable = not s.engine_backend
        self.scored = False
        if s.engine_backend:
            from trtllm_dflash.serve.trtllm.engine import EngineBlockDrafter, load_engine_set
            from trtllm_dflash.specs import DrafterSpec

            self.drafter = EngineBlockDrafter(load_engine_set(s.engine_dir, s.block_size),
                                              DrafterSpec.load(s.drafter_dir), s.max_sequences, s.max_seq_len,
                                              s.idle_timeout_s)
            return
        head = TargetHead(s.target_dir, device=_device())  # the target's embedding and LM head, not its layers
        drafter = load_drafter(s.target_dir, s.drafter_dir, device=_device(), draft_vocab=s.draft_vocab or "full",
                               lm_head=head.lm_head)
        self.drafter = BlockDrafter(drafter, head, s.max_sequences, s.max_seq_len, s.idle_timeout_s,
                                    cuda_graphs=s.cuda_graphs)
        self.scored = self.drafter.scored  # a DSpark confidence head: its estimates go back with the drafts

    def execute(self, requests) -> list:
        pb_utils = self.pb
        self.drafter.expire()
        responses: list = [None] * len(requests)
        # (block, top) -> rows
        groups: dict[tuple[int, int], list[tuple[int, int, int, torch.Tensor, torch.Tensor, int]]] = {}
        drafts: dict[int, list] = {}  # request -> drafts per row
        confidence: dict[int, list] = {}  # request -> a DSpark drafter's confidence estimates per row
        coalesced = False
        for i, req in enumerate(requests):
            try:
                mode, seqs = _step_rows(pb_utils, req)
                coalesced = coalesced or _coalesced(pb_utils, req, seqs)
                if mode == 0:
                    k, v = rows_torch(pb_utils, req, "ctx_k"), rows_torch(pb_utils, req, "ctx_v")
                    bonus = rows(pb_utils, req, "bonus")
                    for name, x in (("ctx_k", k), ("ctx_v", v), ("bonus", bonus)):
                        require(x is not None and len(x) == len(seqs), name, None if x is None else list(x.shape),
                                f"must have one row per sequence ({len(seqs)})")
                    lens = np.asarray(rows(pb_utils, req, "ctx_len", np.full(len(seqs), k.shape[2]))).reshape(-1)
                    block = _shared(pb_utils, req, "block_size", None, int)
                    require(block is not None, "block_size", None, "is required to draft")
                    top = _shared(pb_utils, req, "top", 1, int)
                    require(top == 1 or self.tree_capable, "top", top, "the drafter's runner-ups (a tree verify) "
                            "are drafted on the torch backend only", "render without --tree")
                    bonus = np.asarray(bonus).reshape(-1)
                    drafts[i] = [None] * len(seqs)
                    for j, seq in enumerate(seqs):
                        n = int(lens[j])
                        groups.setdefault((block, top), []).append((i, j, seq, k[j, :, :n], v[j, :, :n],
                                                                    int(bonus[j])))
                elif mode in (FREE, STATS):
                    if mode == FREE:
                        for seq in seqs:
                            self.drafter.free(seq)
                    responses[i] = pb_utils.InferenceResponse(output_tensors=[
                        tensor(pb_utils, "drafts", np.zeros(0, np.int32)),
                        *(tensor(pb_utils, n, a) for n, a in _stats(self.drafter.slots))])
                else:
                    raise ConfigError("mode", mode, "must be 0 (draft), 2 (free) or 3 (stats)")
            except Exception as exc:
                responses[i] = error_response(pb_utils, exc)
        self.threads(max(len(self.drafter.slots.rows), sum(map(len, groups.values()))), coalesced)
        for (block, top), items in groups.items():
            try:  # one block forward for all sequences drafting the same block size
                args = ([s for _, _, s, *_ in items], [k for *_, k, _, _ in items], [v for *_, v, _ in items],
                        [b for *_, b in items], block)
                out = self.drafter.draft(*args) if top == 1 else self.drafter.draft(*args, top)
                for (i, j, s, *_), d in zip(items, out):
                    drafts[i][j] = d
                    if self.scored:
                        confidence.setdefault(i, [None] * len(drafts[i]))[j] = self.drafter.forecast(s)
            except Exception as exc:
                for i, *_ in items:
                    responses[i] = error_response(pb_utils, exc)
        for i, ds in drafts.items():
            if responses[i] is None:
                out = torch.stack(ds).reshape(len(ds), -1).cpu().numpy().astype(np.int32)
                outputs = [pb_utils.Tensor("drafts", out)]
                if i in confidence and None not in confidence[i]:  # [rows, K]: a request's rows share a block size
                    outputs.append(pb_utils.Tensor("confidence", np.array(confidence[i], np.float32)))
                responses[i] = pb_utils.InferenceResponse(output_tensors=outputs)
        return responses
