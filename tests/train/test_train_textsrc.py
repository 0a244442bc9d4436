"""The teacher-forced text source (train/textsrc.py): its top-k rows equal the target's own predictions, its labels
are the target's greedy next tokens after each real prefix, and the objective trains on those labels."""

from __future__ import annotations

import torch

from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.train.data import Sample
from trtllm_dflash.train.objective import collate, dflash_loss, drafter_blocks
from trtllm_dflash.train.regen import read_regen_shard, write_regen_shard
from trtllm_dflash.train.textsrc import _dedent, target_labels, teacher_forced
from tests.conftest import make_tiny_pair


def test_teacher_forced_rows_are_the_targets_predictions_and_survive_a_shard(tmp_path):
    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=2, block_size=4)
    target, _ = load_pair(tdir, ddir, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 256, (12,), generator=g).tolist(), 4), (torch.randint(0, 256, (7,), generator=g).tolist(), 3)]
    got = teacher_forced(target, seqs, top_k=5)
    for (ids, p), r in zip(seqs, got):
        with torch.no_grad():
            hidden, _ = target(torch.tensor([ids]), target.new_cache(1, len(ids)))
            want = target.logits(hidden[0]).float().topk(5, dim=-1)
        assert r.ids.tolist() == ids and r.prompt_len == p
        assert torch.equal(r.topk_ids[p - 1 : len(ids) - 1].long(), want.indices[p - 1 : len(ids) - 1])
        assert not r.topk_ids[: p - 1].any() and not r.topk_ids[len(ids) - 1 :].any()  # rows outside: zero
    write_regen_shard(tmp_path / "s.safetensors", got)
    back = read_regen_shard(tmp_path / "s.safetensors")
    assert [b.ids.tolist() for b in back] == [ids for ids, _ in seqs]
    assert torch.equal(back[0].topk_ids, got[0].topk_ids)


def test_target_labels_train_the_drafter_on_the_targets_greedy_tokens(tmp_path):
    """Labels at position j are top-1 of row j − 1; the loss with them equals the loss on a sequence whose response
    *is* those tokens, holding the drafter's inputs fixed (so only the labels changed)."""
    tdir, ddir = make_tiny_pair(tmp_path, "qwen3", seed=4, block_size=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    ids = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden, taps = target(ids[None], target.new_cache(1, 14), tap_layers=drafter.spec.target_layer_ids)
        top = target.logits(hidden)[0].topk(4, dim=-1)
    s = target_labels(Sample(ids, taps[0], 3, top.indices.int(), top.values))
    greedy = top.indices[:, 0]
    assert torch.equal(s.labels[:3], ids[:3]) and torch.equal(s.labels[3:], greedy[2:13])
    assert torch.equal(s.ids, ids)  # inputs untouched
    anchors = [torch.tensor([3, 6, 9])]
    batch = collate([s], anchors, "cpu", dtype=torch.float64)
    m = dflash_loss(drafter, target.embed, target.lm_head, batch, 2.0)
    with torch.no_grad():
        logits = target.lm_head(drafter_blocks(drafter, target.embed, batch)[:, 1:]).double()  # [3, B − 1, V]
    pos = torch.tensor([3, 6, 9])[:, None] + torch.arange(1, 4)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), s.labels[pos].flatten(), reduction="none").view(3, 3)
    w = torch.exp(-(torch.arange(1, 4, dtype=torch.float64) - 1) / 2.0).expand(3, 3)
    assert abs(float(m.loss) - float((ce * w).sum() / w.sum())) < 1e-6  # the loss reduces in float32
    plain = dflash_loss(drafter, target.embed, target.lm_head, collate([Sample(ids, taps[0], 3)], anchors, "cpu",
                                                                          dtype=torch.float64), 2.0)
    assert (float(plain.loss) != float(m.loss)) == bool((s.labels != ids).any())


def test_dedent_keeps_relative_indentation():
    src = "    def f(x):\n        if x:\n            return 1\n"
    assert _dedent(src) == "def f(x):\n    if x:\n        return 1\n"
