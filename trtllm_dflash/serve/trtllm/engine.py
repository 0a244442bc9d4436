"""The step models of ``make-repo --backend trtllm-engine``: the same three steps as ``runtime/steps.py``, run on the
TensorRT-LLM 1.2.1 engines of ``trtllm-dflash build`` (layout: ``engine/contract.py``).

``EngineTargetVerifier``  the target engine under TRT-LLM's C++ executor (``tensorrt_llm.bindings.executor``): in-flight
                          batching, paged KV cache with block reuse. Every step is one executor Request whose input is
                          the sequence so far (prompt + emitted tokens; the last one is the bonus) and whose drafts go
                          in as external draft tokens; block reuse keeps the prefix's KV, so only the tail and the
                          drafts are computed. The taps come back as the additional output ``context_<TAPS_OUTPUT>``.
``EngineKVInjector``      the ``kv_inject`` engine under ``tensorrt_llm.runtime.Session`` (stateless).
``EngineBlockDrafter``    the ``drafter`` engine under ``Session``; each sequence's injected context K/V lives in a
                          device-memory ``ContextCache`` row owned by this model (torch CUDA tensors).

They have the interfaces of ``TargetVerifier`` / ``KVInjector`` / ``BlockDrafter``, so ``serve/triton/handlers.py`` (the
Triton I/O) and ``runtime/stepper.py`` (the loop in ``dflash_bls``) are shared with the torch backend unchanged.

Everything that decides something is a pure function here, unit-tested on CPU against facts recorded from TensorRT-LLM
(``tests/data/trtllm_1_2_1/runtime_api.json``): request building (a plain dict of Request kwargs), output parsing
(accepted length and emitted tokens by ``runtime.sampling.accepted_lengths``, the torch path's rule; which taps rows to
inject), the context cache, engine-directory validation. The classes only translate those dicts into binding objects
and call TensorRT-LLM, which is imported lazily: it exists only inside NVIDIA's containers (none of this has run on a
GPU yet). Plugins: our ops are TensorRT QDP ``aot_impl`` plugins (``plugin/trt.py``) whose kernels are embedded in the
engines, so "preloading the plugin library" means importing ``trtllm_dflash.plugin.trt`` (which registers the ops'
descriptors with ``tensorrt.plugin``) before any engine is deserialized; there is no ``.so`` to ``LD_PRELOAD``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trtllm_dflash.engine import contract
from trtllm_dflash.errors import ArtifactError, ConfigError, read_json, require
from trtllm_dflash.runtime.sampling import PENALTIES, SamplingParams, accepted_lengths
from trtllm_dflash.runtime.steps import SlotTable, StartResult, VerifyResult

BUILD_MANIFEST = "build_manifest.json"
ENGINE_CONFIG_KEYS = ("version", "pretrained_config", "build_config")  # trtllm_triton.md §2.4
TAPS_CONTEXT_OUTPUT = "context_" + contract.TAPS_OUTPUT  # llmRequest.cpp createResult: "context_" + name


# ---------------------------------------------------------------------------------------------------------------------
# Engine directory (output of `trtllm-dflash build`)


@dataclass(frozen=True, slots=True)
class EngineSet:
    root: Path
    configs: dict[str, dict]  # engine name -> its config.json
    block_size: int

    def engine_file(self, name: str, rank: int = 0) -> Path:
        return self.root / name / f"rank{rank}.engine"


def load_engine_set(engines_dir: str | Path, block_size: int, tap_layers: tuple[int, ...] | None = None) -> EngineSet:
    """Check ``engines_dir`` holds the three engines of ``contract.ENGINES`` (config.json with the engine-config
    layout, rank0.engine) and a build manifest (engine/build.py) whose block size is at least the repository's and
    whose target_layer_ids are the drafter's (``tap_layers``, when given)."""
    root = Path(engines_dir)
    fix = "pass the output directory of `trtllm-dflash build` as --engines"
    if not root.is_dir():
        raise ArtifactError(root, "--engines is not a directory", fix)
    configs = {}
    for name in contract.ENGINES:
        cfg = read_json(root / name / "config.json", f"the {name} engine is not built or damaged; {fix}")
        missing = [k for k in ENGINE_CONFIG_KEYS if k not in cfg]
        require(not missing, f"{name}/config.json keys", missing, "are missing (an engine config has "
                "version, pretrained_config, build_config)", "rebuild the engine with `trtllm-dflash build`")
        if not (root / name / "rank0.engine").is_file():
            raise ArtifactError(root / name / "rank0.engine", "missing", fix)
        configs[name] = cfg
    manifest = read_json(root / BUILD_MANIFEST, fix)
    built = manifest.get("block_size")
    require(isinstance(built, int), f"{BUILD_MANIFEST}.block_size", built, "is missing or not an integer",
            "rebuild with `trtllm-dflash build`")
    require(2 <= block_size <= built, "--block-size", block_size,
            f"must be in [2, {built}] (the block size the engines were built for, {BUILD_MANIFEST})",
            "lower --block-size or rebuild the engines")
    built_taps = manifest.get("target_layer_ids")
    require(tap_layers is None or built_taps is None or list(built_taps) == list(tap_layers),
            f"{BUILD_MANIFEST}.target_layer_ids", built_taps, f"must equal the drafter's target_layer_ids "
            f"{list(tap_layers or ())}", "render with the drafter the engines were built from, or rebuild")
    draft_len = configs["target"]["build_config"].get("max_draft_len")
    require(draft_len is None or draft_len >= block_size - 1, "target build_config.max_draft_len", draft_len,
            f"must be >= block_size - 1 = {block_size - 1} (drafts verified per step)",
            "rebuild the target engine with a larger --max-draft-len")
    return EngineSet(root, configs, built)


