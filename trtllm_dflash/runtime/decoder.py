"""The in-process API: ``SpeculativeDecoder.generate`` runs a batch of requests through the one decoding loop.

There is one loop, ``runtime.stepper.Stepper``, and this is it too: ``generate`` builds the three step engines of
``runtime.steps`` over its own models (``TargetVerifier``, ``KVInjector``, ``BlockDrafter``, with the decoder's
kernels and CUDA graphs), adds every request to a stepper over them (``local.BatchedLocalSteps``: one prefill, one
injection, one draft and one verify forward per step for every live row) and steps until none is live. What a
benchmark measures here is what a Triton client gets, and the tests' losslessness checks on this API check the
served loop.

One step (dflash.md §2.1), with ``start`` = tokens committed to the target cache:

    draft   block = [bonus, MASK × (B−1)] at positions start..start+B−1; one non-causal drafter forward over
            the block (+ its context cache) -> drafts d_1..d_{B−1} = argmax(target.lm_head(slots 1..B−1))
    verify  one target forward over [bonus, d_1..d_{B−1}] -> target samples x_0..x_{B−1}, taps
    accept  a = longest prefix with d_{i+1} == x_i; emit x_0..x_a (τ = a + 1)
    crop    target cache keeps [bonus, d_1..d_a] (start += a + 1); the taps of those a + 1 tokens wait until the
            row next drafts, then reach the drafter's context cache in one injection; the new bonus is x_a.

Block size 1 skips the drafter: plain autoregressive decoding through the same loop, the built-in baseline. Block
size ``"auto"`` asks ``runtime.policy`` each step how many drafts k ∈ [0, B−1] every row verifies, for the batch's
rows together; rows of one step verify a common width, shorter proposals padded with −1 (never matches; on a CPU
the padding is not computed). Sequences of a batch accept different lengths and finish independently (stop tokens,
max_new_tokens).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from trtllm_dflash.errors import ConfigError, require
from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.plugin.dispatch import Impl, draft_pass, resolve
from trtllm_dflash.runtime.datastore import Datastore
from trtllm_dflash.runtime.graphs import StepGraphs
from trtllm_dflash.runtime.mode import DecodeMode
from trtllm_dflash.runtime.local import BatchedLocalSteps
from trtllm_dflash.runtime.policy import AdaptivePolicy
from trtllm_dflash.runtime.protocol import generate_request
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.stepper import Sequence, Stepper, Update, drive
from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier
from trtllm_dflash.runtime.tree import TreeShape

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Request:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()  # generation ends at the first of these (not included in the output)
    min_new_tokens: int = 0  # the target does not choose a stop token before this many new tokens (min_tokens)


@dataclass(frozen=True, slots=True)
class GenerationResult:
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # new tokens only, stop token excluded
    acceptance_lengths: tuple[int, ...]  # τ per step (first token from prefill not counted), each in [1, B]
    finish_reason: str  # "stop" | "length"
    ttft_ms: float  # prefill + first token
    total_ms: float  # until this sequence finished
    draft_lengths: tuple[int, ...] = ()  # k (drafts verified) per step; set under block size "auto"
    lookup_steps: int = 0  # steps that verified a prompt-lookup continuation instead of the drafter's block (ngram)
    lookup_ms: float = 0.0  # tree verify: host time spent making this sequence's lookup chains' proposals
    logprobs: tuple[float, ...] = ()  # with ``sampling.logprobs``: each token's log-probability (chosen_logprobs)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / (self.total_ms / 1e3) if self.total_ms > 0 else 0.0


# on_tokens(request_index, new_token_ids): called as tokens are emitted (for streaming), stop tokens excluded.
TokenCallback = Callable[[int, list[int]], None]


class SpeculativeDecoder:
    """Runs batches of requests through the target (and, for block_size > 1, the drafter), through the one loop."""

    def __init__(self, target: TargetModel, drafter: DrafterModel | None, block_size: int | str, kernels=None,
                 max_block_size: int | None = None, policy: AdaptivePolicy | None = None,
                 prior: list[float] | None = None, ngram: bool = False, tree: bool | TreeShape = False,
                 datastore: Datastore | None = None, cuda_graphs: bool | str = "auto",
                 proposer: Callable | None = None) -> None:
        """``kernels``: a ``plugin.dispatch.Impl``; AUTO (default) runs KV injection and block attention through the
        drafting plugin's Triton kernels on CUDA and through the drafter's own torch code elsewhere.

        ``block_size="auto"``: adaptive k per row and step, up to ``max_block_size`` − 1 drafts (default: the
        drafter's block size), deciding with ``policy`` (default: ``calibrated_policy`` with the acceptance
        ``prior``; ``ngram``: also verify prompt-lookup continuations where they are expected to yield more).

        ``ngram`` at a fixed block size: a row whose context ends in a 2- or 3-gram that occurred earlier verifies the
        B − 1 tokens that followed it (``lookup.ngram_continuation``, at least ``LOOKUP_MIN_N`` tokens matched)
        instead of the drafter's block, and skips the draft pass; the others draft as usual. Lossless either way: the
        verify step does not care where a proposal came from.

        ``tree`` (implies ``ngram`` unless its shape has no lookup chain; a fixed block size; greedy or sampled): every
        row drafts, and verifies its block, the drafter's runner-up tokens at the first slots and prompt lookup's
        proposals (``runtime.tree.lookup_chains``) side by side in one forward, keeping the longest accepted path
        (``runtime.tree``; True: ``TreeShape.for_block(B − 1)``, or a ``TreeShape``). ``datastore``
        (``runtime.datastore``): its proposals take some of the tree's lookup chains (True then means
        ``TreeShape.for_block(B − 1, datastore=True)``).

        ``cuda_graphs`` (``"auto"``: on CUDA only; ``"rehearse"`` anywhere): the verify, tree verify and draft forwards
        replay CUDA graphs (``runtime.graphs``), and the decoder keeps its caches between ``generate`` calls.

        ``proposer``: a stand-in draft source for ``generate``, ``proposer(real, bonus, dcache, rows, committed,
        num_drafts[, top])`` with ``real`` the decoder's own ``propose`` (tests: chosen drafts, every accepted
        length); the policy's calibration times the real draft pass."""
        self.proposer = proposer
        self.adaptive = block_size == AUTO
        block_size = _longest_block(block_size, max_block_size, drafter)
        # the compiled decode step where this machine's table asks for it, loaded now: not inside a request's first
        # steps or the policy's calibration, which would time the loading
        target.warm_decode()
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.mask_token_id = drafter.spec.mask_token_id if drafter is not None else None
        self.taps = drafter.spec.target_layer_ids if (drafter is not None and block_size > 1) else ()
        self.kernels = resolve(kernels or Impl.AUTO, target.device)
        self.graphs = StepGraphs.for_device(target.device, cuda_graphs)
        # the drafting engines every generate call shares (their kernels' weights made once); the draft's own cache
        # and the target's come with each call
        self.injector = KVInjector(drafter, self.kernels) if self.taps else None
        self.head = TargetHead.of(target) if self.taps else None
        self.drafting = BlockDrafter(drafter, self.head, 1, 0, kernels=self.kernels, cuda_graphs=self.graphs,
                                     cache=drafter.new_cache(1, 1)) if self.taps else None
        self.tree = _tree_shape(tree, block_size, self.block_size_label, datastore is not None)
        require(datastore is None or (self.tree is not None and self.tree.lookup), "datastore",
                f"{datastore.num_tokens} tokens" if datastore is not None else None,
                "proposes for the tree verify's lookup chains only", "use --tree with prompt lookup, or no datastore")
        self.datastore = datastore
        self.ngram = bool(ngram or (self.tree is not None and self.tree.lookup)) and block_size > 1
        self.policy = (policy or calibrated_policy(self, prior, ngram=ngram)) if self.adaptive else None
        self.ngram = self.ngram or (self.policy is not None and self.policy.ngram)
        if self.policy is not None:  # auto with a tree: a tree step is one of the policy's options (choose_tree)
            self.policy.tree_nodes = self.tree.size if self.tree else 0

    @property
    def mode(self) -> DecodeMode:
        """The decoder's mode as the stepper takes it (under ``auto`` with its longest block)."""
        if self.adaptive:
            return DecodeMode(AUTO, ngram=self.ngram, tree=self.tree is not None, max_block_size=self.block_size)
        return DecodeMode(self.block_size, ngram=self.ngram, tree=self.tree is not None)

    @property
    def block_size_label(self) -> int | str:
        """What the user asked for: "auto" or the fixed block size."""
        return AUTO if self.adaptive else self.block_size

    @property
    def inject_weights(self):
        """The plugin's fused injection weights (``plugin.kv_inject.InjectWeights``) on the kernel path, else None."""
        return self.injector.weights if self.injector is not None else None

    def _draft(self, block_embeds, dcache, rows, static: bool = False):
        return draft_pass(self.drafter, block_embeds, dcache, rows, self.kernels, static)

    def _new_cache(self, model, rows: int, max_len: int):
        """A cache for a batch: the graphs' pooled one (``StepGraphs.cache``) when graphs are on, else a new one."""
        if self.graphs is None:
            return model.new_cache(rows, max_len)
        return self.graphs.cache("target" if model is self.target else "drafter", model.new_cache, rows, max_len)

    def propose(
        self,
        bonus: torch.Tensor,  # [b] last emitted token of each row (position = committed length)
        dcache,  # the drafter's context cache (KVCache)
        rows: torch.Tensor | None,  # [b] cache rows; None = all (in generate, row r is request r)
        committed: torch.Tensor,  # [b] tokens committed to the target (== drafter context length)
        num_drafts: int | None = None,  # K (default B − 1): the block is [bonus, MASK × K]
        top: int = 1,  # > 1: the drafter's ``top`` best tokens per slot, best first
    ) -> torch.Tensor:  # [b, K] drafts d_1..d_K ([b, K, top] with top > 1)
        """One DFlash draft: block [bonus, MASK × K] through the drafter, greedy through the target's head
        (``BlockDrafter.block``): every draft of ``generate`` (through the ``proposer`` where one is given)."""
        assert self.drafting is not None
        k = self.block_size - 1 if num_drafts is None else num_drafts
        return self.drafting.block(bonus, dcache, rows, k, top)

    def validate(self, req: Request, prefix: str = "") -> None:
        limit = self.target.spec.max_position_embeddings
        require(len(req.prompt_ids) > 0, f"{prefix}prompt", "", "must contain at least one token")
        require(req.max_new_tokens >= 1, f"{prefix}max_new_tokens", req.max_new_tokens, "must be >= 1")
        require(
            len(req.prompt_ids) + req.max_new_tokens <= limit,
            f"{prefix}prompt length + max_new_tokens",
            len(req.prompt_ids) + req.max_new_tokens,
            f"exceeds the target's context limit ({limit} tokens)",
            "shorten the prompt or lower max_new_tokens",
        )
        vocab = self.target.spec.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        require(not bad, f"{prefix}prompt_ids", bad[:3], f"token ids must be in [0, {vocab})")
        req.sampling.validate(prefix)
        require(0 <= req.min_new_tokens <= req.max_new_tokens, f"{prefix}min_new_tokens", req.min_new_tokens,
                f"must be in [0, max_new_tokens={req.max_new_tokens}]")

    def step_engines(self, rows: int, max_len: int) -> BatchedLocalSteps:
        """Step engines for one batch of ``rows`` sequences of at most ``max_len`` tokens (with a verify's scratch
        slots). Sequence n lives in cache row n of both caches; nothing times out during a call."""
        tree_nodes = self.tree.size if self.tree else 0
        verifier = TargetVerifier(self.target, self.taps, rows, max_len, self.block_size, math.inf, tree_nodes,
                                  self.graphs, self._new_cache(self.target, rows, max_len), rows_by_seq_id=True)
        drafter = None
        if self.taps:
            def propose(seq_ids, bonus, cache_rows, k, top):
                committed = verifier.cache.lengths[torch.tensor([verifier.slots.rows[s] for s in seq_ids])]
                choices = (top,) if top > 1 else ()  # an override for chains alone need not take ``top``
                self.drafting.confidence = None
                args = (bonus, drafter.cache, cache_rows, committed.to(bonus.device), k, *choices)
                drafts = self.propose(*args) if self.proposer is None else self.proposer(self.propose, *args)
                drafter.confidence = self.drafting.confidence  # a DSpark drafter's estimates, for ``forecast``
                return drafts

            drafter = BlockDrafter(self.drafter, self.head, rows, max_len, math.inf, self.kernels, self.graphs,
                                   self._new_cache(self.drafter, rows, max_len), rows_by_seq_id=True, propose=propose)
        return BatchedLocalSteps(verifier, self.injector, drafter)

    def generate(self, requests: list[Request], on_tokens: TokenCallback | None = None) -> list[GenerationResult]:
        """Decode ``requests`` as one batch; ``on_tokens(i, ids)`` streams request i's tokens as they are kept."""
        require(len(requests) > 0, "requests", 0, "need at least one request")
        for i, req in enumerate(requests):
            self.validate(req, prefix=f"requests[{i}]." if len(requests) > 1 else "")
        t0 = time.perf_counter()
        # room for the verify's scratch slots past the committed tokens: one block, or the tree's nodes
        max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + (
            self.tree.size if self.tree else self.block_size)
        stepper = Stepper(self.step_engines(len(requests), max_len), self.mode, self.policy, self.tree,
                          self.datastore, weigh=True)
        runs = [_Run(r, t0, i, on_tokens) for i, r in enumerate(requests)]
        for i, run in enumerate(runs):
            r = run.request
            req = generate_request(r.prompt_ids, r.max_new_tokens, r.sampling, tuple((t,) for t in r.stop_token_ids),
                                   True, r.min_new_tokens)
            run.sequence = stepper.add(Sequence(i, req, run.add))
        drive(stepper.run())
        failed = next((run.sequence.error for run in runs if run.sequence.error is not None), None)
        if failed is not None:
            raise failed
        return [run.result() for run in runs]


