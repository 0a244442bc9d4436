"""What the ``auto`` policy chose and where a run's time went, for JSON results and Triton metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class Telemetry:
    """Where the time went and what was chosen, over a run (JSON results and Triton metrics)."""

    k_counts: dict[int, int] = field(default_factory=dict)  # chosen k -> rows·steps
    steps: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: steps whose draft j+1 was accepted
    ngram_steps: int = 0  # rows·steps that verified a prompt-lookup continuation
    ngram_accepted: int = 0  # tokens accepted from those
    tree_steps: int = 0  # steps that verified the tree (policy.tree_nodes > 0)

    def record(self, ks: Sequence[int], accepted: Sequence[int]) -> None:
        for k, a in zip(ks, accepted):
            self.k_counts[k] = self.k_counts.get(k, 0) + 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += a
            if a > len(self.accepted_per_pos):
                self.accepted_per_pos += [0] * (a - len(self.accepted_per_pos))
            for j in range(a):
                self.accepted_per_pos[j] += 1

    def to_json(self) -> dict:
        total = self.draft_s + self.verify_s + self.overhead_s
        return {
            "k_distribution": {str(k): n for k, n in sorted(self.k_counts.items())},
            "steps": self.steps,
            "time_split": {"draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
                           "overhead_s": round(self.overhead_s, 4),
                           "draft_fraction": round(self.draft_s / total, 4) if total else 0.0},
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": self.accepted_per_pos,
            "ngram_steps": self.ngram_steps,
            "ngram_accepted_tokens": self.ngram_accepted,
            "tree_steps": self.tree_steps,
        }