def engine_dtype(cfg: dict) -> torch.dtype:
    name = cfg["pretrained_config"].get("dtype", "float16")
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    require(name in dtypes, "pretrained_config.dtype", name, f"must be one of {sorted(dtypes)}")
    return dtypes[name]


# ---------------------------------------------------------------------------------------------------------------------
# Executor requests and results as plain data (keys = binding keyword names, runtime_api.json)


def sampling_config_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """SamplingConfig kwargs. Greedy is top_k=1 (the executor's argmax); unset filters stay None (executor default)."""
    sampling.validate()
    if sampling.greedy:
        return {"beam_width": 1, "top_k": 1}
    out: dict[str, Any] = {"beam_width": 1, "temperature": float(sampling.temperature), "seed": int(sampling.seed)}
    if sampling.top_k:
        out["top_k"] = int(sampling.top_k)
    if sampling.top_p < 1.0:
        out["top_p"] = float(sampling.top_p)
    return out


def request_kwargs(tokens: list[int], drafts: list[int], sampling: SamplingParams, want_taps: bool) -> dict[str, Any]:
    """One verification step (or, with no drafts, a prefill) as executor Request kwargs.

    ``tokens``: the sequence so far, prompt + emitted, the last being the bonus; ``drafts``: d_1..d_{B−1}.
    max_tokens = len(drafts) + 1 as tensorrt_llm_bls does (trtllm_triton.md §4.5): the verifying step yields up to
    that many tokens; anything the executor generates past the accepted prefix + bonus is dropped by ``parse_step``.
    """
    require(len(tokens) >= 1, "tokens", tokens, "must hold at least one token")
    out: dict[str, Any] = {
        "input_token_ids": [int(t) for t in tokens],
        "max_tokens": len(drafts) + 1,
        "streaming": False,
        "sampling_config": sampling_config_kwargs(sampling),
        "output_config": {"exclude_input_from_output": True},
    }
    if drafts:
        out["external_draft_tokens_config"] = {"tokens": [int(d) for d in drafts]}
    if want_taps:
        out["output_config"]["additional_model_outputs"] = [
            {"name": contract.TAPS_OUTPUT, "gather_context": True}]
    return out


def executor_config_kwargs(max_batch_size: int, free_gpu_memory_fraction: float = 0.9) -> dict[str, Any]:
    """ExecutorConfig kwargs: paged KV cache with block reuse, the taps registered as an additional model output
    (a request may only ask for outputs the executor config lists, inflightBatchingUtils.cpp)."""
    require(0 < free_gpu_memory_fraction <= 1, "free_gpu_memory_fraction", free_gpu_memory_fraction,
            "must be in (0, 1]")
    return {
        "max_beam_width": 1,
        "max_batch_size": int(max_batch_size),
        "kv_cache_config": {"enable_block_reuse": True, "free_gpu_memory_fraction": float(free_gpu_memory_fraction)},
        "additional_model_outputs": [{"name": contract.TAPS_OUTPUT, "gather_context": True}],
    }


