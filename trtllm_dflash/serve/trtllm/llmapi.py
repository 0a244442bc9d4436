"""``make-repo --backend trtllm-pytorch``: TensorRT-LLM's own DFlash (PyTorch backend, LLM API, TensorRT-LLM >= 1.3)
behind our ensemble I/O.

The repository holds two instances of NVIDIA's Triton "llmapi" python model (trtllm_triton.md §4.7):
``tensorrt_llm_dflash`` (``1/model.yaml`` with ``speculative_config: {decoding_type: DFlash, ...}``) and
``tensorrt_llm_baseline`` (the same without it). Their ``1/model.py`` and ``1/helpers.py`` ship in NVIDIA's container
(``triton_backend/all_models/llmapi/tensorrt_llm/1/``) and are not ours to copy: the rendered repository leaves them
out and its manifest says where they come from (``model_py_source``); the Dockerfile copies them in.

Our ``dflash`` / ``baseline`` ensembles keep the torch backend's I/O (``protocol.py``). Their one step is a thin
decoupled BLS model (``dflash_llmapi`` / ``baseline_llmapi``, logic ``LlmApiBridge``) that maps our inputs onto the
llmapi model's (``max_tokens`` -> ``sampling_param_max_tokens``, ``stream`` -> ``streaming``, ...) and its responses
back: the llmapi model streams the whole text so far, we send deltas; token ids and τ are derived (see
``DERIVED_OUTPUTS``). Names are checked against ``tests/data/trtllm_llmapi/llmapi_facts.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trtllm_dflash.errors import ConfigError, require
from trtllm_dflash.serve.settings import ModelSettings
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.serve.trtllm.compat import Options, request_options, response_outputs
from trtllm_dflash.specs import DSparkSpec

LLMAPI_MODEL_PY_SOURCE = ("NVIDIA's container: triton_backend/all_models/llmapi/tensorrt_llm/1/model.py and "
                          "helpers.py of TensorRT-LLM >= 1.3 (copied into <model>/1/ by the trtllm-pytorch Dockerfile)")
DERIVED_OUTPUTS = {
    "text_output": "delta of the llmapi model's cumulative text_output",
    "output_ids": "the cumulative text re-tokenized with the target's tokenizer (the llmapi model returns no token "
                  "ids; re-tokenization can differ from the generated ids at token-merge boundaries)",
    "num_draft_tokens": "delta of total_draft_tokens (perf metrics) since the previous response",
    "num_accepted_draft_tokens": "delta of total_accepted_draft_tokens since the previous response",
    "acceptance_lengths": "dflash: [accepted + 1] when a response covers exactly one drafting step (draft delta == "
                          "max_draft_len; streamed responses), else empty; baseline: 1 per new token",
}
UNAVAILABLE_INPUTS = {
    "end_id": "the llmapi model has no end_id input; a request that sets it is rejected (use stop_words)",
    "min_tokens": "the llmapi model has no min_tokens input; a request that asks for more than 0 is rejected",
    "repetition_penalty": "the llmapi model has no repetition_penalty input; a request that sets one other than 1.0 "
                          "is rejected (presence_penalty and frequency_penalty are passed on)",
    "return_log_probs": "the llmapi model returns a cumulative_logprob at most, no per-token log-probabilities; a "
                        "request that asks for them is rejected",
    "bad_words": "the llmapi model has no bad-words input; a request with a non-empty bad word is rejected",
    "num_return_sequences": "the bridge relays one sequence per request; a request that asks for more is rejected",
    "embedding_bias_words": "the llmapi model has no embedding-bias input; a request with a non-empty word is "
                            "rejected",
}


def model_yaml(checkpoint_dir: str, max_batch_size: int, drafter_dir: str | None = None,
               max_draft_len: int | None = None, target_layer_ids: tuple[int, ...] = (),
               mask_token_id: int | None = None, free_gpu_memory_fraction: float = 0.9,
               tensor_parallel_size: int = 1, dspark: DSparkSpec | None = None,
               trained_block_size: int | None = None) -> dict[str, Any]:
    """The llmapi model's ``1/model.yaml``: LLM() arguments plus ``triton_config``. With ``drafter_dir`` it carries
    DFlash's ``speculative_config`` (fields of DFlashDecodingConfig), or with ``dspark`` (a DSpark drafter's heads,
    ``trained_block_size`` its config's block_size) DSpark's (``dspark_fields``); without, it is the autoregressive
    baseline."""
    cfg: dict[str, Any] = {
        "model": str(Path(checkpoint_dir).resolve()),
        "backend": "pytorch",
        "tensor_parallel_size": int(tensor_parallel_size),
        "pipeline_parallel_size": 1,
        "kv_cache_config": {"free_gpu_memory_fraction": float(free_gpu_memory_fraction)},
        # decoupled: streaming needs it (config.pbtxt note); our bridge always talks to it as a decoupled model
        "triton_config": {"max_batch_size": 0, "decoupled": True},
    }
    del max_batch_size  # the llmapi model batches inside the LLM engine; its Triton max_batch_size must stay 0
    if drafter_dir is not None:
        require(max_draft_len is not None and max_draft_len >= 1, "max_draft_len", max_draft_len, "must be >= 1")
        cfg["speculative_config"] = {
            "decoding_type": "DFlash",
            "max_draft_len": int(max_draft_len),
            "speculative_model": str(Path(drafter_dir).resolve()),
            "target_layer_ids": [int(i) for i in target_layer_ids],
            "mask_token_id": int(mask_token_id),
        }
        if dspark is not None:
            cfg["speculative_config"] |= dspark_fields(dspark, trained_block_size)
    return cfg


def dspark_fields(dspark: DSparkSpec, trained_block_size: int | None) -> dict[str, Any]:
    """What a DSpark drafter adds to the DFlash fields of ``speculative_config``, as TensorRT-LLM's
    DSparkDecodingConfig names them (tests/data/trtllm_llmapi/llmapi_facts.json): its decoding type, the trained
    block (speculators' ``block_size``), the Markov head's rank and type. The confidence head has no field in
    TensorRT-LLM 1.3 (1.4's confidence scheduling reads calibration files of its own), so it is not mapped."""
    require(trained_block_size is not None and trained_block_size >= 1, "drafter.block_size", trained_block_size,
            "must be >= 1 (DSparkDecodingConfig.block_size)")
    return {"decoding_type": "DSpark", "block_size": int(trained_block_size), "markov_rank": int(dspark.markov_rank),
            "markov_head_type": dspark.markov_head_type}


def dump_yaml(cfg: dict[str, Any]) -> str:
    import yaml  # a dependency of transformers

    return yaml.safe_dump(cfg, sort_keys=False)


# ---------------------------------------------------------------------------------------------------------------------
# Request mapping (ours -> llmapi)


@dataclass(frozen=True, slots=True)
class BridgeRequest:
    prompt: str  # already chat-templated when apply_chat_template
    max_tokens: int
    stream: bool
    sampling: SamplingParams
    stop_words: tuple[str, ...] = ()


def llmapi_inputs(req: BridgeRequest) -> dict[str, np.ndarray]:
    """The llmapi model's input tensors (no batch dimension: its max_batch_size is 0). Greedy is sent as top_k = 1."""
    require(req.max_tokens >= 1, "max_tokens", req.max_tokens, "must be >= 1")
    req.sampling.validate()
    s = req.sampling
    out = {
        "text_input": np.array([req.prompt.encode("utf-8")], dtype=object),
        "streaming": np.array([req.stream], dtype=bool),
        "sampling_param_max_tokens": np.array([req.max_tokens], dtype=np.int32),
        "sampling_param_exclude_input_from_output": np.array([True], dtype=bool),
        "sampling_param_return_perf_metrics": np.array([True], dtype=bool),
        "return_finish_reason": np.array([True], dtype=bool),
    }
    if s.greedy:
        out["sampling_param_top_k"] = np.array([1], dtype=np.int32)
    else:
        out["sampling_param_temperature"] = np.array([s.temperature], dtype=np.float32)
        out["sampling_param_seed"] = np.array([s.seed], dtype=np.uint64)
        if s.top_k:
            out["sampling_param_top_k"] = np.array([s.top_k], dtype=np.int32)
        if s.top_p < 1.0:
            out["sampling_param_top_p"] = np.array([s.top_p], dtype=np.float32)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(s, name):
            out[f"sampling_param_{name}"] = np.array([getattr(s, name)], dtype=np.float32)
    if req.stop_words:
        out["sampling_param_stop"] = np.array([w.encode("utf-8") for w in req.stop_words], dtype=object)
    return out


def chat_prompt(tokenizer, text: str) -> str:
    """``text`` as one user turn in the target's chat template, as text (the llmapi model tokenizes it)."""
    from trtllm_dflash.errors import ArtifactError

    if not getattr(tokenizer, "chat_template", None):
        raise ArtifactError("tokenizer", "has no chat template", "send apply_chat_template=false")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def reject_unavailable(given: dict[str, Any]) -> None:
    for name, why in UNAVAILABLE_INPUTS.items():
        if given.get(name) is not None:
            raise ConfigError(name, given[name], f"is not supported by the trtllm-pytorch backend: {why}")


# ---------------------------------------------------------------------------------------------------------------------
# Response mapping (llmapi -> ours)


@dataclass
class BridgeState:
    """What earlier responses of one request reported (the llmapi model's text and counters are cumulative)."""

    max_draft_len: int  # 0 for the baseline
    text: str = ""
    num_ids: int = 0
    total_draft: int = 0
    total_accepted: int = 0
    taus: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class BridgeUpdate:
    text_delta: str
    output_ids: list[int]
    acceptance_lengths: list[int]
    num_draft_tokens: int
    num_accepted_draft_tokens: int


def bridge_update(state: BridgeState, text: str, output_ids: list[int], total_draft: int | None,
                  total_accepted: int | None) -> BridgeUpdate:
    """One llmapi response (cumulative ``text``; re-tokenized ``output_ids``; cumulative perf counters or None when
    the response carries none) -> our response fields; advances ``state``."""
    require(text.startswith(state.text), "llmapi text_output", text[:40], "must extend the previous response's text",
            "the llmapi model streams the whole text so far; check its version")
    d_total = state.total_draft if total_draft is None else int(total_draft)
    a_total = state.total_accepted if total_accepted is None else int(total_accepted)
    drafts, accepted = d_total - state.total_draft, a_total - state.total_accepted
    new_ids = max(len(output_ids) - state.num_ids, 0)
    if state.max_draft_len == 0:
        taus = [1] * new_ids
    elif drafts == state.max_draft_len:
        taus = [accepted + 1]
    else:
        taus = []
    upd = BridgeUpdate(text[len(state.text):], list(output_ids), taus, drafts, accepted)
    state.text, state.num_ids, state.total_draft, state.total_accepted = text, len(output_ids), d_total, a_total
    return upd


# ---------------------------------------------------------------------------------------------------------------------
# The BLS model (thin; runs inside Triton with NVIDIA's llmapi model next to it)


class LlmApiBridge:
    def __init__(self, params: ModelSettings | dict[str, str], pb_utils) -> None:
        from trtllm_dflash.runtime.text import load_tokenizer

        self.pb = pb_utils
        s = ModelSettings.of(params)
        self.llm_model = s.llm_model
        self.max_draft_len = s.max_draft_len
        self.tokenizer = load_tokenizer(s.tokenizer_dir)

    async def execute(self, requests) -> None:
        import asyncio

        for request in requests:
            asyncio.get_running_loop().create_task(self._serve(request))

    def _parse(self, request) -> tuple[BridgeRequest, Options]:
        from trtllm_dflash.serve.triton.handlers import sampling_from
        from trtllm_dflash.runtime.protocol import decode_text
        from trtllm_dflash.serve.triton.io import get, scalar

        pb = self.pb
        raw = get(pb, request, "text_input")
        require(raw is not None, "text_input", None, "is required")
        text = decode_text(np.asarray(raw).reshape(-1)[0], "text_input")
        require(text != "", "text_input", "", "must not be empty")
        if bool(scalar(pb, request, "apply_chat_template", False, bool)):
            text = chat_prompt(self.tokenizer, text)
        words = get(pb, request, "stop_words")
        stops = () if words is None else tuple(
            w for w in (decode_text(x, "stop_words") for x in np.asarray(words).reshape(-1)) if w)
        bad = get(pb, request, "bad_words")
        bad = [w for w in (decode_text(x, "bad_words") for x in np.asarray(bad).reshape(-1)) if w] if bad is not None \
            else []
        bias = get(pb, request, "embedding_bias_words")
        bias = [w for w in (decode_text(x, "embedding_bias_words") for x in np.asarray(bias).reshape(-1)) if w] \
            if bias is not None else []
        max_tokens = scalar(pb, request, "max_tokens", None, int)
        require(max_tokens is not None, "max_tokens", None, "is required")
        opts = request_options(pb, request, max_tokens, len(self.tokenizer))
        sampling = sampling_from(pb, request)
        reject_unavailable({"end_id": scalar(pb, request, "end_id", None, int), "min_tokens": opts.min_tokens or None,
                            "repetition_penalty": None if sampling.repetition_penalty == 1.0
                            else sampling.repetition_penalty, "return_log_probs": sampling.logprobs or None,
                            "bad_words": bad or None, "embedding_bias_words": bias or None,
                            "num_return_sequences": opts.sequences if opts.sequences > 1 else None})
        return BridgeRequest(text, max_tokens, bool(scalar(pb, request, "stream", False, bool)), sampling, stops), opts

    def _response(self, u: BridgeUpdate, text: str | None = None, extra=()):
        """``text``: instead of the delta (the prompt echoed); ``extra``: what ``compat.response_outputs`` asks."""
        from trtllm_dflash.serve.triton.io import tensor

        pb = self.pb
        text = u.text_delta if text is None else text
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object)),  # 1-D, as TensorRT-LLM's
            *(pb.Tensor(name, value) for name, value in extra),
            tensor(pb, "output_ids", np.array(u.output_ids, dtype=np.int32)),
            tensor(pb, "acceptance_lengths", np.array(u.acceptance_lengths, dtype=np.int32)),
            tensor(pb, "num_draft_tokens", np.array([u.num_draft_tokens], dtype=np.int32)),
            tensor(pb, "num_accepted_draft_tokens", np.array([u.num_accepted_draft_tokens], dtype=np.int32)),
        ])

    async def _serve(self, request) -> None:
        from trtllm_dflash.serve.triton.io import error_response

        pb, sender = self.pb, request.get_response_sender()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            req, opts = self._parse(request)
            inputs = [pb.Tensor(k, v) for k, v in llmapi_inputs(req).items()]
            call = pb.InferenceRequest(model_name=self.llm_model, inputs=inputs, requested_output_names=[
                "text_output", "total_draft_tokens", "total_accepted_draft_tokens"])
            state, pending = BridgeState(self.max_draft_len), None
            n_input = len(self.tokenizer.encode(req.prompt, add_special_tokens=False)) if opts.num_input_tokens else 0
            sent = [0, 0, 0]  # ids, draft tokens, accepted draft tokens reported so far

            def emit(u: BridgeUpdate, flags: int = 0, text: str | None = None) -> None:
                new_ids = len(u.output_ids) - sent[0]
                sent[:] = [len(u.output_ids), sent[1] + u.num_draft_tokens, sent[2] + u.num_accepted_draft_tokens]
                sender.send(self._response(u, text, response_outputs(opts, n_input, new_ids, sent[1], sent[2])),
                            flags=flags)

            async for resp in await call.async_exec(decoupled=True):
                if resp.has_error():
                    raise ConfigError("llmapi", self.llm_model, resp.error().message())
                out = {n: pb.get_output_tensor_by_name(resp, n) for n in
                       ("text_output", "total_draft_tokens", "total_accepted_draft_tokens")}
                if out["text_output"] is None:
                    continue  # the empty final-flag response
                text = out["text_output"].as_numpy().reshape(-1)[0].decode("utf-8")
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                counts = [None if out[n] is None else int(out[n].as_numpy().reshape(-1)[0])
                          for n in ("total_draft_tokens", "total_accepted_draft_tokens")]
                if pending is not None:
                    emit(pending)
                pending = bridge_update(state, text, ids, *counts)
            echo = None if opts.exclude_input or req.stream else req.prompt + state.text
            emit(pending or BridgeUpdate("", [], [], 0, 0), final, echo)
        except Exception as exc:  # the client gets the message; the server keeps serving
            sender.send(error_response(pb, exc), flags=final)
