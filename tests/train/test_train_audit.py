"""Consistency audit on the real pair (SmolLM2 target + shipped drafter): a training sample and an inference draft
step see the same chat template, taps, mask token, LM head and final norm (train/audit.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trtllm_dflash.assets import MASK_TOKEN_ID, SHIPPED_DRAFTER

pytestmark = pytest.mark.skipif(not (SHIPPED_DRAFTER / "model.safetensors").is_file(), reason="no shipped drafter")


def test_shipped_training_config_matches_the_inference_spec():
    """Mask token, taps and block size recorded at training time are the ones the exported drafter declares."""
    from trtllm_dflash.specs import DrafterSpec

    spec = DrafterSpec.load(SHIPPED_DRAFTER)
    cfg = json.loads((SHIPPED_DRAFTER / "training_config.json").read_text())
    assert cfg["mask_token_id"] == spec.mask_token_id == MASK_TOKEN_ID
    assert tuple(cfg["target_layer_ids"]) == tuple(spec.target_layer_ids)
    assert cfg["block_size"] == spec.block_size and cfg["num_layers"] == len(spec.layer_types)
    from trtllm_dflash.datasets import read_jsonl

    rows = read_jsonl(SHIPPED_DRAFTER / "training_prompts.jsonl.gz")
    assert rows and all(r["chat"] is True for r in rows)  # trained on chat-templated prompts, as evaluation runs


@pytest.mark.slow
def test_training_sample_and_inference_step_agree(smollm2, one_thread):
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids
    from trtllm_dflash.train.audit import audit_prompt, summarize
    from trtllm_dflash.train.data import generate_with_taps

    target, drafter = load_pair(smollm2["target"], smollm2["drafter"])
    tok = load_tokenizer(smollm2["target"])
    stops = stop_token_ids(tok, target.spec.eos_token_ids)

    # Chat template: the pipeline's encoding is the tokenizer's own template with the assistant header open.
    p = load_prompts("mtbench", 1)[0]
    ids = encode_prompt(tok, p.text, True)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n") and p.text in text

    # LM head: the head the decoder drafts and verifies through is the target's, tied to its embedding.
    assert target.spec.tie_word_embeddings and target.lm_head.weight is target.model.embed_tokens.weight
    h = torch.randn(3, target.spec.hidden_size)
    torch.testing.assert_close(target.logits(h), h @ target.model.embed_tokens.weight.T)

    # Taps: row i of a training shard is the target's tap of token i (teacher-forced forward of the whole sequence),
    # not token i ± 1; only the last row, never fed, is zero.
    sample = generate_with_taps(target, [ids], 24, stops, drafter.spec.target_layer_ids)[0]
    with torch.no_grad():
        _, ref = target(sample.ids[None, :-1], target.new_cache(1, len(sample.ids)), tap_layers=drafter.spec.target_layer_ids)
    torch.testing.assert_close(sample.taps[:-1].float(), ref[0].to(torch.bfloat16).float(), rtol=0.02, atol=0.5)
    assert not sample.taps[-1].any()
    shifted = (sample.taps[1:-1].float() - ref[0, :-1].float()).abs().mean()
    assert shifted > 10 * (sample.taps[:-1].float() - ref[0].float()).abs().mean()  # off by one would be visible

    # Mask token, LM head, norm, block mask together: the training path's block at every inference anchor proposes
    # the drafts the decoder proposed there, on a code and a chat prompt.
    audits = []
    for q in load_prompts("humaneval", 1) + load_prompts("mtbench", 1):
        a = audit_prompt(target, drafter, q.id, encode_prompt(tok, q.text, q.chat), 32, stops, all_anchors=True)
        assert a.lossless, q.id
        assert a.slots_compared > 100 and a.slots_agree >= 0.99 * a.slots_compared, (q.id, a.slots_agree, a.slots_compared)
        # the last step may be cut by the response's end, where the training path has no labels
        assert a.train_taus_at_inference_anchors[:-1] == a.inference_taus[:-1], q.id
        audits.append(a)
    s = summarize(audits)
    assert s["lossless"] and 0.0 < s["position1_accuracy"] <= 1.0
    # the two readings of acceptance tell roughly the same story (the all-anchor mean vs the decoder's own steps):
    # only roughly, since the all-anchor mean also counts the anchors inside long accepted runs that the decoder jumps
    # over, so it runs ahead when acceptance is uneven (an earlier drafter on these two prompts: 2.27 vs 1.62; the
    # exact check is the one above, at the decoder's own anchors)
    ratio = s["expected_tau_all_anchors"] / s["inference_tau"]
    assert s["inference_tau"] >= 1.0 and 0.8 < ratio < 1.6, s


def test_prompt_lookup_replay_by_hand():
    from trtllm_dflash.train.audit import prompt_lookup_taus

    # prompt 1 2 3 4, output 1 2 3 4 5: after the prefill's "1", the 1-gram "1" recurs at 0 -> draft 2 3 4, all
    # accepted (+ bonus 5): one step of 4
    assert prompt_lookup_taus([1, 2, 3, 4, 1, 2, 3, 4, 5], 4, 4) == [4]
    # the longest n-gram wins: "1 2" recurs at 0 (followed by 3 4), the 1-gram "2" more recently at 4 (followed by
    # 5 1); the 2-gram's draft 3 4 gets 3 accepted, then the bonus 9 ends the output: one step of 2
    assert prompt_lookup_taus([1, 2, 3, 4, 2, 5, 1, 2, 3, 9], 7, 3) == [2]
    assert prompt_lookup_taus([7, 8, 9, 10], 2, 16) == [1]  # nothing recurs: no draft, τ = 1 per step


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 8])
def test_replay_equals_decoding_with_and_without_prompt_lookup(smollm2, one_thread, block_size):
    """On the real pair, ``replay_taus`` reproduces the decoder's steps at the drafter's block size and at a smaller
    one (whose non-causal block differs from a truncated 16-token one), plain and in ``ngram`` mode (prompt lookup's
    continuation of a recurring 2- or 3-gram instead of the drafter's block), and the tree verify's steps
    (runtime.tree: the drafter's block, its alternates and prompt lookup's proposals in one step), also with the
    shipped retrieval datastore's proposals (runtime.datastore; at block 16 only: the same code at a smaller k); every
    walk is lossless. 32 tokens: enough for prompt lookup to find a recurring n-gram, short enough for the tree's
    decoding on 2 cores."""
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.runtime.datastore import Datastore
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids
    from trtllm_dflash.train.audit import output_taus, replay_taus

    target, drafter = load_pair(smollm2["target"], smollm2["drafter"])
    tok = load_tokenizer(smollm2["target"])
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    reqs = [Request(tuple(encode_prompt(tok, q.text, q.chat)), 32, stop_token_ids=stops)
            for q in load_prompts("humaneval", 2)[1:] + load_prompts("mtbench", 1)]
    greedy = SpeculativeDecoder(target, None, 1).generate(reqs)
    plain = SpeculativeDecoder(target, drafter, block_size).generate(reqs)
    looked = SpeculativeDecoder(target, drafter, block_size, ngram=True).generate(reqs)
    both = SpeculativeDecoder(target, drafter, block_size, tree=True).generate(reqs)  # runtime.tree
    store = Datastore.load(Path(smollm2["drafter"]) / "datastore.dflash")  # the shipped retrieval datastore
    stored = SpeculativeDecoder(target, drafter, block_size, tree=True, datastore=store).generate(reqs) \
        if block_size == 16 else [None] * len(reqs)
    assert sum(r.lookup_steps for r in looked) > 0  # the code prompt repeats itself within 32 tokens
    for req, ref, a, b, c, d in zip(reqs, greedy, plain, looked, both, stored):
        assert a.token_ids == ref.token_ids == b.token_ids == c.token_ids == (d or ref).token_ids
        ids = list(req.prompt_ids) + list(ref.token_ids)
        taus, ngram_taus, tree_taus, *stored_taus = replay_taus(target, drafter, ids, len(req.prompt_ids),
                                                                ngram=True, block_size=block_size, tree=True,
                                                                datastore=store if d else None)
        if d is not None:  # with the datastore's chain
            assert stored_taus == [output_taus(d.acceptance_lengths, len(d.token_ids))]
        assert taus == output_taus(a.acceptance_lengths, len(a.token_ids))
        assert ngram_taus == output_taus(b.acceptance_lengths, len(b.token_ids))
        assert max(taus) <= block_size and max(ngram_taus) <= block_size and max(tree_taus) <= block_size
        # every walk covers the same output; the tree's first step gets at least the longer of the two proposals
        assert tree_taus == output_taus(c.acceptance_lengths, len(c.token_ids))  # the tree decoder's own steps
        assert sum(tree_taus) == sum(ngram_taus) == sum(taus)
        assert tree_taus[0] >= max(taus[0], ngram_taus[0])


def test_output_taus_drop_what_the_verify_accepted_past_the_end():
    from trtllm_dflash.train.audit import output_taus, walk

    # 9 new tokens: the prefill's, then steps of 3 and 4 reach token 8; the last step accepted 5 drafts past it
    assert output_taus([3, 4, 6], 9) == [3, 4, 2]
    assert output_taus([3, 4, 2, 1], 9) == [3, 4, 2]  # a last step that only emitted the stop token: not counted
    assert output_taus([5], 1) == [] and output_taus([], 4) == []
    # the same walk as the replay's over a known output of prompt 2 + 9 tokens
    assert walk([2, 9, 9, 3, 9, 9, 9, 9, 9, 9], 2, 11) == output_taus([3, 4, 6], 9)
