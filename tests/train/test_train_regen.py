"""Regenerated-response dataset (train/regen.py): same tokens as the reference generator, top-k logits that are the
target's own, taps from the teacher-forced pass equal to the decode-time taps, resumable and deterministic shards."""

from __future__ import annotations

import torch

from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.train.data import generate_with_taps, read_shard
from trtllm_dflash.train.regen import build_regen, iter_regen, read_regen_shard, regenerate, tap_shards
from tests.conftest import make_tiny_pair


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_regenerate_matches_the_reference_generator_and_keeps_topk(tmp_path, one_thread):
    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=1, block_size=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    prompts = _prompts(5)
    stops = (7, 9)
    got = regenerate(target, prompts, 12, stops, top_k=4, check_every=3)
    ref = generate_with_taps(target, prompts, 12, stops, drafter.spec.target_layer_ids)
    for g, r, p in zip(got, ref, prompts):
        assert g.ids.tolist() == r.ids.tolist() and g.prompt_len == len(p)
        s = len(g.ids)
        # row j holds the prediction of token j + 1: its top-1 is the greedy next token, logits sorted descending
        assert g.topk_ids[g.prompt_len - 1 : s - 1, 0].tolist() == g.ids[g.prompt_len :].tolist()
        assert bool((g.topk_logits[g.prompt_len - 1 : s - 1].float().diff(dim=1) <= 0).all())
        assert not g.topk_ids[: g.prompt_len - 1].any() and not g.topk_ids[s - 1].any()
        with torch.no_grad():
            logits = target.logits(target(g.ids[None], target.new_cache(1, s))[0])[0]  # [S, V]
        want = logits[g.prompt_len - 1 : s - 1].topk(4, dim=-1).values.to(torch.bfloat16)
        torch.testing.assert_close(g.topk_logits[g.prompt_len - 1 : s - 1], want, rtol=1e-2, atol=1e-2)
    # stepping only unfinished rows (compact=1: as soon as one finishes) changes nothing
    early = (int(got[0].ids[got[0].prompt_len + 2]),)  # a stop token row 0 meets after 3 tokens
    full, part = (regenerate(target, prompts, 12, early, top_k=4, check_every=1, compact=c) for c in (0.0, 1.0))
    assert len({len(g.ids) - g.prompt_len for g in full}) > 1, "some rows must finish early for this check"
    for f, p_ in zip(full, part):
        assert torch.equal(f.ids, p_.ids) and torch.equal(f.topk_ids, p_.topk_ids)


def test_shards_resume_stream_and_retap(tmp_path, one_thread):
    tdir, ddir = make_tiny_pair(tmp_path, "qwen3", seed=2, block_size=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    prompts = _prompts(7, seed=1)
    kw = dict(max_new_tokens=10, stop_token_ids=(7,), batch_size=3, top_k=4, seed=5)
    paths = build_regen(target, prompts, tmp_path / "a", **kw)
    assert len(paths) == 3 and all(p.is_file() for p in paths)
    first = paths[0].read_bytes()
    paths[1].unlink()  # a killed run: shard 1 missing
    again = build_regen(target, prompts, tmp_path / "a", **kw)
    assert again == paths and paths[1].is_file() and paths[0].read_bytes() == first
    fresh = build_regen(target, prompts, tmp_path / "b", **kw)  # deterministic: same bytes in a new directory
    assert [p.read_bytes() for p in fresh] == [p.read_bytes() for p in paths]
    streamed = list(iter_regen(tmp_path / "a"))
    assert sorted(s.ids.tolist() for s in streamed) == sorted(
        r.ids.tolist() for r in regenerate(target, prompts, 10, (7,), top_k=4))
    try:
        build_regen(target, prompts, tmp_path / "a", **(kw | {"top_k": 2}))
        raise AssertionError("settings mismatch must be refused")
    except ValueError as exc:
        assert "other settings" in str(exc)

    shards = tap_shards(target, paths, tmp_path / "taps", drafter.spec.target_layer_ids, batch_size=2)
    for src, dst in zip(paths, shards):
        for r, s in zip(read_regen_shard(src), read_shard(dst)):
            ref = generate_with_taps(target, [r.ids[: r.prompt_len].tolist()], 10, (7,), drafter.spec.target_layer_ids)[0]
            assert s.ids.tolist() == r.ids.tolist() == ref.ids.tolist()
            torch.testing.assert_close(s.taps.float(), ref.taps.float(), rtol=1e-2, atol=1e-2)


def test_online_taps_equal_the_cached_ones(tmp_path, one_thread):
    from trtllm_dflash.train.regen import samples_without_taps, with_taps

    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=3, block_size=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    paths = build_regen(target, _prompts(5, seed=2), tmp_path / "r", max_new_tokens=8, stop_token_ids=(7,),
                        batch_size=5, top_k=3)
    cached = [s for p in tap_shards(target, paths, tmp_path / "t", drafter.spec.target_layer_ids) for s in read_shard(p)]
    bare = samples_without_taps(paths)
    assert all(s.taps is None and s.topk_ids is not None for s in bare)
    online = with_taps(target, bare, drafter.spec.target_layer_ids)
    for a, b in zip(cached, online):
        assert a.ids.tolist() == b.ids.tolist() and torch.equal(a.topk_ids, b.topk_ids)
        torch.testing.assert_close(a.taps.float(), b.taps.float())


def test_decode_time_taps_equal_the_teacher_forced_ones(tmp_path, one_thread):
    """``regenerate(tap_layers=...)`` keeps the taps its prefill and decode steps computed: the training shard it
    makes is the one ``tap_shards`` would make from its regen shard (same ids, top-k, taps), including rows that
    finished early and rows that were dropped from the stepped batch (compact)."""
    from trtllm_dflash.train.regen import write_regen_shard
    from trtllm_dflash.train.data import write_shard

    tdir, ddir = make_tiny_pair(tmp_path, "qwen3", seed=4, block_size=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    layers = drafter.spec.target_layer_ids
    prompts = _prompts(6, seed=3)
    plain = regenerate(target, prompts, 12, (7,), top_k=4)
    early = (int(plain[0].ids[plain[0].prompt_len + 2]),)  # row 0 stops after 3 tokens, others later or never
    for compact in (0.0, 1.0):
        got = regenerate(target, prompts, 12, early, top_k=4, check_every=2, compact=compact, tap_layers=layers)
        assert len({len(g.ids) - g.prompt_len for g in got}) > 1, "some rows must finish early for this check"
        write_regen_shard(tmp_path / "regen-00000.safetensors", got)
        ref = read_shard(tap_shards(target, [tmp_path / "regen-00000.safetensors"], tmp_path / f"t{compact}",
                                    layers, batch_size=4)[0])
        write_shard(tmp_path / "fused.safetensors", [g.as_sample() for g in got])
        for g, f, r in zip(got, read_shard(tmp_path / "fused.safetensors"), ref):
            assert f.ids.tolist() == r.ids.tolist() and torch.equal(f.topk_ids, r.topk_ids)
            assert f.taps.shape == r.taps.shape == (len(g.ids), len(layers) * target.spec.hidden_size)
            assert not f.taps[-1].any()
            torch.testing.assert_close(f.taps.float(), r.taps.float(), rtol=1e-2, atol=1e-2)
    assert regenerate(target, prompts[:2], 4, (), top_k=2)[0].taps is None  # no tap_layers: nothing kept