def _longest_block(block_size: int | str, max_block_size: int | None, drafter: DrafterModel | None) -> int:
    """The longest block a decoder verifies (under ``auto``: ``max_block_size``, or the drafter's trained block),
    checked against what the drafter was trained for."""
    adaptive = block_size == AUTO
    if adaptive:
        require(drafter is not None, "block_size", block_size, "auto needs a drafter",
                "pass --drafter or use --block-size 1")
        assert drafter is not None
        block_size = max_block_size or drafter.spec.block_size
        require(block_size >= 2, "max_block_size", block_size, "must be >= 2 for --block-size auto")
    require(isinstance(block_size, int) and block_size >= 1, "block_size", block_size,
            "must be an integer >= 1 (1 = autoregressive baseline) or 'auto'")
    assert isinstance(block_size, int)
    if block_size > 1:
        require(drafter is not None, "block_size", block_size, "> 1 needs a drafter", "pass --drafter or use 1")
        assert drafter is not None
        require(block_size <= drafter.spec.block_size, "max_block_size" if adaptive else "block_size", block_size,
                f"must be <= the drafter's trained block_size ({drafter.spec.block_size})",
                f"use {drafter.spec.block_size} or less")
    return block_size


def _tree_shape(tree: bool | TreeShape, block_size: int, label: int | str, datastore: bool) -> TreeShape | None:
    """The decoder's tree (True: ``TreeShape.for_block(B − 1)``), checked against its block size; None without."""
    if not tree:
        return None
    require(block_size > 1, "block_size", label, "the tree verify needs a block size >= 2 (or auto) and a drafter",
            "use e.g. --block-size 16+tree")
    shape = TreeShape.for_block(block_size - 1, datastore) if tree is True else tree
    require(shape.k == block_size - 1, "tree", shape, f"must have k = block_size − 1 = {block_size - 1}",
            "build the TreeShape with the decoder's block size")
    return shape


