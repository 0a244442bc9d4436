"""Speculators-format DFlash drafters (vLLM's ``speculators`` 0.9.0): loaded as-is, written back, refused by name.

Without the peer: a speculators directory written by our own writer (``models/speculators.py``) from a random
drafter with a reduced draft vocabulary loads back through ``load_pair`` and drafts the same target ids; a
full-vocabulary one drafts exactly like the z-lab drafter with the same weights; every refusal's message names the
field, the value and the fix.

With the peer venv (``build_scripts/peer_speculators.sh``): speculators' own classes build and save a random
reduced-vocabulary DFlash drafter for the real SmolLM2 target; we load it and compare draft logits and drafted
tokens with speculators' own forward; then we write it back out and speculators' ``from_pretrained`` + forward must
agree with ours again.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from _lib.speculators_parity import NO_PEER, PEER_PYTHON, dflash_parity, run_peer
from trtllm_dflash.checkpoints import drafter_spec_for, load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.models import speculators
from trtllm_dflash.models.drafter import DrafterModel, draft_block
from trtllm_dflash.specs import DrafterSpec, TargetSpec, check_pair

DRAFT_VOCAB = 64


def _random_drafter(target: TargetSpec, draft_vocab: int | None, seed: int = 0) -> DrafterModel:
    """A random drafter for ``target`` (decisive weights: std 0.15), with a random reduced draft vocabulary."""
    spec = drafter_spec_for(target, num_layers=2, block_size=6, mask_token_id=5)
    spec = replace(spec, num_target_layers=None, vocab_size=target.vocab_size, draft_vocab_size=draft_vocab)
    torch.manual_seed(seed)
    model = DrafterModel(spec, dtype=torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0.0, 0.15)
    if draft_vocab is not None:
        ids = torch.randperm(target.vocab_size)[:draft_vocab].sort().values
        d2t, t2d = speculators.vocab_tables(ids, target.vocab_size)
        model.draft_head.load_map(d2t, t2d, "test")
    return model.eval()


def _drafts(target, drafter, taps, bonus, num_ctx):
    """Drafts [1, B−1] (target ids) of one block after injecting ``num_ctx`` context tokens."""
    cache = drafter.new_cache(1, 64)
    with torch.inference_mode():
        drafter.inject(taps[:, :num_ctx], torch.tensor([num_ctx]), cache)
        return draft_block(torch.tensor([bonus]), drafter.spec.block_size, drafter.spec.mask_token_id, target.embed,
                           lambda e: drafter.draft(e, cache), lambda h: target.logits(h.to(target.dtype)),
                           own_head=drafter.draft_head)


def _taps(drafter, n=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, drafter.spec.num_taps * drafter.spec.hidden_size, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("draft_vocab", [DRAFT_VOCAB, None])
def test_own_writer_round_trip(tiny_dirs, tmp_path, draft_vocab):
    tdir = tiny_dirs["llama"][0]
    target_spec = TargetSpec.load(tdir)
    model = _random_drafter(target_spec, draft_vocab)
    out = speculators.write_speculators_drafter(tmp_path / "spec", model, target_spec, tdir, dtype=torch.float64)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash"
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in model.spec.target_layer_ids]
    names = set(load_file(str(out / "model.safetensors")))
    assert ({"lm_head.weight", "d2t", "t2d"} <= names) == (draft_vocab is not None)

    target, loaded = load_pair(tdir, out, dtype=torch.float64)
    assert loaded.spec == model.spec
    for (n, a), (m, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    taps = _taps(model)
    for num_ctx, bonus in ((3, 7), (11, 200)):
        want = _drafts(target, model, taps, bonus, num_ctx)
        got = _drafts(target, loaded, taps, bonus, num_ctx)
        assert torch.equal(got, want)
        if draft_vocab is not None:  # every drafted id is a target id the draft vocabulary holds
            assert set(got.flatten().tolist()) <= set(loaded.draft_head.draft_to_target.tolist())


def test_a_drafter_over_a_draft_vocab_file_is_written_as_a_reduced_vocabulary_drafter(tiny_dirs, tmp_path):
    """A full-vocabulary drafter that drafts over ``draft_vocab.json`` (rows of the target's head) is written with
    ``draft_vocab_size``, that head and its tables, and drafts the same ids when loaded back."""
    import numpy as np

    from trtllm_dflash.models import draft_vocab

    tdir, zdir = tiny_dirs["llama"]
    vocab_file = draft_vocab.write(tmp_path / "ids.json", np.arange(0, 256, 3), {})
    target, zlab = load_pair(tdir, zdir, dtype=torch.float64, draft_vocab=vocab_file)
    out = speculators.write_speculators_drafter(tmp_path / "spec", zlab, target.spec, tdir, dtype=torch.float64)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == len(range(0, 256, 3))
    _, loaded = load_pair(tdir, out, dtype=torch.float64)
    assert torch.equal(loaded.draft_head.draft_to_target, zlab.draft_head.draft_to_target)
    taps = _taps(zlab)
    assert torch.equal(_drafts(target, loaded, taps, 9, 6), _drafts(target, zlab, taps, 9, 6))


def test_a_drafter_without_sliding_layers_is_written_bidirectional_for_vllm(tiny_dirs, tmp_path):
    """vLLM 0.32 (``transformers_utils/configs/speculators/algos.py``, ``update_dflash``) sets every draft layer's
    causality to ``not sliding_window_non_causal``; speculators reads the flag for sliding layers only. An
    all-full-attention drafter is therefore written with the flag true, and loads back with the same spec."""
    tdir = tiny_dirs["llama"][0]
    target_spec = TargetSpec.load(tdir)
    model = _random_drafter(target_spec, DRAFT_VOCAB)
    assert not any(model.spec.layer_causal)
    out = speculators.write_speculators_drafter(tmp_path / "spec", model, target_spec, tdir, dtype=torch.float64)
    assert json.loads((out / "config.json").read_text())["sliding_window_non_causal"] is True
    assert load_pair(tdir, out, dtype=torch.float64)[1].spec == model.spec


def test_full_vocab_speculators_drafts_like_zlab(tiny_dirs, tmp_path):
    """The same weights as a z-lab drafter and as a full-vocabulary speculators one draft the same tokens."""
    tdir, zdir = tiny_dirs["qwen3"]
    target, zlab = load_pair(tdir, zdir, dtype=torch.float64)
    out = speculators.write_speculators_drafter(tmp_path / "spec", zlab, target.spec, tdir, dtype=torch.float64)
    _, spec_drafter = load_pair(tdir, out, dtype=torch.float64)
    assert spec_drafter.draft_head is None and spec_drafter.spec.target_layer_ids == zlab.spec.target_layer_ids
    taps = _taps(zlab)
    assert torch.equal(_drafts(target, spec_drafter, taps, 9, 6), _drafts(target, zlab, taps, 9, 6))


def test_zlab_copy_of_full_vocab_drafter(tiny_dirs, tmp_path):
    tdir, zdir = tiny_dirs["llama"]
    target, zlab = load_pair(tdir, zdir, dtype=torch.float64)
    spec_dir = speculators.write_speculators_drafter(tmp_path / "spec", zlab, target.spec, tdir, dtype=torch.float64)
    copy = speculators.write_zlab_copy(spec_dir, tmp_path / "zlab", target.spec, dtype=torch.float64)
    assert not speculators.is_speculators_dir(copy)
    _, back = load_pair(tdir, copy, dtype=torch.float64)
    assert back.spec == replace(zlab.spec, num_target_layers=target.spec.num_hidden_layers)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), zlab.state_dict().values()))


def test_target_head_on_reduced_vocab_drafter_is_refused(tiny_dirs):
    target_spec = TargetSpec.load(tiny_dirs["llama"][0])
    model = _random_drafter(target_spec, DRAFT_VOCAB)
    cache = model.new_cache(1, 32)
    embeds = torch.zeros(1, 6, model.spec.hidden_size, dtype=torch.float64)
    with pytest.raises(ConfigError) as e:
        model.draft(embeds, cache)  # what an unchanged caller does before applying the target's head
    assert e.value.field == "drafter.draft_vocab_size" and e.value.value == DRAFT_VOCAB
    assert "own_head=drafter.draft_head" in e.value.fix


def test_decoder_and_served_drafter_draft_through_own_head(tiny_dirs, tmp_path):
    """A reduced-vocabulary drafter in the in-process decoder and in the served step engines (``runtime.steps``):
    both draft through its own head and map to target ids (``draft_block(own_head=drafter.draft_head)``), lossless,
    with the same acceptance lengths."""
    import asyncio

    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.local import BatchedLocalSteps
    from trtllm_dflash.runtime.stepper import run_generation
    from trtllm_dflash.runtime.protocol import GenerateRequest
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier

    tdir = tiny_dirs["llama"][0]
    target_spec = TargetSpec.load(tdir)
    out = speculators.write_speculators_drafter(tmp_path / "spec", _random_drafter(target_spec, DRAFT_VOCAB),
                                                target_spec, tdir, dtype=torch.float64)
    target, drafter = load_pair(tdir, out, dtype=torch.float64)
    requests = [Request((1, 17, 33, 4, 99), 24), Request((7, 8), 24)]
    want = [r.token_ids for r in SpeculativeDecoder(target, None, 1).generate(requests)]
    got = SpeculativeDecoder(target, drafter, 6).generate(requests)
    assert [r.token_ids for r in got] == want
    assert all(1 <= t <= 6 for r in got for t in r.acceptance_lengths)

    steps = BatchedLocalSteps(TargetVerifier(target, drafter.spec.target_layer_ids, 2, 64, 6), KVInjector(drafter),
                              BlockDrafter(drafter, TargetHead(tdir, torch.float64), 2, 64))
    served = {}

    async def one(i, r):
        async def on_update(u):
            served[i] = (tuple(u.tokens), served.get(i, ((), []))[1] + u.acceptance_lengths)

        await run_generation(steps, GenerateRequest(r.prompt_ids, 24, SamplingParams(), (), False), 6, i, on_update)

    async def both():
        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))

    asyncio.run(both())
    assert [served[i][0] for i in range(2)] == want
    assert [served[i][1] for i in range(2)] == [list(r.acceptance_lengths) for r in got]


# ----------------------------------------------------------------------------------------------------------------------
# Refusals: field, value, fix


def _config(**over):
    """A speculators DFlash config.json (the layout speculators 0.9.0's save_pretrained writes), trimmed."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
        "block_size": 8, "draft_vocab_size": 32000, "mask_token_id": 151669,
        "aux_hidden_state_layer_ids": [2, 18, 33], "sample_from_anchor": False, "target_hidden_size": None,
        "transformer_layer_config": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
                                     "num_hidden_layers": 1, "num_attention_heads": 16, "num_key_value_heads": 8,
                                     "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}},
        "speculators_config": {"algorithm": "dflash", "verifier": {"name_or_path": "Qwen/Qwen3-0.6B",
                                                                   "architectures": ["Qwen3ForCausalLM"]}},
    }
    layer = over.pop("layer", {})
    cfg["transformer_layer_config"].update(layer)
    return cfg | over


def test_config_translation_fills_class_defaults():
    """Keys ``to_diff_dict`` leaves out (equal to Qwen3Config's defaults) come from that class: vocab 151936,
    head_dim 128, rms_norm_eps 1e-6; layer ids shift by one (speculators id i = output of layer i − 1)."""
    spec = DrafterSpec.from_hf_config(_config())
    assert spec.target_layer_ids == (1, 17, 32) and spec.num_target_layers is None
    assert (spec.vocab_size, spec.head_dim, spec.rms_norm_eps, spec.draft_vocab_size) == (151936, 128, 1e-6, 32000)
    assert spec.rope.theta == 1e6 and spec.block_size == 8 and spec.mask_token_id == 151669
    assert DrafterSpec.from_hf_config(_config(draft_vocab_size=151936)).draft_vocab_size is None


@pytest.mark.parametrize("over, field, value, fix", [
    (dict(markov_rank=256), "drafter.markov_rank", 256, '"dspark"'),
    (dict(architectures=["DSparkDraftModel"]), "drafter.architectures", ["DSparkDraftModel"], "plain DFlash"),
    (dict(speculators_model_type="dflash2"), "drafter.speculators_model_type", "dflash2", "plain DFlash"),
    (dict(speculators_model_type="eagle3"), "drafter.speculators_model_type", "eagle3", "plain DFlash"),
    (dict(speculators_model_type="medusa"), "drafter.speculators_model_type", "medusa", "z-lab DFlashDraftModel"),
    (dict(sample_from_anchor=True), "drafter.sample_from_anchor", True, "sample_from_anchor false"),
    (dict(mask_token_id=None), "drafter.mask_token_id", None, "--mask-token-id"),
    (dict(aux_hidden_state_layer_ids=[0, 18]), "drafter.aux_hidden_state_layer_ids[0]", 0, "decoder-layer outputs"),
    (dict(target_hidden_size=2048), "drafter.target_hidden_size", 2048, "hidden size equals its target's"),
    (dict(layer={"attention_bias": True}), "drafter.transformer_layer_config.attention_bias", True,
     "attention_bias false"),
    (dict(layer={"hidden_act": "gelu"}), "drafter.transformer_layer_config.hidden_act", "gelu", "silu"),
    (dict(layer={"model_type": "gemma3"}), "drafter.transformer_layer_config.model_type", "gemma3",
     "_LAYER_CONFIG_DEFAULTS"),
    (dict(draft_vocab_size=200000), "drafter.draft_vocab_size", 200000, "verifier's vocabulary"),
])
def test_config_refusals(over, field, value, fix):
    with pytest.raises(ConfigError) as e:
        DrafterSpec.from_hf_config(_config(**over))
    assert e.value.field == field and e.value.value == value, str(e.value)
    assert e.value.fix and fix in e.value.fix and f"{field}={value!r}" in str(e.value)


def _written(tiny_dirs, tmp_path, edit):
    tdir = tiny_dirs["llama"][0]
    target_spec = TargetSpec.load(tdir)
    out = speculators.write_speculators_drafter(tmp_path / "spec", _random_drafter(target_spec, DRAFT_VOCAB),
                                                target_spec, tdir, dtype=torch.float32)
    state = load_file(str(out / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"))
    return tdir, out


@pytest.mark.parametrize("edit, field, value, rule", [
    # Eros483/Qwen3-0.6B-DFlash-*-b8 ship a 32k draft vocabulary without their d2t/t2d tables
    (lambda s: (s.pop("d2t"), s.pop("t2d")), "drafter.d2t", "absent from model.safetensors", "id map"),
    (lambda s: s.pop("lm_head.weight"), "drafter.lm_head.weight", "absent from model.safetensors", "own"),
    (lambda s: s.__setitem__("t2d", torch.roll(s["t2d"], 1)), None, None, "exactly at the draft_vocab_size"),
    (lambda s: s.__setitem__("d2t", s["d2t"] + 10**6), None, None, "ascending ids in [0, 256)"),
])
def test_weight_refusals(tiny_dirs, tmp_path, edit, field, value, rule):
    tdir, out = _written(tiny_dirs, tmp_path, edit)
    with pytest.raises(ConfigError) as e:
        load_pair(tdir, out)
    assert rule in e.value.rule and e.value.fix, str(e.value)
    if field is not None:
        assert (e.value.field, e.value.value) == (field, value)
        assert "d2t" in e.value.fix or "save_pretrained" in e.value.fix


def test_a_full_vocabulary_config_over_draft_vocabulary_tables_is_refused(tiny_dirs, tmp_path):
    """config.json says the full vocabulary while model.safetensors holds a draft vocabulary: refused, not drafted
    through the target's head with the drafter's own head and tables dropped."""
    tdir, out = _written(tiny_dirs, tmp_path, lambda s: None)
    cfg = json.loads((out / "config.json").read_text())
    cfg["draft_vocab_size"] = cfg["transformer_layer_config"]["vocab_size"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_pair(tdir, out)
    assert (e.value.field, e.value.value) == ("drafter.draft_vocab_size", 256)
    assert f"set draft_vocab_size to {DRAFT_VOCAB}" in e.value.fix


def test_vocab_mismatch_and_zlab_writer_refusals(tiny_dirs):
    target_spec = TargetSpec.load(tiny_dirs["llama"][0])
    spec = _random_drafter(target_spec, DRAFT_VOCAB).spec
    with pytest.raises(ConfigError, match="drafter.transformer_layer_config.vocab_size=512"):
        check_pair(target_spec, replace(spec, vocab_size=512))
    with pytest.raises(ConfigError) as e:
        spec.to_hf_config(target=target_spec)
    assert e.value.field == "drafter.draft_vocab_size" and "speculators format" in e.value.fix


def test_trtllm_convert(tiny_dirs, tmp_path):
    """A full-vocabulary speculators drafter converts to a TensorRT-LLM checkpoint like its z-lab twin; a
    reduced-vocabulary one is refused (the engine drafter has no head of its own)."""
    from trtllm_dflash.convert.checkpoint import convert
    from trtllm_dflash.convert.loader import load_trtllm_drafter

    tdir, zdir = tiny_dirs["llama"]
    target, zlab = load_pair(tdir, zdir, dtype=torch.float32)
    full = speculators.write_speculators_drafter(tmp_path / "full", zlab, target.spec, tdir, dtype=torch.float32)
    back = load_trtllm_drafter(convert(tdir, full, tmp_path / "ckpt", dtype="float32") / "drafter")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), zlab.state_dict().values()))
    reduced = speculators.write_speculators_drafter(tmp_path / "reduced", _random_drafter(target.spec, DRAFT_VOCAB),
                                                    target.spec, tdir, dtype=torch.float32)
    with pytest.raises(ConfigError) as e:
        convert(tdir, reduced, tmp_path / "ckpt2")
    assert (e.value.field, e.value.value) == ("drafter.draft_vocab_size", DRAFT_VOCAB) and "in-process" in e.value.fix


# ----------------------------------------------------------------------------------------------------------------------
# Against speculators itself


@pytest.mark.slow
@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=NO_PEER)
def test_against_speculators(smollm2, tmp_path):
    run_peer("dflash", "make", tmp_path / "peer", "--target", smollm2["target"])
    io = load_file(str(tmp_path / "peer" / "peer_io.safetensors"))
    target, drafter = load_pair(smollm2["target"], tmp_path / "peer" / "drafter")
    assert drafter.spec.draft_vocab_size == 4096 and drafter.spec.target_layer_ids == (1, 14, 27)
    got = dflash_parity(target, drafter, io)
    worst, equal = got.max_logit_diff, got.tokens_equal
    # float32 on both sides, summed in different orders (eager attention over a masked [T + B] key set there, the
    # context cache here); max |logit| 14.7, observed max difference 2.3e-5
    assert worst < 1e-3 and equal, (worst, equal)

    # our writer, read back by speculators' own from_pretrained and forward
    speculators.write_speculators_drafter(tmp_path / "ours", drafter, target.spec, smollm2["target"],
                                          dtype=torch.float32)
    run_peer("dflash", "run", tmp_path / "ours", tmp_path / "back")
    back = dflash_parity(target, drafter, load_file(str(tmp_path / "back" / "peer_io.safetensors")))
    worst_back, equal_back = back.max_logit_diff, back.tokens_equal
    assert worst_back < 1e-3 and equal_back, (worst_back, equal_back)


