"""Ragged batches for the drafting kernels: flat tokens plus cumulative offsets (vLLM ``SpecDecodeMetadata`` style).

Sequence ``i`` owns flat tokens ``[cu_seqlens[i], cu_seqlens[i+1])``; an empty sequence has two equal offsets. Worked
example, lengths [2, 0, 3]:

    cu_seqlens    = [0, 2, 2, 5]
    token_seq_ids = [0, 0, 2, 2, 2]      (token t belongs to the last i with cu_seqlens[i] <= t, skipping empties)
    token_offsets = [0, 1, 0, 1, 2]      (t - cu_seqlens[seq])

Everything here is device-side (no host sync) except ``max_seqlen``, a host int the kernel grids are sized with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RaggedBatch:
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32, non-decreasing, cu_seqlens[0] == 0
    max_seqlen: int  # host-side upper bound on any sequence's length (grid sizing only)

    @classmethod
    def from_lengths(cls, lengths: list[int] | torch.Tensor, device=None) -> "RaggedBatch":
        """lengths: [num_seqs] tokens per sequence (0 allowed)."""
        lengths = torch.as_tensor(lengths, dtype=torch.int32, device=device)  # [num_seqs]
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)  # [num_seqs + 1]
        cu[1:] = torch.cumsum(lengths, 0)
        return cls(cu, int(lengths.max()) if lengths.numel() else 0)

    @classmethod
    def make_dummy(cls, seqlens: list[int], device="cpu") -> "RaggedBatch":
        """Test builder: ``make_dummy([2, 0, 3])`` is the worked example of the module docstring."""
        return cls.from_lengths(list(seqlens), device=device)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def lengths(self) -> torch.Tensor:  # [num_seqs] int32
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def token_seq_ids(self, num_tokens: int) -> torch.Tensor:  # [num_tokens] int64
        """Owning sequence of each flat token; ``num_tokens`` is passed in so no host sync is needed."""
        t = torch.arange(num_tokens, device=self.cu_seqlens.device, dtype=torch.int32)
        return torch.searchsorted(self.cu_seqlens[1:].contiguous(), t, right=True).long()

    def token_offsets(self, num_tokens: int) -> torch.Tensor:  # [num_tokens] int64: index within its sequence
        seq = self.token_seq_ids(num_tokens)
        t = torch.arange(num_tokens, device=self.cu_seqlens.device)
        return t - self.cu_seqlens.long()[seq]