def select_taps_rows(context_taps: torch.Tensor, first_row: int, count: int) -> torch.Tensor:
    """Rows ``first_row .. first_row+count−1`` of ``context_<taps>`` [rows, K·H] (one row per context position)."""
    require(context_taps.ndim == 2, TAPS_CONTEXT_OUTPUT + " shape", tuple(context_taps.shape), "must be [rows, K*H]")
    require(context_taps.shape[0] >= first_row + count, TAPS_CONTEXT_OUTPUT + " rows", context_taps.shape[0],
            f"must cover positions {first_row}..{first_row + count - 1} (prompt + drafts processed as context)",
            "the executor did not return taps for the drafts; see runtime_api.json assumptions_not_verified")
    return context_taps[first_row:first_row + count]


@dataclass(frozen=True, slots=True)
class StepOutcome:
    accepted: int  # a: drafts accepted
    emitted: list[int]  # x_0..x_a (τ = a + 1 tokens)
    taps: torch.Tensor | None  # [τ, K·H] rows of [bonus, d_1..d_a], or None


def parse_step(drafts: list[int], output_ids: list[int], context_taps: torch.Tensor | None,
               num_input_tokens: int) -> StepOutcome:
    """Executor output of ``request_kwargs(tokens, drafts, ...)`` -> what the loop commits.

    ``output_ids`` are the generated tokens (input excluded): x_0.. where x_i is the target's token after
    [tokens, d_1..d_i]. The accepted length is ``accepted_lengths`` (the torch path's rule) on x against the drafts;
    emitted = x_0..x_a. Worked example: drafts [7, 8, 9], output [7, 8, 5, 4] -> a = 2, emitted [7, 8, 5]; the taps
    are the rows of positions P−1 (the bonus, last input token) .. P−1+a of ``context_<taps>``.
    """
    out = [int(t) for t in output_ids][: len(drafts) + 1]
    require(len(out) >= 1, "executor output_token_ids", list(output_ids), "must hold at least one token")
    padded = out + [-1] * (len(drafts) + 1 - len(out))  # -1 never equals a draft: a stops at a short output
    a = int(accepted_lengths(torch.tensor([drafts], dtype=torch.long).reshape(1, len(drafts)),
                             torch.tensor([padded], dtype=torch.long))[0]) if drafts else 0
    a = min(a, len(out) - 1)
    taps = None if context_taps is None else select_taps_rows(context_taps, num_input_tokens - 1, a + 1)
    return StepOutcome(a, out[: a + 1], taps)


def additional_output(outputs: list[tuple[str, Any]], name: str) -> Any:
    for n, value in outputs:
        if n == name:
            return value
    raise ConfigError("executor additional_outputs", [n for n, _ in outputs], f"has no {name!r}",
                      "build the target engine with the taps output (engine/contract.py TAPS_OUTPUT)")


# ---------------------------------------------------------------------------------------------------------------------
# Per-sequence state


@dataclass
class SequenceState:
    tokens: list[int]  # prompt + emitted; tokens[-1] is the bonus of the next step
    sampling: SamplingParams


