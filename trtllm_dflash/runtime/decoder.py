"""The speculative decoder: the reference DFlash loop, batched, and the correctness oracle for every other path.

One step for each live sequence (dflash.md §2.1), with ``start`` = tokens committed to the target cache:

    draft   block = [bonus, MASK × (B−1)] at positions start..start+B−1; one non-causal drafter forward over
            the block (+ its context cache) -> drafts d_1..d_{B−1} = argmax(target.lm_head(slots 1..B−1))
    verify  one target forward over [bonus, d_1..d_{B−1}] -> target samples x_0..x_{B−1}, taps
    accept  a = longest prefix with d_{i+1} == x_i; emit x_0..x_a (τ = a + 1)
    crop    target cache keeps [bonus, d_1..d_a] (start += a + 1); the drafter's context cache gets the taps of
            those a + 1 tokens (KV injection); the new bonus is x_a, not yet fed to the target.

Invariant at the top of every step: drafter context length == target committed length == start. Under ``auto`` the
injection is lazy: a row's taps wait (``_PendingTaps``) until it next drafts, so the invariant holds for the rows
that draft, right before their draft pass; rows verifying k = 0 never touch the drafter.

Block size 1 skips the drafter (and the taps): it is plain autoregressive decoding through the same code, the
built-in baseline. Block size ``"auto"`` asks ``runtime.policy`` each step how many drafts k ∈ [0, B−1] every row
verifies (k = 0: no draft pass for that row); the step verifies a rectangular [b, K + 1] block, rows drafting fewer
than K padded with drafts that never match, so acceptance, crop and injection are the same code.

Sequences of a batch accept different lengths (ragged caches, ``KVCache.lengths``) and finish independently (stop
tokens, max_new_tokens); finished rows simply drop out of the step's ``rows``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from trtllm_dflash.errors import ConfigError, require
from trtllm_dflash.models.drafter import DrafterModel, draft_block
from trtllm_dflash.models.layers import stack_padded
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.acceptance import SeqState
from trtllm_dflash.runtime.lookup import LOOKUP_MIN_N, ngram_lookup
from trtllm_dflash.runtime.policy import AdaptivePolicy
from trtllm_dflash.runtime.sampling import (History, SamplingParams, logprobs_buffer, target_samples,
                                            verify_samples)
from trtllm_dflash.runtime.datastore import Datastore
from trtllm_dflash.runtime.graphs import StepGraphs
from trtllm_dflash.runtime.tree import TreeShape, chain_table, commit_path, graft_chains, lookup_chains

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


@dataclass
class _Seq:
    request: Request
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    taus: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    total_ms: float = 0.0
    policy: SeqState | None = None
    lookup_steps: int = 0
    lookup_ms: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # the kept tokens', when the request asks for them
    sampling: SamplingParams = field(init=False)  # the request's, with its min_new_tokens' ban

    def __post_init__(self) -> None:
        r = self.request
        self.sampling = r.sampling.with_min_tokens(r.min_new_tokens, len(r.prompt_ids), r.stop_token_ids)

    def emit(self, new: list[int], logprobs: list[float] | None = None) -> list[int]:
        """Append new tokens (and their ``logprobs``) up to a stop token or the length limit; return what was
        actually kept."""
        kept = []
        for tok in new:
            if tok in self.request.stop_token_ids:
                self.finish_reason = "stop"
                break
            kept.append(tok)
            if len(self.tokens) + len(kept) >= self.request.max_new_tokens:
                self.finish_reason = "length"
                break
        self.tokens.extend(kept)
        if self.sampling.logprobs and logprobs is not None:
            self.logprobs.extend(logprobs[: len(kept)])
        return kept


class _PendingTaps:
    """Per cache row, the taps of committed tokens not yet injected into the drafter's context cache."""

    def __init__(self, num_rows: int) -> None:
        self.chunks: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]  # [row] -> [T_i, K·H] pieces

    def add(self, rows, taps: torch.Tensor, counts: list[int]) -> None:
        """taps [b, T, K·H] of one forward over ``rows``; row j committed its first counts[j] positions."""
        for j, (row, n) in enumerate(zip(rows, counts)):
            self.chunks[row].append(taps[j, :n])

    def take(self, rows: list[int]) -> tuple[torch.Tensor | None, list[int]]:
        """Padded taps [r, T_max, K·H] and the token count of each of ``rows``; clears them."""
        pieces = []
        for row in rows:
            chunk, self.chunks[row] = self.chunks[row], []
            pieces.append(chunk[0] if len(chunk) == 1 else torch.cat(chunk) if chunk else None)
        num = [0 if p is None else p.shape[0] for p in pieces]
        if not any(num):
            return None, num
        ref = next(p for p in pieces if p is not None)
        return stack_padded([ref.new_zeros(0, ref.shape[-1]) if p is None else p for p in pieces]), num


