"""Tree verify: several proposals for the next tokens checked in one target forward, the longest accepted kept.

A DFlash draft gives, at every slot of the block, a distribution over the next token, and prompt lookup sometimes a
second guess for the whole block. Verifying one chain per step throws the rest away. A tree verify checks, in the same
forward, the drafter's greedy block (the *main* chain), *alternates* — the drafter's r-th choice at slot j in place of
its first, followed by the main chain's tokens after j (the drafter predicts every slot of a block at once, so its
later slots do not depend on which token slot j holds) — and lookup chains: prompt lookup's proposals (the
continuations of earlier occurrences of the context's last tokens) and a retrieval datastore's (``runtime.datastore``:
the same over a corpus of the target's own outputs), one chain each — and the same lookup chains again *grafted* after
the drafter's first draft(s), proposed from the context extended by them (``graft_chains``); it keeps the deepest
accepted path. Where a verify costs about one decode step whatever its width (a GPU at small batch) that is τ almost
for free; on a CPU the wider verify costs more than it gains.

The tree is static (``TreeShape``): the same nodes for every row and step, only their tokens differ. Node 0 is ``x``,
the last emitted token; every other node has a parent and a depth, and a row with committed length L writes node n's
K/V at slot L + n, at RoPE position L + depth(n). A node sees the cache, and of the step's nodes only its ancestors and
itself: its hidden state is what a verify of its own chain alone computes (up to the summation order of the masked
attention), so the step is as lossless as a one-chain verify. Under sampling each node's target token is drawn from
the noise of the position it predicts (``sampling.slot_generator``: keyed by the sequence's seed and the absolute
position, whatever the prefix), so a node's sample is the token an autoregressive step after its path would draw; a
node is accepted where its token is its parent's sample, and the kept path's tokens are exactly the autoregressive
sampled ones — lossless at any temperature, token-identical to block-size-1 sampling with the same seed.

With no alternates the tree is the two-branch verify [x, d_1..d_K, l_1..l_K]:

    slot      L     L+1 … L+K     L+K+1 … L+2K         x: the last emitted token, d: drafts, l: lookup (−1 padded)
    position  L     L+1 … L+K     L+1   … L+K          (RoPE)

After the verify the accepted path's K/V move to slots L+1 … L+a where they are committed (nothing moves when the
main chain wins: its nodes are 1..K)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from trtllm_dflash.runtime.lookup import held, ngram_candidates
from trtllm_dflash.runtime.datastore import Datastore
from trtllm_dflash.runtime.sampling import History, target_samples

# The decoder's tree (``TreeShape.for_block``), picked by replaying the shipped drafter over its greedy outputs
# (``perf/tree_shapes.py`` at 0620e3a; perf/results/tree/): the drafter's 2nd–8th choices at slot 1 and its runner-up
# at slots 2–4, each continued by the main chain up to 4 nodes (longer continuations cost many nodes for almost no
# τ), raise τ over the two-branch tree (main + lookup) on HumanEval and MT-Bench alike. (slot, rank): rank 2 = the
# drafter's second choice.
DEFAULT_ALTERNATES: tuple[tuple[int, int], ...] = tuple((1, r) for r in range(2, 9)) + ((2, 2), (3, 2), (4, 2))
DEFAULT_ALTERNATE_LEN = 4
# Prompt lookup's proposals for the tree's lookup chains (``lookup_chains``): the continuations after the PER_N latest
# earlier occurrences of the context's last n tokens, n = MAX_N down to MIN_N (``lookup.ngram_candidates``). Picked
# by replay (perf/results/tree/2026-11-26-shapes/): with the alternates above, falling back to 1-grams and matching up
# to 5-grams beats one chain of the latest 2- or 3-gram's continuation at the same node count, and a second chain (two
# occurrences per n) raises τ again; a third or more add nodes for almost nothing.
LOOKUP_MAX_N, LOOKUP_MIN_N, LOOKUP_PER_N = 5, 1, 2
DEFAULT_LOOKUP_CHAINS = 2
# With a retrieval datastore (``runtime.datastore``, the target's regenerated responses): two chains of prompt
# lookup's and one of the datastore's raise τ over the two of prompt lookup's (same replay) and beat a third prompt
# lookup chain of the same node count; more datastore chains add nodes for little.
DATASTORE_LOOKUP_CHAINS = 3
# Lookup chains grafted onto the main chain (``TreeShape.grafts``): after the drafter's first draft, the same lookup
# chains again, proposed from the context extended by that draft (where prompt lookup and the datastore find nothing
# for the context, a guessed next token often gives them a match; when the draft is right they propose what the next
# step's lookup would). Picked by replay (perf/results/tree/2026-11-26-datastore/): grafts after the first draft raise
# τ with and without the datastore; grafts at depth 2 as well add many nodes for little more. A proposal that a chain
# from x already holds after the same draft is skipped (it would spend nodes verifying the same tokens twice).
DEFAULT_GRAFTS: tuple[int, ...] = (1,)


@dataclass
class StepLayout:
    """Where a verify forward's tokens go when they are not one consecutive run: RoPE ``positions`` [b, S], cache
    ``slots`` [b, S] their K/V are written to, and the attention mask ``allowed`` [b, S, kv_len] over cache slots."""

    positions: torch.Tensor
    slots: torch.Tensor
    allowed: torch.Tensor


@dataclass(frozen=True)
class Topology:
    """A tree verify's structure alone, as it travels to a verifier that knows nothing of where the tokens came from
    (the Triton ``target_verify`` model): each node's parent, node 0 being x (``parents[0] == 0``) and every other
    node's parent an earlier node. Layout, acceptance and the kept path follow from it; ``TreeShape`` adds where each
    node's token comes from."""

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if not self.parents or self.parents[0] != 0:
            raise ValueError(f"parents = {list(self.parents)[:8]}: node 0 is the last emitted token, its own parent 0")
        bad = [n for n, p in enumerate(self.parents) if n and not 0 <= p < n]
        if bad:
            raise ValueError(f"parents = {list(self.parents)[:8]}...: node {bad[0]}'s parent {self.parents[bad[0]]} "
                             "must be an earlier node (0 <= parent < node)")

    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> list[int]:
        out = [0]
        for p in self.parents[1:]:
            out.append(out[p] + 1)
        return out

    @property
    def k(self) -> int:
        """The deepest node's depth: at most k tokens are accepted per step (k + 1 emitted)."""
        return max(self.depths)

    @cached_property
    def paths(self) -> list[list[int]]:
        """Per node, the nodes from x down to it (index = depth), padded to k + 1 with the node itself."""
        out: list[list[int]] = []
        for n, p in enumerate(self.parents):
            path = [0] if n == 0 else out[p][: self.depths[p] + 1] + [n]
            out.append(path + [n] * (self.k + 1 - len(path)))
        return out

    def samples(self, logits: torch.Tensor, params, generators, lengths: torch.Tensor,
                history: History | None = None, logprobs: torch.Tensor | None = None) -> torch.Tensor:
        """The target's token after every node [b, N] from the verify's ``logits`` [b, N, V], for rows with committed
        ``lengths`` [b]: the argmax for greedy rows; for sampled rows (``sampling.SamplingParams``, a generator each)
        a draw from the noise of the position node n predicts, lengths + 1 + depth(n). ``history``: what penalised
        rows count (its ids the nodes' tokens, its parents these); ``logprobs`` [b, N]: written, each token's
        log-probability (``sampling.chosen_logprobs``)."""
        return target_samples(logits, params, generators, lengths + 1, self.depths, history, logprobs)

    def tables(self, device) -> dict[str, torch.Tensor]:
        """The index tables on ``device`` (made once per device: a step reuses them)."""
        return _tables(self, str(device))

    def layout(self, lengths: torch.Tensor, kv_len: int | None = None) -> StepLayout:
        """Positions, slots and mask of the tree for rows with committed ``lengths`` [b] (module docstring), over the
        first ``kv_len`` cache slots (default: as many as the longest row needs, read from the device; a CUDA graph's
        step gives the cache's capacity, ``runtime.graphs``)."""
        t, n = self.tables(lengths.device), self.size
        positions = lengths[:, None] + t["depths"]  # [b, N]
        slots = lengths[:, None] + t["nodes"]  # [b, N]
        kv_len = int(lengths.max()) + n if kv_len is None else kv_len
        rel = torch.arange(kv_len, device=lengths.device)[None, None, :] - lengths[:, None, None]  # [b, 1, kv]: key−L
        in_step = t["ancestors"][t["nodes"][None, :, None], rel.clamp(0, n - 1)] & (rel >= 0) & (rel < n)  # [b, N, kv]
        return StepLayout(positions, slots, (rel < 0) | in_step)

    def accept(self, tokens: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The deepest node whose path is all accepted (ties: the lowest index, so the main chain before alternates
        before lookup) and its depth, each [b]. ``expected`` [b, N]: the token node n must be for its path to go on
        (a verify: the target's token after its parent, greedy or sampled; a replay: the known output at its depth)."""
        t, n = self.tables(tokens.device), self.size
        ok = (tokens == expected) | (t["nodes"] == 0)  # [b, N]; x is always there
        on_path = ok[:, t["paths"]].all(-1)  # [b, N]: every node from x down to n accepted
        score = on_path * (t["depths"] * n + (n - 1 - t["nodes"]))
        best = score.argmax(-1)  # [b]
        return best, t["depths"][best]

    def verify(self, preds: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
        """Acceptance from the target's token after every node ``preds`` [b, N] (its argmax, or its sample from the
        noise of the position the node predicts: ``Topology.samples``). Returns ``samples``
        [b, K + 1] (the kept path's accepted tokens, then the target's bonus token at index ``acc``), ``acc`` [b],
        ``taken`` [b, K + 1] (the path's nodes: their taps, and where their K/V are) and ``best`` [b]."""
        t = self.tables(preds.device)
        best, acc = self.accept(tokens, preds[:, t["parents"]])
        taken = t["paths"][best]  # [b, K + 1]
        return preds.gather(1, taken), acc, taken, best


@dataclass(frozen=True)
class TreeShape:
    """The nodes of a tree verify with ``k`` drafts per chain: x, the main chain, each alternate (slot j, rank r) —
    a chain forking from the main chain at depth j − 1, at most ``alternate_len`` nodes long — ``lookup`` chains
    from x for prompt lookup's proposals (``lookup_chains``; True: one, False: none), and for every depth d in
    ``grafts`` another ``lookup`` chains forking from the main chain's node at depth d (k − d nodes each), proposed
    from the context extended by the drafts d_1..d_d (``graft_chains``; none without lookup chains)."""

    k: int
    alternates: tuple[tuple[int, int], ...] = ()
    lookup: int = 1
    alternate_len: int | None = None  # None: to depth k
    grafts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "lookup", int(self.lookup))
        object.__setattr__(self, "grafts", tuple(int(d) for d in self.grafts) if self.lookup else ())
        if self.lookup < 0:
            raise ValueError(f"lookup = {self.lookup}: the number of lookup chains cannot be negative")
        if len(set(self.grafts)) != len(self.grafts) or not all(1 <= d < self.k for d in self.grafts):
            raise ValueError(f"grafts = {self.grafts}: needs distinct main-chain depths d with 1 <= d < {self.k}")
        for slot, rank in self.alternates:
            if not (1 <= slot <= self.k and rank >= 2):
                raise ValueError(f"alternate (slot {slot}, rank {rank}): needs 1 <= slot <= {self.k} and rank >= 2")

    @classmethod
    def for_block(cls, k: int, datastore: bool = False) -> "TreeShape":
        """The decoder's tree for ``k`` drafts per chain: ``DEFAULT_ALTERNATES`` (those that fit),
        ``DEFAULT_LOOKUP_CHAINS`` lookup chains (``DATASTORE_LOOKUP_CHAINS`` where a datastore proposes too) and
        ``DEFAULT_GRAFTS`` (those that fit)."""
        fitting = tuple((slot, rank) for slot, rank in DEFAULT_ALTERNATES if slot <= k)
        return cls(k, fitting, lookup=DATASTORE_LOOKUP_CHAINS if datastore else DEFAULT_LOOKUP_CHAINS,
                   alternate_len=DEFAULT_ALTERNATE_LEN, grafts=tuple(d for d in DEFAULT_GRAFTS if d < k))

    @property
    def num_chains(self) -> int:
        """Rows of the lookup table ``tokens`` takes: the lookup chains from x, then each graft's."""
        return self.lookup * (1 + len(self.grafts))

    @property
    def top(self) -> int:
        """How many of the drafter's choices per slot the tree uses (1: its greedy block only)."""
        return max((r for _, r in self.alternates), default=1)

    @cached_property
    def nodes(self) -> list[tuple[int, int, tuple[str, int, int]]]:
        """(parent, depth, source) per node, parents first; source ("x" | "draft" | "lookup", slot, rank)."""
        nodes = [(-1, 0, ("x", 0, 0))]
        nodes += [(i - 1, i, ("draft", i, 1)) for i in range(1, self.k + 1)]  # main chain: node i at depth i
        cap = self.k if self.alternate_len is None else self.alternate_len
        for slot, rank in self.alternates:
            parent = slot - 1  # the main chain's node at depth slot − 1 (x for slot 1)
            for depth in range(slot, min(self.k, slot + cap - 1) + 1):
                nodes.append((parent, depth, ("draft", depth, rank if depth == slot else 1)))
                parent = len(nodes) - 1
        for chain in range(self.num_chains):  # a chain's source: ("lookup", its m-th token, chain)
            root = 0 if chain < self.lookup else self.grafts[chain // self.lookup - 1]  # main chain node = its depth
            parent = root
            for depth in range(root + 1, self.k + 1):
                nodes.append((parent, depth, ("lookup", depth - root, chain)))
                parent = len(nodes) - 1
        return nodes

    @property
    def size(self) -> int:
        return len(self.nodes)

    @cached_property
    def topology(self) -> Topology:
        return Topology(tuple(max(p, 0) for p, _, _ in self.nodes))

    @property
    def parents(self) -> list[int]:
        return list(self.topology.parents)

    @property
    def depths(self) -> list[int]:
        return self.topology.depths

    @property
    def paths(self) -> list[list[int]]:
        """Per node, the nodes from x down to it (index = depth), padded to k + 1 with the node itself."""
        return self.topology.paths

    @cached_property
    def columns(self) -> list[int]:
        """Each node's column in the candidate table ``[x, top-R drafts per slot (slot-major), lookup chains
        (chain-major)]``; a lookup node's source is ("lookup", m, chain): the chain's m-th token."""
        r, k = self.top, self.k
        out = []
        for _, _, (src, slot, rank) in self.nodes:
            if src == "x":
                out.append(0)
            else:
                out.append(1 + (slot - 1) * r + rank - 1 if src == "draft" else 1 + k * r + rank * k + slot - 1)
        return out

    @cached_property
    def from_lookup(self) -> list[bool]:
        return [src == "lookup" for _, _, (src, _, _) in self.nodes]

    def tokens(self, x: torch.Tensor, drafts: torch.Tensor, lookups: torch.Tensor | None) -> torch.Tensor:
        """Every node's token [b, N] from x [b], the drafter's choices [b, K, R] (or [b, K] when R = 1) and the
        lookup chains' tokens [b, C, K] (C = ``num_chains``, or [b, K] when C = 1; a grafted chain's from its first
        column; −1: none there, never matches; None: none at all)."""
        b = x.shape[0]
        table = [x[:, None], drafts.reshape(b, -1)]
        if self.lookup:
            table.append(lookups.reshape(b, -1) if lookups is not None
                         else torch.full((b, self.num_chains * self.k), -1, device=x.device))
        return torch.cat(table, dim=1)[:, self.tables(x.device)["columns"]]

    def tables(self, device) -> dict[str, torch.Tensor]:
        """The topology's index tables and the shape's own (``columns``, ``from_lookup``) on ``device``."""
        return _shape_tables(self, str(device))

    def layout(self, lengths: torch.Tensor, kv_len: int | None = None) -> StepLayout:
        return self.topology.layout(lengths, kv_len)

    def accept(self, tokens: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.topology.accept(tokens, expected)

    def verify(self, preds: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
        return self.topology.verify(preds, tokens)


def tree_for(k: int, lookup: bool = True, datastore: bool = False) -> TreeShape:
    """The decoder's and the serving loop's tree for ``k`` drafts per chain: ``TreeShape.for_block`` where prompt
    lookup is on (with the datastore's chain where one proposes), without lookup chains (nor grafts) where it is off."""
    shape = TreeShape.for_block(k, datastore and lookup)
    return shape if lookup else dataclasses.replace(shape, lookup=False)


def lookup_chains(shape: TreeShape, context, datastore: Datastore | None = None) -> list[list[int]]:
    """Proposals for ``shape``'s lookup chains from the tokens so far (prompt + output), best first, at most
    ``shape.lookup`` of them, each at most k tokens: prompt lookup's (``lookup.ngram_candidates``); with a
    ``datastore`` (``runtime.datastore``), prompt lookup's take half the chains (rounded up) and the datastore's the
    rest, each filling what the other leaves unused, and a proposal an earlier one starts with is skipped."""
    return _proposals(context, shape.k, shape.lookup, datastore) if shape.lookup else []


def graft_chains(shape: TreeShape, context, main: Sequence[int], datastore: Datastore | None = None,
                 own: Sequence[list[int]] = ()) -> list[list[int]]:
    """Proposals for ``shape``'s grafted chains, graft by graft (``shape.lookup`` entries each, [] where there are
    fewer proposals): ``lookup_chains``' rule on the context extended by the main chain's drafts ``main`` d_1..d_d,
    at most k − d tokens each, skipping one that a lookup chain from x (``own``: ``lookup_chains``' proposals)
    already holds after the same d drafts (the next proposal takes its place)."""
    out: list[list[int]] = []
    for d in shape.grafts:
        tails = [chain[d:] for chain in own if list(chain[:d]) == list(main[:d])]
        found = [cand for cand in _proposals(list(context) + list(main[:d]), shape.k - d, shape.lookup + len(tails),
                                             datastore) if not held(cand, tails)][: shape.lookup]
        out += found + [[] for _ in range(shape.lookup - len(found))]
    return out


def chain_table(shape: TreeShape, rows: Sequence[tuple[Sequence[list[int]], Sequence[list[int]]]]) -> torch.Tensor:
    """The lookup table ``TreeShape.tokens`` takes [b, C, K] from each row's (lookup chains, grafted chains); −1
    where a chain has no token (never matches)."""
    table = torch.full((len(rows), max(shape.num_chains, 1), shape.k), -1, dtype=torch.long)
    for j, (own, grafted) in enumerate(rows):
        chains = list(own[: shape.lookup]) + [[] for _ in range(shape.lookup - len(own[: shape.lookup]))]
        for c, cont in enumerate(chains + list(grafted)):
            if cont:
                table[j, c, : len(cont[: shape.k])] = torch.tensor(cont[: shape.k])
    return table


def _proposals(context, max_len: int, count: int, datastore: Datastore | None) -> list[list[int]]:
    own = ngram_candidates(context, max_len, count, LOOKUP_MAX_N, LOOKUP_MIN_N, LOOKUP_PER_N)
    if datastore is None:
        return own
    quota = (count + 1) // 2
    found = own[:quota]
    for cand in datastore.propose(context, max_len, count) + own[quota:]:
        if len(found) == count:
            break
        if not held(cand, found):
            found.append(cand)
    return found


@lru_cache(maxsize=32)
def _tables(topology: Topology, device: str) -> dict[str, torch.Tensor]:
    n, paths, depths = topology.size, topology.paths, topology.depths
    anc = [[m in paths[q][: depths[q] + 1] for m in range(n)] for q in range(n)]
    return {name: torch.tensor(v, device=device) for name, v in (
        ("nodes", list(range(n))), ("depths", depths), ("parents", list(topology.parents)), ("paths", paths),
        ("ancestors", anc),  # [N, N]: key node m is an ancestor of (or is) query node q
    )}


@lru_cache(maxsize=32)
def _shape_tables(shape: TreeShape, device: str) -> dict[str, torch.Tensor]:
    return {**_tables(shape.topology, device), "columns": torch.tensor(shape.columns, device=device),
            "from_lookup": torch.tensor(shape.from_lookup, device=device)}


def commit_path(cache, rows: torch.Tensor | None, lengths: torch.Tensor, taken: torch.Tensor,
                acc: torch.Tensor) -> None:
    """Move the accepted path's K/V (node slots L + taken) to where they are committed (L + 0 … L + acc), in every
    layer; a path that is the main chain (nodes 1..K at depths 1..K) is already there."""
    idx = torch.arange(taken.shape[1], device=taken.device)
    moved = ((taken != idx) & (idx <= acc[:, None])).any(-1)  # [b]
    moved_rows = moved.nonzero()[:, 0].tolist()
    if not moved_rows:
        return
    accepted, starts = acc.tolist(), lengths.tolist()  # one device read each, not one per row
    cache_rows = moved_rows if rows is None else rows[moved_rows].tolist()
    for j, r in zip(moved_rows, cache_rows):
        n, start = accepted[j] + 1, starts[j]
        src = start + taken[j, :n]
        cache.k[:, r, start: start + n] = cache.k[:, r, src]  # advanced indexing reads a copy first
        cache.v[:, r, start: start + n] = cache.v[:, r, src]
