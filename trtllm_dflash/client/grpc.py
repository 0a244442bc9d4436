"""The one place that talks to the served ensembles over gRPC: input tensors, the streaming callback, error mapping.

The ``dflash`` and ``baseline`` ensembles are decoupled, so every request goes over a bidirectional stream
(``start_stream`` / ``async_stream_infer``); the last response of a request carries ``triton_final_response``.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from trtllm_dflash.errors import DFlashError


class ServerError(DFlashError):
    """The server rejected or failed a request; ``status`` is the gRPC status name (e.g. INVALID_ARGUMENT)."""

    def __init__(self, message: str, status: str = "") -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class GenerateParams:
    prompt: str
    max_tokens: int = 128
    stream: bool = True
    chat: bool = True
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    end_id: int | None = None
    stop_words: tuple[str, ...] = ()
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool = False  # return_log_probs: each token's log-probability (Chunk.logprobs)
    bad_words: tuple[str, ...] = ()  # never generated (TensorRT-LLM's bad_words)
    # (text, weight): weight added to the logits of text's tokens (embedding_bias_words / embedding_bias_weights)
    embedding_bias: tuple[tuple[str, float], ...] = ()
    num_return_sequences: int = 1  # sequence i samples with seed + i (``DFlashClient.generate_sequences``)


@dataclass
class Chunk:
    text: str  # text delta
    acceptance_lengths: list[int]
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    output_ids: list[int]
    t: float  # perf_counter when it arrived
    logprobs: list[float] = field(default_factory=list)  # this response's tokens' (output_log_probs), when asked
    sequence_index: int = 0  # which of the request's num_return_sequences it belongs to


@dataclass
class Completion:
    chunks: list[Chunk] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def token_ids(self) -> list[int]:
        return self.chunks[-1].output_ids if self.chunks else []

    @property
    def acceptance_lengths(self) -> list[int]:
        return [t for c in self.chunks for t in c.acceptance_lengths]

    @property
    def logprobs(self) -> list[float]:
        return [v for c in self.chunks for v in c.logprobs]

    @property
    def mean_acceptance_length(self) -> float:
        taus = self.acceptance_lengths
        return sum(taus) / len(taus) if taus else 0.0

    @property
    def ttft_ms(self) -> float:
        first = next((c.t for c in self.chunks if c.output_ids), self.end)
        return (first - self.start) * 1e3

    @property
    def tokens_per_second(self) -> float:
        dt = self.end - self.start
        return len(self.token_ids) / dt if dt > 0 else 0.0


def build_inputs(p: GenerateParams):
    import tritonclient.grpc as grpcclient

    def make(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    inputs = [
        make("text_input", np.array([[p.prompt.encode("utf-8")]], dtype=object), "BYTES"),
        make("max_tokens", np.array([[p.max_tokens]], dtype=np.int32), "INT32"),
        make("stream", np.array([[p.stream]], dtype=bool), "BOOL"),
        make("apply_chat_template", np.array([[p.chat]], dtype=bool), "BOOL"),
    ]
    optional = [("temperature", p.temperature, np.float32, "FP32"), ("top_k", p.top_k, np.int32, "INT32"),
                ("top_p", p.top_p, np.float32, "FP32"), ("seed", p.seed, np.uint64, "UINT64"),
                ("end_id", p.end_id, np.int32, "INT32"), ("min_tokens", p.min_tokens, np.int32, "INT32"),
                ("repetition_penalty", p.repetition_penalty, np.float32, "FP32"),
                ("presence_penalty", p.presence_penalty, np.float32, "FP32"),
                ("frequency_penalty", p.frequency_penalty, np.float32, "FP32")]
    for name, value, np_type, dtype in optional:
        if value is not None:
            inputs.append(make(name, np.array([[value]], dtype=np_type), dtype))
    if p.logprobs:
        inputs.append(make("return_log_probs", np.array([[True]]), "BOOL"))
    if p.num_return_sequences != 1:
        inputs.append(make("num_return_sequences", np.array([[p.num_return_sequences]], dtype=np.int32), "INT32"))
    if p.bad_words:
        inputs.append(make("bad_words", np.array([[w.encode() for w in p.bad_words]], dtype=object), "BYTES"))
    if p.embedding_bias:
        inputs.append(make("embedding_bias_words", np.array([[w.encode() for w, _ in p.embedding_bias]], dtype=object),
                           "BYTES"))
        inputs.append(make("embedding_bias_weights", np.array([[w for _, w in p.embedding_bias]], np.float32), "FP32"))
    if p.stop_words:
        inputs.append(make("stop_words", np.array([[w.encode() for w in p.stop_words]], dtype=object), "BYTES"))
    return inputs


def _chunk(result) -> Chunk:
    def arr(name):
        a = result.as_numpy(name)
        return np.zeros(0) if a is None else a.reshape(-1)

    text = arr("text_output")
    return Chunk(
        text=text[0].decode("utf-8") if len(text) else "",
        acceptance_lengths=arr("acceptance_lengths").astype(int).tolist(),
        num_draft_tokens=int(arr("num_draft_tokens")[0]) if len(arr("num_draft_tokens")) else 0,
        num_accepted_draft_tokens=int(arr("num_accepted_draft_tokens")[0]) if len(arr("num_accepted_draft_tokens")) else 0,
        output_ids=arr("output_ids").astype(int).tolist(),
        t=time.perf_counter(),
        logprobs=arr("output_log_probs").astype(float).tolist(),
        sequence_index=int(arr("sequence_index")[0]) if len(arr("sequence_index")) else 0,
    )


class DFlashClient:
    """A gRPC stream to one server; ``generate`` many requests concurrently over it."""

    def __init__(self, url: str = "127.0.0.1:8001") -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.results: dict[str, queue.Queue] = {}
        self.client.start_stream(callback=self._on_response)
        self._next = 0

    def _on_response(self, result, error) -> None:
        if error is not None:
            rid = getattr(error, "request_id", None) or ""
            q = self.results.get(rid) or next(iter(self.results.values()), None)
            if q is not None:
                q.put(("error", error))
            return
        resp = result.get_response()
        final = resp.parameters.get("triton_final_response")
        q = self.results.get(resp.id)
        if q is not None:  # responses of requests nobody waits for any more (cancelled) are dropped
            q.put(("data", result, bool(final and final.bool_param)))

    def submit(self, model: str, params: GenerateParams) -> str:
        self._next += 1
        rid = f"r{self._next}"
        self.results[rid] = queue.Queue()
        self.client.async_stream_infer(model, build_inputs(params), request_id=rid, enable_empty_final_response=True)
        return rid

    def responses(self, rid: str, timeout_s: float = 600.0) -> Iterator[Chunk]:
        """Chunks of request ``rid`` as they arrive; raises ServerError on a server-side error."""
        q = self.results[rid]
        try:
            while True:
                item = q.get(timeout=timeout_s)
                if item[0] == "error":
                    err = item[1]
                    status = err.status() if callable(getattr(err, "status", None)) else ""
                    raise ServerError(err.message() if callable(getattr(err, "message", None)) else str(err), status)
                _, result, final = item
                chunk = _chunk(result)
                if chunk.output_ids or chunk.text or chunk.acceptance_lengths:
                    yield chunk
                if final:
                    return
        finally:
            self.results.pop(rid, None)

    def generate(self, model: str, params: GenerateParams, on_chunk: Callable[[Chunk], None] | None = None,
                 timeout_s: float = 600.0) -> Completion:
        if params.num_return_sequences != 1:
            raise ValueError(f"num_return_sequences={params.num_return_sequences}: generate returns one sequence; "
                             "call generate_sequences for several")
        return self.generate_sequences(model, params, on_chunk, timeout_s)[0]

    def generate_sequences(self, model: str, params: GenerateParams,
                           on_chunk: Callable[[Chunk], None] | None = None, timeout_s: float = 600.0
                           ) -> list[Completion]:
        """The request's ``num_return_sequences`` completions, by ``sequence_index`` (their chunks arrive
        interleaved when streaming; each completion ends when its own last response arrives)."""
        start = time.perf_counter()
        done = [Completion(start=start) for _ in range(params.num_return_sequences)]
        for chunk in self.responses(self.submit(model, params), timeout_s):
            seq = done[chunk.sequence_index]
            seq.chunks.append(chunk)
            seq.end = chunk.t
            if on_chunk is not None:
                on_chunk(chunk)
        end = time.perf_counter()
        for seq in done:  # one sequence: its request's end (the final flag); several: each keeps its own end
            seq.end = end if len(done) == 1 or not seq.end else seq.end
        return done

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()

    def __enter__(self) -> "DFlashClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