@dataclass
class _Run:
    """One request of a ``generate`` call, gathered from its sequence's updates."""

    request: Request
    t0: float
    index: int
    on_tokens: TokenCallback | None
    sequence: Sequence | None = None
    taus: tuple[int, ...] = ()
    lookup_steps: int = 0
    lookup_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0

    def add(self, u: Update) -> None:
        now = (time.perf_counter() - self.t0) * 1e3
        if not self.ttft_ms:
            self.ttft_ms = now
        self.taus += tuple(u.acceptance_lengths)
        self.lookup_steps += u.lookup_steps
        self.lookup_ms += u.lookup_ms
        if u.final:
            self.total_ms = now
        if self.on_tokens is not None and len(u.tokens) > u.prev_len:
            self.on_tokens(self.index, u.tokens[u.prev_len:])

    def result(self) -> GenerationResult:
        r, seq = self.request, self.sequence
        return GenerationResult(
            prompt_ids=r.prompt_ids, token_ids=tuple(seq.tokens), acceptance_lengths=self.taus,
            draft_lengths=tuple(seq.state.chosen) if seq.state is not None else (),
            lookup_steps=self.lookup_steps, lookup_ms=self.lookup_ms,
            logprobs=tuple(seq.logprobs) if r.sampling.logprobs else (),
            finish_reason=seq.finish_reason or "length", ttft_ms=self.ttft_ms, total_ms=self.total_ms)


