"""The decoding mode: how many drafts a step verifies and where they come from, as one value.

A mode is a fixed block of B tokens (B − 1 drafts a step; B = 1 is plain autoregressive decoding) or ``auto`` (the
policy picks k ∈ [0, B_max − 1] per sequence and step, ``runtime.policy``), with its proposal sources besides the
drafter: prompt lookup (``ngram``, ``runtime.lookup``) and the tree verify (``tree``, ``runtime.tree``; its lookup
chains are prompt lookup's, so a tree implies ``ngram`` in the benchmarks' spelling). It is parsed once where a user
names it — the command line's ``--block-size`` / ``--max-block-size`` / ``--ngram`` / ``--tree``
(``commands.common.resolve_mode``, through ``from_flags``) or
a benchmark's compact spelling ``16``, ``16+ngram``, ``auto+tree`` (``parse``) — and handed on as it is
(``commands.common.make_decoder`` builds the decoder of a mode); ``label`` writes the compact spelling back, as the
benchmarks' JSON reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
NGRAM, TREE = "+ngram", "+tree"


@dataclass(frozen=True, slots=True)
class DecodeMode:
    block_size: int | str  # a fixed block (1: autoregressive) or "auto"
    ngram: bool = False  # also verify prompt-lookup continuations
    tree: bool = False  # verify the drafter's block, its runner-ups and the lookup chains as one tree
    max_block_size: int | None = None  # auto: the longest block (None: the drafter's trained block)

    def __post_init__(self) -> None:
        if self.block_size != AUTO and not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ValueError(f"block size {self.block_size!r}: must be 'auto' or an integer >= 1")
        if self.max_block_size is not None and self.block_size != AUTO:
            raise ValueError(f"max block size {self.max_block_size!r}: only with 'auto'")
        if (self.ngram or self.tree) and self.block_size == 1:
            raise ValueError("prompt lookup and the tree need drafts: a block size >= 2 or 'auto'")

    @property
    def auto(self) -> bool:
        return self.block_size == AUTO

    @property
    def autoregressive(self) -> bool:
        return self.block_size == 1

    @property
    def label(self) -> int | str:
        """The compact spelling: ``16``, ``16+ngram``, ``16+tree``, ``auto``, ``auto+ngram``, ``auto+tree``."""
        suffix = TREE if self.tree else NGRAM if self.ngram else ""
        return f"{self.block_size}{suffix}" if suffix or self.auto else self.block_size

    @classmethod
    def parse(cls, text: str, max_block_size: int | None = None, min_block: int = 1) -> "DecodeMode":
        """A mode from its compact spelling (``label``'s); ValueError naming what is wrong otherwise."""
        text = str(text).strip()
        tree, ngram = text.endswith(TREE), text.endswith(NGRAM)
        base = text.removesuffix(TREE).removesuffix(NGRAM)
        if base == AUTO:
            return cls(AUTO, ngram=ngram or tree, tree=tree, max_block_size=max_block_size)
        if not base.isdigit() or int(base) < min_block:
            raise ValueError(f"{text!r}: must be 'auto' or an integer >= {min_block}, optionally with '+ngram' or "
                             "'+tree'")
        return cls(int(base), ngram=ngram or tree, tree=tree)

    @classmethod
    def from_flags(cls, block_size: int | str, ngram: bool = False, tree: bool = False,
                   max_block_size: int | None = None) -> "DecodeMode":
        """A mode from the command line's separate flags (already resolved: ``commands.common.resolve_ngram``)."""
        return cls(block_size, ngram=bool(ngram), tree=bool(tree),
                   max_block_size=max_block_size if block_size == AUTO else None)

    def decoder_options(self) -> dict:
        """The mode as ``SpeculativeDecoder``'s keyword arguments (``commands.common.make_decoder`` also turns a tree
        into the ``TreeShape`` of its longest block and adds the prior and the datastore)."""
        return {"block_size": self.block_size, "max_block_size": self.max_block_size, "ngram": self.ngram,
                "tree": self.tree}
