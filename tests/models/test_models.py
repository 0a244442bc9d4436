"""The torch target and drafter against Hugging Face transformers, checkpoint loading and the cache model."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from trtllm_dflash.checkpoints import load_pair, write_tiny_target
from trtllm_dflash.errors import ArtifactError
from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.specs import DrafterSpec

# HF builds RoPE tables in float32 even for float64 models, so float64 logits agree to ~1e-6, not 1e-12.
ROPE_TOL = 2e-5


def hf_forward(model_dir, ids, dtype=torch.float64):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.no_grad():
        return hf(ids, output_hidden_states=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logits_and_taps_match_transformers(tiny_dirs, tiny_models, family):
    target = tiny_models[family][0]
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = hf_forward(tiny_dirs[family][0], ids)
    hidden, taps = target(ids, target.new_cache(2, 32), tap_layers=(0, 2, 4))
    torch.testing.assert_close(target.logits(hidden), ref.logits, atol=ROPE_TOL, rtol=0)
    # Tap i is the output of decoder layer i, i.e. HF hidden_states[i + 1].
    h = target.spec.hidden_size
    for k, layer in enumerate((0, 2, 4)):
        torch.testing.assert_close(taps[..., k * h : (k + 1) * h], ref.hidden_states[layer + 1], atol=ROPE_TOL, rtol=0)


def test_tied_embeddings_and_sharded_checkpoint(tmp_path):
    src = write_tiny_target(tmp_path / "tied", tie_word_embeddings=True, num_layers=2)
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((src / "config.json").read_text())
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, str(shard_dir / fname))
        weight_map |= {n: fname for n in part}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = torch.randint(0, 256, (1, 10))
    a, b = TargetModel.from_pretrained(src, torch.float64), TargetModel.from_pretrained(shard_dir, torch.float64)
    ha, _ = a(ids, a.new_cache(1, 16))
    hb, _ = b(ids, b.new_cache(1, 16))
    assert torch.equal(a.logits(ha), b.logits(hb))
    torch.testing.assert_close(a.logits(ha), hf_forward(src, ids).logits, atol=ROPE_TOL, rtol=0)


def test_cache_crop_equals_recomputation(tiny_models):
    """Verify a block, keep only a prefix of it (crop), continue: logits equal a from-scratch prefill."""
    target = tiny_models["qwen3"][0]
    g = torch.Generator().manual_seed(1)
    prompt, block, nxt = (torch.randint(0, 256, (1, n), generator=g) for n in (12, 6, 3))
    cache = target.new_cache(1, 64)
    target(prompt, cache)
    cache.commit(None, torch.tensor([12]))
    target(block, cache)  # writes 6 entries ...
    cache.commit(None, torch.tensor([2]))  # ... keeps 2 (accepted), the rest is scratch
    h_inc, _ = target(nxt, cache)
    fresh = target.new_cache(1, 64)
    h_ref, _ = target(torch.cat([prompt, block[:, :2], nxt], dim=1), fresh)
    torch.testing.assert_close(h_inc, h_ref[:, -3:], atol=1e-10, rtol=0)  # float64: identical math up to order


def test_drafter_checkpoint_has_zlab_names_and_shapes(tiny_dirs):
    ddir = tiny_dirs["llama"][1]
    state = load_file(str(ddir / "model.safetensors"))
    spec = DrafterSpec.load(ddir)
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    assert state["fc.weight"].shape == (h, spec.num_taps * h)
    assert state["hidden_norm.weight"].shape == (h,) and state["norm.weight"].shape == (h,)
    assert state["layers.0.self_attn.k_proj.weight"].shape == (kv, h)
    assert state["layers.1.self_attn.q_norm.weight"].shape == (spec.head_dim,)
    assert state["layers.1.mlp.down_proj.weight"].shape == (h, spec.intermediate_size)
    assert not any(k.startswith(("model.", "embed_tokens", "lm_head")) for k in state)
    assert len(state) == 3 + spec.num_hidden_layers * 11
    cfg = json.loads((ddir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == 5


def test_wrong_drafter_weights_fail_clearly(tiny_dirs, tmp_path):
    ddir = tiny_dirs["llama"][1]
    state = load_file(str(ddir / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((ddir / "config.json").read_text())
    save_file({k: v for k, v in state.items() if k != "fc.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(ArtifactError, match=r"missing 1 tensors \(e.g. \['fc.weight'\]\)"):
        DrafterModel.from_pretrained(bad)
    state["norm.weight"] = torch.ones(7)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ArtifactError, match="norm.weight has shape \\[7\\]"):
        DrafterModel.from_pretrained(bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ArtifactError, match="unreadable safetensors"):
        DrafterModel.from_pretrained(bad)


def test_drafter_for_another_target_is_refused(tiny_dirs, tmp_path):
    other = write_tiny_target(tmp_path / "wide", hidden_size=96, num_heads=4, num_layers=6)
    with pytest.raises(Exception, match="hidden_size=64: must equal the target's hidden_size \\(96\\)"):
        load_pair(other, tiny_dirs["llama"][1])


def test_drafter_block_is_noncausal_and_context_is_committed_only(tiny_models):
    """Changing the last block slot changes slot 0's output (bidirectional), and draft() commits nothing."""
    target, drafter = tiny_models["llama"]
    cache = drafter.new_cache(1, 64)
    taps = torch.randn(1, 7, drafter.spec.num_taps * 64, dtype=torch.float64)
    drafter.inject(taps, torch.tensor([7]), cache)
    emb = target.embed(torch.tensor([[3, 5, 5, 5]]))
    out1 = drafter.draft(emb, cache)
    assert int(cache.lengths[0]) == 7
    emb2 = target.embed(torch.tensor([[3, 5, 5, 9]]))
    out2 = drafter.draft(emb2, cache)
    assert not torch.allclose(out1[:, 0], out2[:, 0])
    torch.testing.assert_close(drafter.draft(emb, cache), out1, atol=1e-12, rtol=0)