def test_repositories_refuse_what_their_backend_cannot_serve(tiny_dirs, tmp_path):
    """make-repo: the torch step models serve a reduced-vocabulary drafter; TensorRT-LLM's backends are refused it by
    name (their drafter has no head of its own), and its LLM-API loader a speculators directory (it reads z-lab's)."""
    from trtllm_dflash.serve.triton.render import RepoConfig

    tdir, zdir = tiny_dirs["llama"]
    target, zlab = load_pair(tdir, zdir, dtype=torch.float64)
    reduced = speculators.write_speculators_drafter(tmp_path / "reduced", _random_drafter(target.spec, DRAFT_VOCAB),
                                                    target.spec, tdir, dtype=torch.float64)
    full = speculators.write_speculators_drafter(tmp_path / "full", zlab, target.spec, tdir, dtype=torch.float64)
    RepoConfig(tdir, str(reduced), "torch", block_size="auto", max_seq_len=64).validate()
    with pytest.raises(ConfigError) as e:
        RepoConfig(tdir, str(reduced), "trtllm-pytorch", block_size=4, checkpoint_dir=tdir, max_seq_len=64).validate()
    assert e.value.field == "drafter.draft_vocab_size" and e.value.value == DRAFT_VOCAB and "--backend torch" in e.value.fix
    with pytest.raises(ConfigError, match="export-drafter --to z-lab") as e:
        RepoConfig(tdir, str(full), "trtllm-pytorch", block_size=4, checkpoint_dir=tdir, max_seq_len=64).validate()
    assert e.value.field == "--drafter"