class SequenceBook:
    """seq_id -> SequenceState, with the torch path's SlotTable for capacity, free and idle timeouts."""

    def __init__(self, max_sequences: int, max_seq_len: int, idle_timeout_s: float) -> None:
        self.slots = SlotTable(max_sequences, idle_timeout_s)
        self.max_seq_len = max_seq_len
        self.state: dict[int, SequenceState] = self.slots.data  # dropped by the SlotTable on free / time-out

    def start(self, seq_id: int, prompt_ids: list[int], sampling: SamplingParams) -> SequenceState:
        require(0 < len(prompt_ids) < self.max_seq_len, "prompt length", len(prompt_ids),
                f"must be in [1, {self.max_seq_len}) tokens (the repository's max_seq_len)", "shorten the prompt")
        sampling.validate()
        # each verify is a new executor request, whose own min_tokens would count from that request's start
        require(not sampling.banned_ids, "min_tokens", sampling.banned_before - len(prompt_ids),
                "is not supported by the trtllm-engine backend", "omit it, or serve a --backend torch repository")
        for name in PENALTIES:  # the executor would count them over each verify request alone, not the drafts
            require(getattr(sampling, name) == getattr(SamplingParams(), name), name, getattr(sampling, name),
                    "is not supported by the trtllm-engine backend", "omit it, or serve a --backend torch repository")
        require(not sampling.logprobs, "return_log_probs", True, "is not supported by the trtllm-engine backend "
                "(its verify returns tokens only)", "omit it, or serve a --backend torch repository")
        require(not sampling.bad_words, "bad_words", [list(w) for w in sampling.bad_words][:4], "is not supported by "
                "the trtllm-engine backend (each verify is a new executor request, which would see none of the "
                "sequence before it)", "omit it, or serve a --backend torch repository")
        require(not sampling.logit_bias, "logit_bias", [t for t, _ in sampling.logit_bias][:8], "is not supported by "
                "the trtllm-engine backend (its verify requests carry no embedding bias yet)",
                "omit it, or serve a --backend torch repository")
        self.slots.allocate(seq_id)
        self.state[seq_id] = SequenceState(list(prompt_ids), sampling)
        return self.state[seq_id]

    def get(self, seq_id: int, block: list[int]) -> SequenceState:
        self.slots.get(seq_id)
        st = self.state[seq_id]
        require(block and block[0] == st.tokens[-1], "tokens[0]", block[:1],
                f"must be the sequence's bonus token {st.tokens[-1]}", "send [bonus, drafts...] of this sequence")
        require(len(st.tokens) + len(block) <= self.max_seq_len, "sequence length", len(st.tokens) + len(block),
                f"exceeds max_seq_len ({self.max_seq_len})")
        return st

    def free(self, seq_id: int) -> bool:
        return self.slots.free(seq_id)

    def expire(self) -> None:
        self.slots.expire()