def check_capacity(decoder: SpeculativeDecoder, requests: list[Request]) -> None:
    """Validate every request up front (used by the CLI before streaming anything)."""
    if not requests:
        raise ConfigError("prompts", 0, "need at least one prompt")
    for i, r in enumerate(requests):
        decoder.validate(r, prefix=f"prompt {i}: " if len(requests) > 1 else "")


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def calibrated_policy(decoder: SpeculativeDecoder, prior: list[float] | None = None, max_rows: int = 4,
                      refresh: bool = False, ngram: bool = False) -> AdaptivePolicy:
    """An AdaptivePolicy whose cost model is this device's (cached on disk; calibrated on first use: one verify
    forward and one draft pass at each grid size up to ``max_rows`` full blocks, three times each; a cached one is
    spot-checked and rescaled if the machine's speed changed since)."""
    import hashlib
    import math

    from trtllm_dflash.models import products
    from trtllm_dflash.runtime import cost as cost_model
    from trtllm_dflash.runtime.steps import verify_forward

    target, drafter, bsz = decoder.target, decoder.drafter, decoder.block_size
    assert drafter is not None and decoder.mask_token_id is not None
    dev, sync = target.device, _sync(target.device)
    graphs = decoder.graphs.mode if decoder.graphs is not None else None  # a graphed step costs another curve
    head = drafter.draft_head  # a draft vocabulary derived from the target's (models.draft_vocab) drafts cheaper
    derived = head is not None and drafter.spec.draft_vocab_size is None
    model = hashlib.sha256(repr((target.spec, drafter.spec, bsz, decoder.inject_weights is None)
                                + ((graphs,) if graphs else ())
                                + (("draft_vocab", head.draft_vocab_size) if derived else ())).encode())
    kernels = products.table().epoch if dev.type == "cpu" else None  # the CPU's kernels are the table's choices
    key = cost_model.cost_key(cost_model.device_name(dev), str(target.dtype).removeprefix("torch."),
                              torch.get_num_threads(), model.hexdigest()[:16], kernels)

    caches = {}  # (rows, context) -> a cache whose first ``context`` slots of every row count as committed
    drafts = {}  # rows -> an empty drafter cache

    @torch.inference_mode()
    def verify_over(rows: int, width: int, context: int) -> float:
        """One verify of ``rows`` × ``width`` tokens over ``context`` cached tokens a row (the head on the first slot,
        as a verify that rejects d_1). Nothing is committed, so a cache serves every width that fits."""
        cache = caches.get((rows, context))
        if cache is None or cache.max_len < context + width + 1:  # the cached K/V's values do not change the time
            cache = caches[rows, context] = target.new_cache(rows, context + max(width, bsz) + 1)
            cache.lengths.fill_(context)
        ids = torch.zeros(rows, width, dtype=torch.long, device=dev)
        return cost_model.timed(lambda: target.logits(
            verify_forward(target, decoder.graphs, cache, ids, None, decoder.taps)[0][:, :1]), sync)

    @torch.inference_mode()
    def draft(n: int) -> float:
        rows, width = math.ceil(n / bsz), min(n, bsz)
        dcache = drafts.get(rows)
        if dcache is None:  # one per row count: a graphed draft is captured once per cache and width
            dcache = drafts[rows] = drafter.new_cache(rows, bsz + 1)
        bonus = torch.zeros(rows, dtype=torch.long, device=dev)
        return cost_model.timed(lambda: decoder.propose(bonus, dcache, None, dcache.lengths, width - 1), sync)

    cost = cost_model.load_or_calibrate(key, lambda n: verify_over(1, n, 0), draft, max_rows * bsz, refresh=refresh,
                                      check=3, measure_context=verify_over)
    return AdaptivePolicy(cost, bsz, prior, ngram=ngram)