class SpeculativeDecoder:
    """Runs batches of requests through the target (and, for block_size > 1, the drafter)."""

    def __init__(self, target: TargetModel, drafter: DrafterModel | None, block_size: int | str, kernels=None,
                 max_block_size: int | None = None, policy: AdaptivePolicy | None = None,
                 prior: list[float] | None = None, ngram: bool = False, tree: bool | TreeShape = False,
                 datastore: Datastore | None = None, cuda_graphs: bool | str = False) -> None:
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

        ``cuda_graphs`` (CUDA only; ``"rehearse"`` anywhere): the verify and draft forwards replay CUDA graphs
        (``runtime.graphs``), and the decoder keeps its caches between ``generate`` calls."""
        self.adaptive = block_size == AUTO
        if self.adaptive:
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
            require(
                block_size <= drafter.spec.block_size,
                "max_block_size" if self.adaptive else "block_size",
                block_size,
                f"must be <= the drafter's trained block_size ({drafter.spec.block_size})",
                f"use {drafter.spec.block_size} or less",
            )
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.mask_token_id = drafter.spec.mask_token_id if drafter is not None else None
        self.taps = drafter.spec.target_layer_ids if (drafter is not None and block_size > 1) else ()
        self.inject_weights = None
        if self.taps:
            from trtllm_dflash.plugin.dispatch import Impl, resolve

            self.kernels = resolve(kernels or Impl.AUTO, target.device)
            if self.kernels is Impl.TRITON:
                from trtllm_dflash.plugin.kv_inject import InjectWeights

                self.inject_weights = InjectWeights.from_drafter(drafter)
        self.tree = None
        if tree:
            require(block_size > 1, "block_size", self.block_size_label,
                    "the tree verify needs a block size >= 2 (or auto) and a drafter", "use e.g. --block-size 16+tree")
            self.tree = TreeShape.for_block(block_size - 1, datastore is not None) if tree is True else tree
            require(self.tree.k == block_size - 1, "tree", self.tree,
                    f"must have k = block_size − 1 = {block_size - 1}",
                    "build the TreeShape with the decoder's block size")
        require(datastore is None or (self.tree is not None and self.tree.lookup), "datastore",
                f"{datastore.num_tokens} tokens" if datastore is not None else None,
                "proposes for the tree verify's lookup chains only", "use --tree with prompt lookup, or no datastore")
        self.datastore = datastore
        self.graphs = StepGraphs.for_device(target.device, cuda_graphs)
        self.ngram = bool(ngram or (self.tree is not None and self.tree.lookup)) and block_size > 1
        self.policy = (policy or calibrated_policy(self, prior, ngram=ngram)) if self.adaptive else None
        self.ngram = self.ngram or (self.policy is not None and self.policy.ngram)
        if self.policy is not None:  # auto with a tree: a tree step is one of the policy's options (choose_tree)
            self.policy.tree_nodes = self.tree.size if self.tree else 0

    @property
    def block_size_label(self) -> int | str:
        """What the user asked for: "auto" or the fixed block size."""
        return AUTO if self.adaptive else self.block_size

    def _inject(self, taps, num_tokens, dcache, rows=None) -> None:
        if self.inject_weights is None:
            self.drafter.inject(taps, num_tokens, dcache, rows)
        else:
            from trtllm_dflash.plugin import drafter_ops

            drafter_ops.inject(self.drafter, self.inject_weights, taps, num_tokens, dcache, rows, self.kernels)

    def _draft(self, block_embeds, dcache, rows, static: bool = False):
        from trtllm_dflash.plugin import drafter_ops

        return drafter_ops.draft_pass(self.drafter, block_embeds, dcache, rows, self.kernels, static)

    def _new_cache(self, model, rows: int, max_len: int):
        """A cache for a batch: the graphs' pooled one (``StepGraphs.cache``) when graphs are on, else a new one."""
        if self.graphs is None:
            return model.new_cache(rows, max_len)
        return self.graphs.cache("target" if model is self.target else "drafter", model.new_cache, rows, max_len)

    def verify_forward(self, ids: torch.Tensor, tcache, rows: torch.Tensor | None, widths: list[int] | None = None):
        """The target over one step's [b, S] tokens at the rows' next positions: (hidden, taps). Through a CUDA graph
        when graphs are on; else skipping the padding past each row's real ``widths`` where that pays
        (``TargetModel.verify_widths``)."""
        if self.graphs is None:
            return self.target(ids, tcache, rows, tap_layers=self.taps,
                               widths=None if widths is None else self.target.verify_widths(widths))
        return self._graphed("verify", tcache, lambda x, r: self.target(x, tcache, r, tap_layers=self.taps,
                                                                        static=True), ids, rows)

    def tree_forward(self, tokens: torch.Tensor, tcache, rows: torch.Tensor | None):
        """The target over a tree step's [b, N] node tokens (``runtime.tree`` layout at the rows' committed
        lengths): (hidden, taps); through a CUDA graph when graphs are on (the layout over all cache slots)."""
        assert self.tree is not None
        kv_len = tcache.max_len if self.graphs is not None else None

        def forward(x: torch.Tensor, r: torch.Tensor | None):
            committed = tcache.lengths if r is None else tcache.lengths[r]
            return self.target(x, tcache, r, tap_layers=self.taps, layout=self.tree.layout(committed, kv_len))

        return self._graphed("tree", tcache, forward, tokens, rows)

    def _graphed(self, name: str, cache, fn, x: torch.Tensor, rows: torch.Tensor | None, *key) -> tuple:
        """``fn(x, rows)``, eagerly or, with graphs, through the step captured for ``name`` over ``cache`` at this
        shape (``key``: whatever else changes what ``fn`` launches)."""
        if self.graphs is None:
            return fn(x, rows)
        inputs = (x,) if rows is None else (x, rows)
        return self.graphs.run((name, id(cache), tuple(x.shape), rows is None, *key), cache,
                               lambda x, *r: fn(x, r[0] if r else None), *inputs)

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

    @torch.inference_mode()
    def generate(self, requests: list[Request], on_tokens: TokenCallback | None = None) -> list[GenerationResult]:
        require(len(requests) > 0, "requests", 0, "need at least one request")
        for i, req in enumerate(requests):
            self.validate(req, prefix=f"requests[{i}]." if len(requests) > 1 else "")
        t0 = time.perf_counter()
        dev, bsz, n = self.target.device, self.block_size, len(requests)
        seqs = [
            _Seq(r, None if r.sampling.greedy else torch.Generator().manual_seed(r.sampling.seed)) for r in requests
        ]
        prompt_lens = torch.tensor([len(r.prompt_ids) for r in requests], device=dev)  # [n]
        # room for the verify's scratch slots past the committed tokens: one block, or the tree's nodes
        max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + (self.tree.size if self.tree else bsz)
        tcache = self._new_cache(self.target, n, max_len)
        dcache = self._new_cache(self.drafter, n, max_len) if self.taps else None

        # Prefill: right-padded prompts; padding only ever sits after a row's real tokens, so causal masks keep it
        # invisible, and positions >= lengths are scratch anyway; the layers compute the real tokens only.
        ids = torch.zeros(n, int(prompt_lens.max()), dtype=torch.long, device=dev)  # [n, P_max]
        for i, r in enumerate(requests):
            ids[i, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, device=dev)
        hidden, taps = self.target(ids, tcache, tap_layers=self.taps,  # [n, P_max, H], [n, P_max, K·H]
                                   widths=torch.tensor([len(r.prompt_ids) for r in requests]))  # padding: skipped
        last = hidden[torch.arange(n, device=dev), prompt_lens - 1]  # [n, H]
        lp = logprobs_buffer([s.sampling for s in seqs], n, 1, dev)
        first = target_samples(self.target.logits(last)[:, None], [s.sampling for s in seqs],
                               [s.generator for s in seqs], prompt_lens, history=self._history(seqs),
                               logprobs=lp)[:, 0]  # [n]
        tcache.commit(None, prompt_lens)
        # ``auto`` and ``ngram`` inject lazily: the taps of committed tokens wait here until their row next drafts,
        # then go through the drafter's K/V projection in one call (same K/V as eager injection; k = 0 steps and
        # prompt-lookup steps pay nothing).
        pending = _PendingTaps(n) if (dcache is not None and (self.adaptive or self.ngram)) else None
        if pending is not None:
            pending.add(range(n), taps, prompt_lens.tolist())
        elif dcache is not None:
            self._inject(taps, prompt_lens, dcache)
        bonus = first.clone()  # [n]: last emitted token, not yet fed to the target
        ttft_ms = (time.perf_counter() - t0) * 1e3
        self._emit(seqs, range(n), [[int(t)] for t in first], on_tokens, t0, lp)

        # the step's device syncs only serve the adaptive policy's timings; without a policy the one sync a step
        # needs is reading the accepted lengths and samples back, and the host queues the next step's work
        policy = self.policy
        sync = _sync(dev) if policy is not None else (lambda: None)
        if policy is not None:
            for s in seqs:
                s.policy = policy.new_sequence()
        while True:
            active = [i for i, s in enumerate(seqs) if s.finish_reason is None]
            if not active:
                break
            rows = None if len(active) == n else torch.tensor(active, device=dev)  # [b]
            b = len(active)
            cur = bonus if rows is None else bonus[rows]  # [b]
            t_step = time.perf_counter()
            captures = self.graphs.captures if self.graphs is not None else 0
            found = lookups = None
            if self.ngram and dcache is not None and (not self.tree or policy is not None):
                found = [ngram_lookup(seqs[i].request.prompt_ids + tuple(seqs[i].tokens), bsz - 1, min_n=LOOKUP_MIN_N)
                         for i in active]
                lookups = [lk.tokens for lk in found]
            ks = None
            if policy is not None:
                states = [seqs[i].policy for i in active]
                for j, (i, s) in enumerate(zip(active, states)):
                    s.lookup = found[j] if found else None
                    s.context = len(seqs[i].request.prompt_ids) + len(seqs[i].tokens)
                    s.remaining = seqs[i].request.max_new_tokens - len(seqs[i].tokens)
                weights = policy.batch_weights([s.remaining for s in states], sum(s.context for s in states))
                for s, w in zip(states, weights):
                    s.weight = w
                ks = policy.decide(states, lookups and [len(c) for c in lookups])
            use_tree = bool(self.tree) and (policy is None or policy.choose_tree(states))
            if use_tree:  # runtime.tree: the drafter's block, its alternates and the lookup chains at once
                samples, acc, taps, t_draft, lp = self._tree_verify(cur, rows, active, tcache, dcache, pending, seqs,
                                                                    sync)
                sync()
                t_verify = time.perf_counter()
            else:
                if policy is not None:
                    drafting = [j for j, i in enumerate(active) if seqs[i].policy.source == "drafter"]
                    looked = [j for j, i in enumerate(active) if seqs[i].policy.source == "ngram" and ks[j]]
                else:
                    ks = [bsz - 1] * b
                    looked = [j for j in range(b) if lookups and lookups[j]]
                    drafting = [j for j in range(b) if not (lookups and lookups[j])]
                kmax = max(ks) if dcache is not None else 0
                if pending is not None and kmax > 0 and drafting:
                    self._flush(pending, [active[j] for j in drafting], dcache)
                widths = [1] * b  # each row's real tokens: the bonus and its proposals (the rest is padding)
                if kmax > 0 and len(drafting) == b:
                    committed = tcache.lengths if rows is None else tcache.lengths[rows]  # [b]
                    drafts = self.propose(cur, dcache, rows, committed, kmax)  # [b, K]
                    widths = [kmax + 1] * b
                elif kmax > 0:  # only some rows draft; the others verify their n-gram or padding that never matches
                    drafts = torch.full((b, kmax), -1, dtype=torch.long, device=dev)
                    if drafting:
                        committed = tcache.lengths if rows is None else tcache.lengths[rows]  # [b]
                        sel = torch.tensor(drafting, device=dev)
                        drows = sel if rows is None else rows[sel]
                        drafts[sel] = self.propose(cur[sel], dcache, drows, committed[sel], kmax)
                        for j in drafting:
                            widths[j] = kmax + 1
                    for j in looked:
                        proposal = lookups[j][: ks[j]]
                        drafts[j, : len(proposal)] = torch.tensor(proposal, device=dev)
                        widths[j] = len(proposal) + 1
                        seqs[active[j]].lookup_steps += 1
                else:
                    drafts = torch.empty(b, 0, dtype=torch.long, device=dev)
                sync()
                t_draft = time.perf_counter()
                block = torch.cat([cur[:, None], drafts], dim=1)  # [b, K + 1]; −1: padding
                verify_ids = block.clamp(min=0)
                positions = (tcache.lengths if rows is None else tcache.lengths[rows]) + 1  # [b] token slot 0 predicts
                hidden, taps = self.verify_forward(verify_ids, tcache, rows, widths)
                lp = logprobs_buffer([seqs[i].sampling for i in active], b, block.shape[1], dev)
                samples, acc = verify_samples(
                    self.target.logits, hidden, drafts, [seqs[i].sampling for i in active],
                    [seqs[i].generator for i in active], positions,
                    self._history([seqs[i] for i in active], block), lp,
                )  # [b, K + 1] (valid up to each row's bonus), [b]
                sync()
                t_verify = time.perf_counter()
            tcache.commit(rows, acc + 1)
            # one device read a step: the accepted lengths and the samples together (a read per row's tokens
            # was a sync each on a GPU)
            host = torch.cat([acc[:, None], samples], dim=1).tolist()  # [b][1 + K + 1]
            accepted = [r[0] for r in host]
            if pending is not None:
                pending.add(active, taps, [a + 1 for a in accepted])
            elif dcache is not None:
                self._inject(taps, acc + 1, dcache, rows)
            new_bonus = samples.gather(1, acc[:, None])[:, 0]  # [b]
            if rows is None:
                bonus = new_bonus
            else:
                bonus[rows] = new_bonus
            emitted = [host[j][1 : accepted[j] + 2] for j in range(b)]
            for j, i in enumerate(active):
                seqs[i].taus.append(accepted[j] + 1)
            # a step that captured a CUDA graph took a capture's time, not a step's: the cost model does not learn it
            timed = self.graphs is None or self.graphs.captures == captures
            if policy is not None and use_tree:
                for j, i in enumerate(active):
                    policy.observe_tree(seqs[i].policy, accepted[j])
                sync()
                now = time.perf_counter()
                policy.observe_step([policy.max_k] * b, accepted, t_draft - t_step, t_verify - t_draft, now - t_verify,
                                    b, verify_tokens=b * self.tree.size, timed=timed)
            elif policy is not None:
                for j, i in enumerate(active):
                    policy.observe(seqs[i].policy, ks[j], accepted[j])
                sync()
                now = time.perf_counter()
                policy.observe_step(ks, accepted, t_draft - t_step, t_verify - t_draft, now - t_verify, len(drafting),
                                    timed=timed)
            self._emit(seqs, active, emitted, on_tokens, t0, lp)

        return [
            GenerationResult(
                prompt_ids=r.prompt_ids,
                token_ids=tuple(s.tokens),
                acceptance_lengths=tuple(s.taus),
                draft_lengths=tuple(s.policy.chosen) if s.policy is not None else (),
                lookup_steps=s.lookup_steps,
                lookup_ms=s.lookup_ms,
                logprobs=tuple(s.logprobs),
                finish_reason=s.finish_reason or "length",
                ttft_ms=ttft_ms,
                total_ms=s.total_ms,
            )
            for r, s in zip(requests, seqs)
        ]

    def _flush(self, pending: _PendingTaps, rows: list[int], dcache) -> None:
        """Inject the pending taps of ``rows`` (cache rows about to draft) in one call; row by row where padding to
        the longest row's pending count would run past a shorter row's cache capacity (a row that verified prompt
        lookup's proposals for many steps while another drafted every step)."""
        longest = max(len(c) and sum(t.shape[0] for t in c) for c in (pending.chunks[r] for r in rows))
        if len(rows) > 1 and int(dcache.lengths[rows].max()) + longest > dcache.max_len:
            for row in rows:
                self._flush(pending, [row], dcache)
            return
        taps, num = pending.take(rows)
        if taps is not None:
            dev = dcache.lengths.device
            self._inject(taps, torch.tensor(num, device=dev), dcache,
                         None if rows == list(range(dcache.num_rows)) else torch.tensor(rows, device=dev))

    def _history(self, seqs: list[_Seq], ids: torch.Tensor | None = None, parents=None) -> History | None:
        """What the rows among ``seqs`` with penalties or bad words look back at (``sampling.History``): their prompt
        and tokens so far, and a verify's input ``ids`` (a tree's with its ``parents``); None when no row does."""
        if not any(s.sampling.needs_history for s in seqs):
            return None
        return History.of([s.request.prompt_ids + tuple(s.tokens) if s.sampling.needs_history else None for s in seqs],
                          self.target.spec.vocab_size, ids, parents, [s.sampling for s in seqs])

    def _tree_verify(self, cur, rows, active, tcache, dcache, pending, seqs, sync=lambda: None):
        """One tree step: every row drafts (its top choices per slot), then verifies all of the tree's nodes under
        its layout; returns the kept path's samples [b, K + 1], accepted lengths [b], taps, when the draft and
        the proposals were done (``sync`` first: the adaptive policy's timing) and the path's log-probabilities
        [b, K + 1] (None when no row asks for them)."""
        shape, dev = self.tree, cur.device
        k = shape.k
        if pending is not None:
            self._flush(pending, active, dcache)
        committed = tcache.lengths if rows is None else tcache.lengths[rows]  # [b], read before the commit
        drafts = self.propose(cur, dcache, rows, committed, k, top=shape.top)  # [b, K] or [b, K, R]
        # the lookup chains' proposals (runtime.tree) are made on the host while a GPU drafts; the grafted ones need
        # each row's main-chain drafts (one small read), made from its context extended by them
        contexts = [seqs[i].request.prompt_ids + tuple(seqs[i].tokens) for i in active]
        own, grafted = [], []
        for i, c in zip(active, contexts):
            t0 = time.perf_counter()
            own.append(lookup_chains(shape, c, self.datastore))
            seqs[i].lookup_ms += (time.perf_counter() - t0) * 1e3
        main = (drafts[..., 0] if drafts.dim() == 3 else drafts)[:, : max(shape.grafts)].tolist() if shape.grafts \
            else [[] for _ in active]
        for i, c, m, o in zip(active, contexts, main, own):
            t0 = time.perf_counter()
            grafted.append(graft_chains(shape, c, m, self.datastore, o))
            seqs[i].lookup_ms += (time.perf_counter() - t0) * 1e3
        look = chain_table(shape, list(zip(own, grafted))).to(dev)
        tokens = shape.tokens(cur, drafts, look)  # [b, N]
        sync()
        t_draft = time.perf_counter()
        hidden, taps = self.tree_forward(tokens.clamp(min=0), tcache, rows)
        lp = logprobs_buffer([seqs[i].sampling for i in active], *tokens.shape, dev)
        preds = shape.topology.samples(self.target.logits(hidden), [seqs[i].sampling for i in active],
                                       [seqs[i].generator for i in active], committed,
                                       self._history([seqs[i] for i in active], tokens, shape.topology.parents), lp)
        samples, acc, taken, best = shape.verify(preds, tokens)
        commit_path(tcache, rows, committed, taken, acc)
        for j in shape.tables(dev)["from_lookup"][best].nonzero()[:, 0].tolist():
            seqs[active[j]].lookup_steps += 1
        return (samples, acc, taps.gather(1, taken[..., None].expand(-1, -1, taps.shape[-1])), t_draft,
                None if lp is None else lp.gather(1, taken))

    def propose(
        self,
        bonus: torch.Tensor,  # [b] last emitted token of each row (position = committed length)
        dcache,  # the drafter's context cache (KVCache)
        rows: torch.Tensor | None,  # [b] cache rows; None = all
        committed: torch.Tensor,  # [b] tokens committed to the target (== drafter context length)
        num_drafts: int | None = None,  # K (default B − 1): the block is [bonus, MASK × K]
        top: int = 1,  # > 1: the drafter's ``top`` best tokens per slot, best first
    ) -> torch.Tensor:  # [b, K] drafts d_1..d_K ([b, K, top] with top > 1)
        """One DFlash draft: block [bonus, MASK × K] through the drafter, greedy through the target's head.

        Tests override this to inject chosen drafts and exercise every accepted length.
        """
        assert self.drafter is not None and self.mask_token_id is not None
        k = self.block_size - 1 if num_drafts is None else num_drafts
        static = self.graphs is not None

        def block(first: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
            return draft_block(first, k + 1, self.mask_token_id, self.target.embed,
                               lambda e: self._draft(e, dcache, r, static),
                               lambda h: self.target.logits(h.to(self.target.dtype)), top,
                               own_head=self.drafter.draft_head)

        out = self._graphed("draft", dcache, block, bonus, rows, k, top)
        return out[0] if static else out

    @staticmethod
    def _emit(seqs: list[_Seq], rows, new_tokens: list[list[int]], on_tokens: TokenCallback | None, t0: float,
              logprobs: torch.Tensor | None = None):
        """``logprobs``: the step's [len(rows), ≥ tokens] buffer (``sampling.logprobs_buffer``) or None."""
        host = None if logprobs is None else logprobs.tolist()
        for j, (i, new) in enumerate(zip(rows, new_tokens)):
            kept = seqs[i].emit(new, None if host is None else host[j])
            if kept and on_tokens is not None:
                on_tokens(i, kept)
            if seqs[i].finish_reason is not None:
                seqs[i].total_ms = (time.perf_counter() - t0) * 1e3


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

    from trtllm_dflash.runtime import cost as cost_model

    target, drafter, bsz = decoder.target, decoder.drafter, decoder.block_size
    assert drafter is not None and decoder.mask_token_id is not None
    dev, sync = target.device, _sync(target.device)
    graphs = decoder.graphs.mode if decoder.graphs is not None else None  # a graphed step costs another curve
    model = hashlib.sha256(repr((target.spec, drafter.spec, bsz, decoder.inject_weights is None)
                                + ((graphs,) if graphs else ())).encode())
    key = cost_model.cost_key(cost_model.device_name(dev), str(target.dtype).removeprefix("torch."),
                            torch.get_num_threads(), model.hexdigest()[:16])

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
        return cost_model.timed(lambda: target.logits(decoder.verify_forward(ids, cache, None)[0][:, :1]), sync)

    @torch.inference_mode()
    def draft(n: int) -> float:
        rows, width = math.ceil(n / bsz), min(n, bsz)
        dcache = drafts.get(rows)
        if dcache is None:  # one per row count: a graphed draft is captured once per cache and width
            dcache = drafts[rows] = drafter.new_cache(rows, bsz + 1)
        bonus = torch.zeros(rows, dtype=torch.long, device=dev)
        # the class's own draft (a test's decoder may override ``propose`` to replace the drafts)
        return cost_model.timed(lambda: SpeculativeDecoder.propose(decoder, bonus, dcache, None, dcache.lengths,
                                                                 width - 1), sync)

    cost = cost_model.load_or_calibrate(key, lambda n: verify_over(1, n, 0), draft, max_rows * bsz, refresh=refresh,
                                      check=3, measure_context=verify_over)
    return AdaptivePolicy(cost, bsz, prior, ngram=ngram)