class ContextCache:
    """The drafter's per-sequence context K/V in device memory: rows of [L, R, S, n_kv, hd] plus valid lengths."""

    def __init__(self, num_layers: int, rows: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        shape = (num_layers, rows, capacity, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * rows

    def reset(self, row: int) -> None:
        self.lengths[row] = 0

    def append(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [L, T, n_kv, hd] appended after the row's valid entries."""
        start, t = self.lengths[row], k.shape[1]
        require(start + t <= self.k.shape[2], "drafter context length", start + t,
                f"exceeds the context cache ({self.k.shape[2]} tokens)", "render with a larger --max-seq-len")
        self.k[:, row, start:start + t] = k.to(self.k)
        self.v[:, row, start:start + t] = v.to(self.v)
        self.lengths[row] = start + t

    def gather(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> ctx_k, ctx_v [L, n, S, n_kv, hd] (S = the longest row's length), ctx_lens [n] int32 (drafter inputs)."""
        lens = [self.lengths[r] for r in rows]
        s = max(max(lens), 1)
        idx = torch.tensor(rows, device=self.k.device)
        return (self.k[:, idx, :s].contiguous(), self.v[:, idx, :s].contiguous(),
                torch.tensor(lens, dtype=torch.int32, device=self.k.device))


def drafter_block_inputs(bonus: list[int], block_size: int, mask_token_id: int,
                         ctx_lens: list[int]) -> dict[str, torch.Tensor]:
    """block_ids [n, B] = [bonus, MASK × (B−1)] and position_ids [n, B] = ctx_len + 0..B−1
    (contract.DRAFTER_INPUTS): the bonus sits at the first position after the sequence's injected context."""
    n = len(bonus)
    block = torch.full((n, block_size), mask_token_id, dtype=torch.int32)
    block[:, 0] = torch.tensor(bonus, dtype=torch.int32)
    pos = torch.tensor(ctx_lens, dtype=torch.int32)[:, None] + torch.arange(block_size, dtype=torch.int32)[None]
    return {"block_ids": block, "position_ids": pos}


# ---------------------------------------------------------------------------------------------------------------------
# Thin adapters over TensorRT-LLM (lazy imports; run only inside NVIDIA's containers)


def preload_plugins() -> None:
    """Register our TensorRT plugin ops before deserializing an engine that uses them (plugin/trt.py)."""
    import trtllm_dflash.plugin.trt  # noqa: F401


def _binding(tle, name: str, kwargs: dict[str, Any]):
    """Build binding object ``name`` from a plain dict, nested configs included."""
    nested = {"sampling_config": "SamplingConfig", "output_config": "OutputConfig",
              "external_draft_tokens_config": "ExternalDraftTokensConfig", "kv_cache_config": "KvCacheConfig"}
    args = {}
    for k, v in kwargs.items():
        if k in nested:
            v = _binding(tle, nested[k], v)
        elif k == "additional_model_outputs":
            v = [tle.AdditionalModelOutput(**o) for o in v]
        args[k] = v
    if name == "Request":
        return tle.Request(args.pop("input_token_ids"), args.pop("max_tokens"), **args)
    return getattr(tle, name)(**args)


class EngineSession:
    """One engine under ``tensorrt_llm.runtime.Session``: shapes inferred per call, outputs allocated on the device."""

    def __init__(self, engine_file: Path) -> None:
        preload_plugins()
        from tensorrt_llm.runtime import Session, TensorInfo

        self.TensorInfo = TensorInfo
        self.session = Session.from_serialized_engine(engine_file.read_bytes())
        self.stream = torch.cuda.current_stream()

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import tensorrt as trt
        from tensorrt_llm._utils import trt_dtype_to_torch  # session.py imports it from there

        to_trt = {torch.float16: trt.float16, torch.bfloat16: trt.bfloat16, torch.float32: trt.float32,
                  torch.int32: trt.int32}
        inputs = {k: v.cuda().contiguous() for k, v in inputs.items()}
        infos = [self.TensorInfo(k, to_trt[v.dtype], tuple(v.shape)) for k, v in inputs.items()]
        outputs = {o.name: torch.empty(tuple(o.shape), dtype=trt_dtype_to_torch(o.dtype), device="cuda")
                   for o in self.session.infer_shapes(infos)}
        if not self.session.run(inputs, outputs, self.stream.cuda_stream):
            raise RuntimeError(f"TensorRT enqueue failed (TensorRT {trt.__version__})")
        self.stream.synchronize()
        return outputs


class EngineTargetVerifier:
    """TargetVerifier's interface over the target engine and TRT-LLM's executor. It prefills every sequence itself:
    no sibling forks a kept prefill (``forks``), and it verifies chains only."""

    forks = False
    forked = 0

    def __init__(self, engines: EngineSet, tap_width: int, max_sequences: int, max_seq_len: int,
                 idle_timeout_s: float, max_batch_size: int, free_gpu_memory_fraction: float = 0.9) -> None:
        preload_plugins()
        from tensorrt_llm.bindings import executor as tle

        self.tle, self.tap_width = tle, tap_width
        self.book = SequenceBook(max_sequences, max_seq_len, idle_timeout_s)
        self.slots = self.book.slots
        cfg = _binding(tle, "ExecutorConfig", executor_config_kwargs(max_batch_size, free_gpu_memory_fraction))
        self.executor = tle.Executor(engines.root / "target", tle.ModelType.DECODER_ONLY, cfg)

    def _run(self, kwargs: list[dict[str, Any]]) -> list[tuple[list[int], torch.Tensor | None]]:
        ids = self.executor.enqueue_requests([_binding(self.tle, "Request", kw) for kw in kwargs])
        results: dict[int, tuple[list[int], torch.Tensor | None]] = {}
        while len(results) < len(ids):
            for resp in self.executor.await_responses(ids):
                for r in resp if isinstance(resp, list) else [resp]:
                    if r.has_error():
                        raise RuntimeError(f"executor request {r.request_id}: {r.error_msg}")
                    if r.result.is_final:
                        taps = None
                        if r.result.additional_outputs:
                            taps = torch.as_tensor(additional_output(
                                [(o.name, o.output) for o in r.result.additional_outputs], TAPS_CONTEXT_OUTPUT))
                        results[r.request_id] = (list(r.result.output_token_ids[0]), taps)
        return [results[i] for i in ids]

    def start(self, seq_id: int, prompt_ids: list[int], sampling: SamplingParams, want_taps: bool) -> StartResult:
        st = self.book.start(seq_id, prompt_ids, sampling)
        try:
            ((out, taps),) = self._run([request_kwargs(st.tokens, [], sampling, want_taps)])
            first = parse_step([], out, None, len(st.tokens)).emitted[0]
            rows = None if taps is None else select_taps_rows(taps, 0, len(st.tokens))
        except Exception:
            self.book.free(seq_id)
            raise
        st.tokens.append(first)
        return StartResult(first, rows)

    def start_many(self, seq_ids: list[int], prompts: list[list[int]], samplings: list[SamplingParams],
                   want_taps: bool) -> list[StartResult]:
        """Several sequences' starts, one executor request each; all or none start."""
        done: list[StartResult] = []
        try:
            for seq_id, prompt, sampling in zip(seq_ids, prompts, samplings):
                done.append(self.start(seq_id, prompt, sampling, want_taps))
        except Exception:
            for seq_id in seq_ids[:len(done)]:
                self.free(seq_id)
            raise
        return done

    def verify(self, seq_ids: list[int], blocks: list[list[int]], want_taps: bool) -> list[VerifyResult]:
        states = [self.book.get(s, b) for s, b in zip(seq_ids, blocks)]
        outs = self._run([request_kwargs(st.tokens, b[1:], st.sampling, want_taps) for st, b in zip(states, blocks)])
        results = []
        for st, b, (out, taps) in zip(states, blocks, outs):
            step = parse_step(b[1:], out, taps if want_taps else None, len(st.tokens))
            st.tokens.extend(step.emitted)
            results.append(VerifyResult(step.emitted, step.taps))
        return results

    def free(self, seq_id: int) -> bool:
        return self.book.free(seq_id)  # the executor's KV blocks stay in the reuse pool until evicted

    def expire(self) -> None:
        self.book.expire()


class EngineKVInjector:
    """KVInjector's interface over the kv_inject engine: taps [T, K·H], start -> ctx_k, ctx_v [L, T, n_kv, hd]."""

    def __init__(self, engines: EngineSet) -> None:
        self.engine = EngineSession(engines.engine_file("kv_inject"))
        self.dtype = engine_dtype(engines.configs["kv_inject"])

    def __call__(self, taps: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + taps.shape[0], dtype=torch.int32)
        out = self.engine({"taps": taps.to(self.dtype), "position_ids": pos})
        return out["ctx_k"], out["ctx_v"]

    def rows(self, taps: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """taps [n, T, K·H], row j at positions starts[j].. -> K, V [n, L, T, kv, head_dim]: one engine call a row."""
        kv = [self(taps[j], int(starts[j])) for j in range(taps.shape[0])]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])


class EngineBlockDrafter:
    """BlockDrafter's interface over the drafter engine; the context cache stays on the device between steps."""

    def __init__(self, engines: EngineSet, spec, max_sequences: int, max_seq_len: int, idle_timeout_s: float) -> None:
        self.engine = EngineSession(engines.engine_file("drafter"))
        self.spec = spec  # DrafterSpec: layers, KV heads, head dim, mask_token_id, trained block size
        self.slots = SlotTable(max_sequences, idle_timeout_s)
        self.cache = ContextCache(spec.num_hidden_layers, max_sequences, max_seq_len + spec.block_size,
                                  spec.num_key_value_heads, spec.head_dim, engine_dtype(engines.configs["drafter"]),
                                  "cuda")

    def draft(self, seq_ids: list[int], new_k: list[torch.Tensor], new_v: list[torch.Tensor], bonus: list[int],
              block_size: int) -> torch.Tensor:  # [b, block_size − 1] int32 on the CPU
        require(1 < block_size <= self.spec.block_size, "block_size", block_size,
                f"must be in [2, {self.spec.block_size}] (the drafter's trained block size)")
        rows = []
        for s, k, v in zip(seq_ids, new_k, new_v):
            if s in self.slots.rows:
                row = self.slots.get(s)
            else:
                row = self.slots.allocate(s)
                self.cache.reset(row)
            if k.shape[1]:
                self.cache.append(row, k, v)
            rows.append(row)
        ctx_k, ctx_v, ctx_lens = self.cache.gather(rows)
        inputs = drafter_block_inputs(bonus, block_size, self.spec.mask_token_id, ctx_lens.tolist())
        out = self.engine({**inputs, "ctx_k": ctx_k, "ctx_v": ctx_v, "ctx_lens": ctx_lens})
        return out["draft_ids"].cpu()

    def forecast(self, seq_id: int) -> None:
        """No confidence head: the engine drafts tokens only."""
        return None

    def free(self, seq_id: int) -> bool:
        return self.slots.free(seq_id)

    def expire(self) -> None:
        self.slots.expire()
