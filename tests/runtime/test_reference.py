"""The one loop (``runtime.stepper`` through ``SpeculativeDecoder``: batched, lazily injected, its step engines' fast
paths) against the plainest fixed-block DFlash loop (``runtime.reference``): the same tokens and the same acceptance
length at every step, on ragged batches whose rows finish apart."""

import pytest
import torch

from conftest import make_tiny_pair
from test_decoder import prompts_for
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.reference import reference_generate


def oracle(truth: list[int], emitted: int, real: list[int]) -> list[int]:
    """Drafts after ``emitted`` tokens: the known continuation ``truth``, every third position the drafter's own
    (mostly wrong): a function of the position alone, so that both loops see the same drafts."""
    return [truth[emitted + k] if emitted + k < len(truth) and (emitted + k) % 3 != 2 else real[k]
            for k in range(len(real))]


class OracleDrafts(SpeculativeDecoder):
    def __init__(self, *a, prompts, truths, **kw):
        super().__init__(*a, proposer=self.drafts, **kw)
        self.prompts, self.truths = prompts, truths

    def drafts(self, propose, bonus, dcache, rows, committed, num_drafts=None, top=1):
        real = propose(bonus, dcache, rows, committed, num_drafts, top)
        out = real.clone()
        for j, row in enumerate(rows.tolist()):  # row r of the caches is request r
            emitted = int(committed[j]) - len(self.prompts[row]) + 1
            out[j] = torch.tensor(oracle(self.truths[row], emitted, real[j].tolist()))
        return out


@pytest.mark.parametrize("family,block_size", [("llama", 1), ("llama", 4), ("qwen3", 8), ("qwen3", 16)])
def test_the_loop_steps_as_the_reference_loop(tmp_path_factory, family, block_size):
    tdir, ddir = make_tiny_pair(tmp_path_factory.mktemp(f"ref-{family}"), family, seed=3)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)  # no near-ties between batched and single products
    prompts = prompts_for(5, lengths=(7, 19, 4))
    lengths, stop = (40, 13, 29), (11,)
    truths = [reference_generate(target, None, p, n, 1)[0] for p, n in zip(prompts, lengths)]
    reqs = [Request(tuple(p), n, stop_token_ids=stop) for p, n in zip(prompts, lengths)]
    for dec, drafts in ((SpeculativeDecoder(target, drafter if block_size > 1 else None, block_size), None),
                        (OracleDrafts(target, drafter, block_size, prompts=prompts, truths=truths), oracle)
                        if block_size > 1 else (None, None)):
        if dec is None:
            continue
        out = dec.generate(reqs)
        for p, n, truth, r in zip(prompts, lengths, truths, out):
            propose = None if drafts is None else (lambda tokens, real, truth=truth: drafts(truth, len(tokens), real))
            tokens, taus = reference_generate(target, drafter, p, n, block_size, stop, propose)
            assert list(r.token_ids) == tokens
            assert list(r.acceptance_lengths) == taus
        if drafts is not None:
            assert max(t for r in out for t in r.acceptance_lengths) > 2, "long accepted runs"


@pytest.mark.slow
def test_the_loop_steps_as_the_reference_loop_on_the_real_model(smollm2):
    """SmolLM2 and its shipped drafter, float32, on a code prompt: tokens and every step's τ."""
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    target, drafter = load_pair(smollm2["target"], smollm2["drafter"])
    tok = load_tokenizer(smollm2["target"])
    stops = tuple(stop_token_ids(tok, target.spec.eos_token_ids))
    prompt = encode_prompt(tok, "Write a Python function that returns the n-th Fibonacci number.", chat=True)
    r = SpeculativeDecoder(target, drafter, 16).generate([Request(tuple(prompt), 64, stop_token_ids=stops)])[0]
    tokens, taus = reference_generate(target, drafter, prompt, 64, 16, stops)
    assert list(r.token_ids) == tokens and list(r.acceptance_lengths) == taus
    assert r.mean_acceptance_length > 1.5
