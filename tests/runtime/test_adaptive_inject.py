"""Lazy KV injection under ``--block-size auto``: k = 0 steps leave the drafter alone, and every draft still sees the
K/V of its whole committed context (compared against a drafter that receives that context in one piece)."""

import asyncio

import torch

from conftest import greedy_reference
from test_adaptive import cpu_like, prompts_for
from trtllm_dflash.models.drafter import draft_block
from trtllm_dflash.runtime.policy import AdaptivePolicy
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.local import LocalSteps
from trtllm_dflash.runtime.stepper import run_generation
from trtllm_dflash.runtime.protocol import GenerateRequest
from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier


class ScriptedPolicy(AdaptivePolicy):
    """Row i drafts ``k`` tokens on the steps where (step + i) % period == 0, else verifies k = 0: long stretches of
    taps pile up between drafts, different per row."""

    def __init__(self, max_block_size, k=3, period=3):
        super().__init__(cpu_like(), max_block_size)
        self.k, self.period, self.step = k, period, 0

    def decide(self, states, ngram_lens=None):
        ks = []
        for i, s in enumerate(states):
            draft = (self.step + i) % self.period == 0
            s.source, s.probing = ("drafter" if draft else None), False
            ks.append(self.k if draft else 0)
        self.step += 1
        return ks


def fresh_drafts(target, drafter, committed, bonus, num_drafts):
    """The drafts of a drafter whose context cache got the taps of all ``committed`` tokens in one injection."""
    size = len(committed) + num_drafts + 2
    tcache, dcache = target.new_cache(1, size), drafter.new_cache(1, size)
    with torch.inference_mode():
        _, taps = target(torch.tensor([committed]), tcache, tap_layers=drafter.spec.target_layer_ids)
        drafter.inject(taps, torch.tensor([len(committed)]), dcache)
        return draft_block(torch.tensor([bonus]), num_drafts + 1, drafter.spec.mask_token_id, target.embed,
                           lambda e: drafter.draft(e, dcache, None),
                           lambda h: target.logits(h.to(target.dtype)))[0].tolist()


class RecordingDecoder(SpeculativeDecoder):
    def __init__(self, *a, **kw):
        super().__init__(*a, proposer=self.recorded, **kw)
        self.calls = []  # (cache rows, committed lengths, bonus tokens, drafts)

    def recorded(self, propose, bonus, dcache, rows, committed, num_drafts=None):
        drafts = propose(bonus, dcache, rows, committed, num_drafts)
        lengths = dcache.lengths if rows is None else dcache.lengths[rows]
        assert lengths.tolist() == committed.tolist(), "a drafting row's context is the whole committed sequence"
        rows = list(range(len(bonus))) if rows is None else rows.tolist()
        self.calls.append((rows, committed.tolist(), bonus.tolist(), drafts.tolist()))
        return drafts


def test_lazy_injection_drafts_with_the_whole_context(tiny_models, one_thread):
    target, drafter = tiny_models["llama"]
    prompts = prompts_for(11, lengths=(4, 13, 7))
    dec = RecordingDecoder(target, drafter, "auto", policy=ScriptedPolicy(drafter.spec.block_size))
    out = dec.generate([Request(tuple(p), n) for p, n in zip(prompts, (24, 18, 30))])
    assert [r.token_ids for r in out] == [tuple(r[:n]) for r, n in
                                          zip(greedy_reference(target, prompts, 30), (24, 18, 30))]
    assert len(dec.calls) >= 6 and any(len(rows) < 3 for rows, *_ in dec.calls), "some steps draft only some rows"
    checked = 0
    for rows, committed, bonus, drafts in dec.calls:
        for row, length, b, d in zip(rows, committed, bonus, drafts):
            tokens = list(prompts[row]) + list(out[row].token_ids)
            assert tokens[length] == b
            assert d == fresh_drafts(target, drafter, tokens[:length], b, len(d)), (row, length)
            checked += 1
    assert checked >= 10


class CheckingSteps(LocalSteps):
    """Records each draft call's drafter context length after the append, next to the target's committed length."""

    def __init__(self, *a):
        super().__init__(*a)
        self.lengths, self.injected = [], []

    async def inject(self, taps, start):
        self.injected.append((start, taps.shape[0]))
        return await super().inject(taps, start)

    async def draft(self, seq_id, k, v, bonus, block_size):
        drafts = await super().draft(seq_id, k, v, bonus, block_size)
        self.lengths.append((int(self.drafter.cache.lengths[self.drafter.slots.rows[seq_id]]),
                             int(self.verifier.cache.lengths[self.verifier.slots.rows[seq_id]])))
        return drafts


def test_serving_loop_injects_only_when_drafting_and_never_loses_context(tiny_dirs, tiny_models):
    target, drafter = tiny_models["qwen3"]
    prompt = [9, 8, 7, 6, 5, 4]
    ref = list(greedy_reference(target, [prompt], 30)[0])
    steps = CheckingSteps(TargetVerifier(target, drafter.spec.target_layer_ids, 2, 256, 16), KVInjector(drafter),
                          BlockDrafter(drafter, TargetHead(tiny_dirs["qwen3"][0], torch.float64), 2, 256))
    updates = []

    async def on_update(u):
        updates.append(u)

    policy = ScriptedPolicy(16, k=2, period=4)
    req = GenerateRequest(tuple(prompt), 30, SamplingParams(), (), True)
    assert asyncio.run(run_generation(steps, req, "auto", 5, on_update, policy=policy)) == "length"
    assert updates[-1].tokens == ref
    ks = [k for u in updates for k in u.draft_lengths]
    assert ks.count(0) > 2 * ks.count(2) > 0
    assert len(steps.injected) == ks.count(2), "one kv_inject per draft, none on k = 0 steps"
    assert all(ctx == committed for ctx, committed in steps.lengths), steps.lengths
    starts = [s for s, _ in steps.injected]  # consecutive runs: each injection starts where the last one ended
    assert starts[0] == 0 and all(s + n == nxt for (s, n), nxt in zip(steps.injected, starts[1:]))


def test_batched_injection_of_a_padded_row_near_the_rotary_limit(tiny_models):
    """Coalesced kv_inject: a row with one pending token near the end of the rotary table, padded to a row with many
    (a sequence that verified prompt lookup for a while), gets the same K/V as injected alone; no index error."""
    _, drafter = tiny_models["qwen3"]
    inj = KVInjector(drafter)
    limit = drafter.rotary.max_positions
    taps = torch.randn(2, 40, drafter.fc.in_features)
    k, v = inj.rows(taps, torch.tensor([limit - 1, 0]))
    k1, v1 = inj(taps[0, :1], limit - 1)
    torch.testing.assert_close(k[0, :, :1], k1)
    torch.testing.assert_close(v[0, :, :1], v1)
