"""Greedy token agreement of a quantized target with its unquantized reference: the accuracy check of ``quantize``.

Definitions, on a fixed prompt set P (each prompt p with its reference greedy continuation c_p, decoded by the
reference model through the runtime, block size 1, up to M new tokens, ending before a stop token):

  teacher-forced agreement   over every position i of every c_p, feed the same tokens p + c_p[:i] to both models and
                             compare their argmax next tokens:
                                 sum_p sum_i [argmax q(. | p, c_<i) == argmax r(. | p, c_<i)] / sum_p |c_p|
                             (both argmaxes come from one full-sequence forward per model, so the reference is
                             compared with itself under identical numerics; it measures per-step disagreement without
                             letting one early divergence decide all later positions)
  free-running prefix        the quantized model decodes greedily on its own; per prompt the length of the common
                             prefix of its tokens and c_p, as a fraction of |c_p| (mean over prompts), and how many
                             prompts reproduce c_p exactly

Prompts come from the *end* of the dataset (``eval_prompt_ids``) while calibration takes the first ``--calib-size``
prompts, so the two sets do not overlap for HumanEval (164 prompts) at the default sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from trtllm_dflash.errors import require
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder


@dataclass(frozen=True, slots=True)
class Reference:
    """The reference side of an agreement measurement, computed once and reused for every quantized model."""

    prompts: tuple[tuple[int, ...], ...]
    continuations: tuple[tuple[int, ...], ...]  # reference greedy tokens (without the stop token)
    argmax: tuple[torch.Tensor, ...]  # per prompt [|c_p|]: the reference's teacher-forced argmax
    stop_token_ids: tuple[int, ...]


def eval_prompt_ids(dataset: str, tokenizer_dir: Path, num_prompts: int) -> list[list[int]]:
    """Token ids of the last ``num_prompts`` prompts of ``dataset`` (humaneval | mtbench | JSONL), encoded as the
    runtime encodes them (chat template for chat prompts)."""
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer

    require(num_prompts >= 1, "num_prompts", num_prompts, "must be >= 1")
    tok = load_tokenizer(tokenizer_dir)
    return [encode_prompt(tok, p.text, p.chat) for p in load_prompts(dataset)[-num_prompts:]]


@torch.no_grad()
def teacher_forced_argmax(model: TargetModel, prompt: tuple[int, ...], continuation: tuple[int, ...]) -> torch.Tensor:
    """argmax next token [|c|] at each position of ``continuation`` given ``prompt`` + the continuation before it."""
    ids = torch.tensor([list(prompt) + list(continuation[:-1])], device=model.device)  # [1, |p| + |c| - 1]
    hidden, _ = model(ids, model.new_cache(1, ids.shape[1]))
    return model.logits(hidden[0, len(prompt) - 1:]).argmax(-1).cpu()  # [|c|]


def greedy(model: TargetModel, prompts, max_new_tokens: int, stop_token_ids: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Greedy continuations through the runtime (block size 1, batched), stop tokens excluded."""
    reqs = [Request(tuple(p), max_new_tokens, stop_token_ids=stop_token_ids) for p in prompts]
    return [tuple(r.token_ids) for r in SpeculativeDecoder(model, None, 1).generate(reqs)]


def reference(model: TargetModel, prompts, max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> Reference:
    require(max_new_tokens >= 1, "max_new_tokens", max_new_tokens, "must be >= 1")
    conts = greedy(model, prompts, max_new_tokens, stop_token_ids)
    require(all(conts), "prompts", [i for i, c in enumerate(conts) if not c],
            "the reference stops at once on these prompts: nothing to compare", "use other prompts")
    argmax = tuple(teacher_forced_argmax(model, tuple(p), c) for p, c in zip(prompts, conts))
    return Reference(tuple(tuple(p) for p in prompts), tuple(conts), argmax, tuple(stop_token_ids))


def agreement(model: TargetModel, ref: Reference, free_running: bool = True) -> dict:
    """Greedy token agreement of ``model`` with ``ref`` (module docstring): a JSON-able dict."""
    matches, positions = 0, 0
    per_prompt = []
    for p, c, r in zip(ref.prompts, ref.continuations, ref.argmax):
        same = int((teacher_forced_argmax(model, p, c) == r).sum())
        matches, positions = matches + same, positions + len(c)
        per_prompt.append(round(same / len(c), 4))
    out = {"teacher_forced": round(matches / positions, 4), "positions": positions,
           "num_prompts": len(ref.prompts), "teacher_forced_per_prompt": per_prompt}
    if free_running:
        max_new = max(len(c) for c in ref.continuations)
        prefixes = []
        for got, want in zip(greedy(model, ref.prompts, max_new, ref.stop_token_ids), ref.continuations):
            n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            prefixes.append(n / len(want))
        out |= {"free_running_prefix": round(sum(prefixes) / len(prefixes), 4),
                "free_running_identical": sum(x == 1.0 for x in prefixes)}
    return out