def test_consecutive_cache_rows_are_read_as_views(tiny_models):
    """A batch whose cache rows run consecutively (a served batch sorted by slot) reads K/V through slices, at most a
    few runs; rows out of order or scattered are gathered as before. Both give the same forward."""
    from trtllm_dflash.models.layers import KVCache

    assert KVCache.view_rows(None) is None
    assert KVCache.view_rows(torch.tensor([3, 4, 5])) == [(slice(3, 6), slice(0, 3))]
    assert KVCache.view_rows(torch.tensor([0, 1, 5, 6, 7])) == [(slice(0, 2), slice(0, 2)), (slice(5, 8), slice(2, 5))]
    for gathered in ([2, 1], [0, 2, 4, 6, 8]):  # out of order; more runs than max_runs (4)
        rows = torch.tensor(gathered)
        assert KVCache.view_rows(rows) is rows
    target = tiny_models["llama"][0]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (8, 12), generator=g)
    step = torch.randint(0, 256, (3, 2), generator=g)
    out = {}
    for name, order in (("views", [0, 1, 2]), ("gather", [2, 0, 1])):  # sequences at cache rows 1, 2, 6
        cache = target.new_cache(8, 32)
        target(prompts, cache)
        cache.commit(None, torch.arange(4, 12))  # rows hold 4..11 committed tokens
        hidden, _ = target(step[order], cache, torch.tensor([1, 2, 6])[order])
        out[name] = hidden[torch.tensor(order).argsort()]  # back in the order of rows 1, 2, 6
    torch.testing.assert_close(out["views"], out["gather"], atol=1e-12, rtol=0)


def test_rows_naming_every_cache_row_in_order_read_the_whole_cache(tiny_models):
    """A batch whose rows are all of its cache's, in order (``generate``'s), runs the forwards as rows=None does; any
    other selection is kept as it is. The whole-cache forward equals the rows' forwards one at a time (read through
    ``view_rows``' slices)."""
    target, drafter = tiny_models["llama"][0], tiny_models["llama"][1]
    cache = target.new_cache(3, 32)
    assert cache.every_row(torch.tensor([0, 1, 2])) is None and cache.every_row(None) is None
    for rows in ([0, 1], [1, 0, 2], [0, 1, 1]):
        picked = torch.tensor(rows)
        assert cache.every_row(picked) is picked
    g = torch.Generator().manual_seed(1)
    prompts, step = torch.randint(0, 256, (3, 9), generator=g), torch.randint(0, 256, (3, 4), generator=g)
    cache, dcache = target.new_cache(3, 32), drafter.new_cache(3, 32)
    target(prompts, cache)
    cache.commit(None, torch.tensor([5, 7, 9]))
    dcache.commit(None, torch.tensor([2, 3, 4]))
    rows = torch.tensor([0, 1, 2])
    whole = (target(step, cache, rows)[0], drafter.draft(target.embed(step), dcache, rows))
    one = [(target(step[j:j + 1], cache, rows[j:j + 1])[0], drafter.draft(target.embed(step[j:j + 1]), dcache,
                                                                          rows[j:j + 1])) for j in range(3)]
    for i, a in enumerate(whole):
        torch.testing.assert_close(a, torch.cat([o[i] for o in one]), atol=1e-12, rtol=0)


def test_the_lm_head_runs_as_one_gemm_over_every_row(tiny_models):
    """``draft_block`` hands the head its slots as one matrix and ``TargetModel.logits`` flattens any view: a [b, S, H]
    view whose rows do not merge (slots 1..B−1 of a block) would go through one GEMM per row, each reading the whole
    LM head. The logits are those of each row alone."""
    from torch.profiler import ProfilerActivity, profile

    from trtllm_dflash.models.drafter import draft_block

    target, drafter = tiny_models["llama"]
    hidden = torch.randn(4, 6, 64, dtype=torch.float64)[:, 1:]  # rows 5 · 64 apart in a 6 · 64 stride: no merge
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = target.logits(hidden)
    assert "aten::bmm" not in {e.key for e in prof.key_averages()}
    torch.testing.assert_close(logits, torch.stack([target.lm_head(h) for h in hidden]), atol=1e-12, rtol=0)
    assert target.logits(hidden[:, :0]).shape == (4, 0, target.spec.vocab_size)
    seen = []
    cache = drafter.new_cache(3, 8)
    drafts = draft_block(torch.tensor([1, 2, 3]), 5, drafter.spec.mask_token_id, target.embed,
                         lambda e: drafter.draft(e, cache),
                         lambda h: seen.append(h.is_contiguous()) or target.logits(h))
    assert seen == [True] and drafts.shape == (3, 4)
