"""End to end on a tiny synthetic target whose greedy continuation is known (next token = token + 1 mod V): the
recipe (regeneration with taps → anchors → objective → AdamW → z-lab export) must produce a drafter that the real
inference loop (``SpeculativeDecoder``) accepts for long stretches. A label shift, a position offset or a mask that
differs between training and inference would leave τ near 1."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from trtllm_dflash.checkpoints import drafter_spec_for, load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.train.config import TrainConfig
from trtllm_dflash.train.data import generate_with_taps, read_shard, write_shard
from trtllm_dflash.train.trainer import train

VOCAB, HIDDEN, BLOCK = 32, 64, 4


def write_successor_target(path):
    """A 6-layer Llama whose layers add nothing (o_proj = down_proj = 0), embeddings orthonormal and whose LM head
    row j is embedding j − 1: the residual stream stays the token's embedding and greedy decoding counts upward."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=256, tie_word_embeddings=False,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        q, _ = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN))
        emb = q[:VOCAB]  # orthonormal rows
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(10 * emb.roll(1, dims=0))  # row j = 10 · emb[j − 1]
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(str(path))
    return path


def config(tmp_path, tdir, steps, **kw) -> TrainConfig:
    values = dict(
        target=str(tdir), out=str(tmp_path / "drafter"), work_dir=str(tmp_path / "work"), num_layers=2,
        block_size=BLOCK, target_layer_ids=None, intermediate_size=None, mask_token_id=0, data="mined",
        num_code_prompts=0, num_chat_prompts=0, max_new_tokens=40, max_prompt_len=64, gen_batch_size=8, max_shards=None,
        steps=steps, epochs=None, samples_per_step=4, anchors_per_sample=8, lr=3e-3, warmup=0.05,
        weight_decay=0.0, gamma=2.0, loss_vocab="full", loss_negatives=0, init="random", seed=0, device="cpu", threads=1, log_every=20, ckpt_every=100,
    )
    return TrainConfig(**(values | kw))




@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    tmp_path = tmp_path_factory.mktemp("synthetic")
    tdir = write_successor_target(tmp_path / "target")
    from trtllm_dflash.models.target import TargetModel

    target = TargetModel.from_pretrained(tdir)
    cfg = config(tmp_path, tdir, steps=200)
    spec = drafter_spec_for(target.spec, num_layers=2, block_size=BLOCK, mask_token_id=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(48)]
    samples = generate_with_taps(target, prompts, cfg.max_new_tokens, (), spec.target_layer_ids)
    assert samples[0].ids[-2:].tolist() == [(samples[0].ids[-3] + 1) % VOCAB, (samples[0].ids[-3] + 2) % VOCAB]
    shard = tmp_path / "work" / "shard.safetensors"
    shard.parent.mkdir(parents=True)
    write_shard(shard, samples)
    assert [s.ids.tolist() for s in read_shard(shard)] == [s.ids.tolist() for s in samples]
    train(cfg, tmp_path / "work", target, spec, [shard], resume=False)
    return cfg, tdir, target, spec, shard


def test_trained_drafter_is_accepted_by_the_inference_loop(trained):
    cfg, tdir, _, _, _ = trained
    target, drafter = load_pair(tdir, cfg.out)  # the exported z-lab checkpoint, as a user would load it
    dec = SpeculativeDecoder(target, drafter, BLOCK)
    prompts = [[5, 9, 20], [30, 31], [7], [12, 3, 3, 8]]
    results = dec.generate([Request(tuple(p), 32) for p in prompts])
    for p, r in zip(prompts, results):
        assert list(r.token_ids) == [(p[-1] + 1 + i) % VOCAB for i in range(32)]  # lossless, of course
    taus = [t for r in results for t in r.acceptance_lengths]
    assert sum(taus) / len(taus) >= 3.5, taus  # B = 4: at most 4; measured ≈ 3.9
    doc = json.loads((Path(cfg.out) / "training_log.json").read_text())
    assert doc["records"][-1]["loss"] < 0.2 * doc["records"][0]["loss"]
    assert doc["held_out"][-1]["expected_tau"] >= 3.5  # measured 3.77


def test_existing_checkpoint_needs_resume(trained):
    cfg, tdir, target, spec, shard = trained
    with pytest.raises(ConfigError, match="--resume"):
        train(cfg, Path(cfg.work_dir), target, spec, [shard], resume=False)
    # Resuming a finished run trains nothing more and leaves the export in place.
    train(cfg, Path(cfg.work_dir), target, spec, [shard], resume=True)
    # ... under the same recipe only: another learning rate would splice two runs into one, silently
    with pytest.raises(ConfigError, match=r"lr=0\.0001: .*trained with lr=.*another work directory"):
        train(dataclasses.replace(cfg, lr=1e-4), Path(cfg.work_dir), target, spec, [shard], resume=True)
    train(dataclasses.replace(cfg, log_every=cfg.log_every + 1), Path(cfg.work_dir), target, spec, [shard], resume=True)


def test_warm_start_continues_from_an_exported_drafter(trained, tmp_path):
    """--init <drafter dir>: training continues from the export's weights (the tap standardisation folded into fc at
    export is undone), so zero further steps re-export the same drafter; another architecture is refused by name."""
    from trtllm_dflash.models.weights import read_state_dict

    cfg, tdir, target, spec, shard = trained
    warm = dataclasses.replace(cfg, init=cfg.out, out=str(tmp_path / "again"), work_dir=str(tmp_path / "w"), steps=0)
    Path(warm.work_dir).mkdir()
    train(warm, Path(warm.work_dir), target, spec, [shard], resume=False)
    before, after = read_state_dict(cfg.out), read_state_dict(warm.out)
    assert before.keys() == after.keys()
    for k in before:
        torch.testing.assert_close(after[k].float(), before[k].float(), rtol=0, atol=0, msg=k)
    doc = json.loads((Path(warm.out) / "training_log.json").read_text())
    assert doc["held_out"][-1]["expected_tau"] >= 3.5  # the trained drafter's, not a fresh one's
    other = drafter_spec_for(target.spec, num_layers=1, block_size=BLOCK, mask_token_id=0)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        train(dataclasses.replace(warm, num_layers=1, work_dir=str(tmp_path / "w1")), tmp_path / "w1", target,
              other, [shard], resume=False)


def test_retap_reproduces_the_decoding_pass_taps(tmp_path, one_thread):
    """A tap ablation re-taps the cached samples with a teacher-forced forward instead of regenerating them: with the
    same layers it must give the decoding pass's taps (bf16 rounding aside), with other layers those layers' taps."""
    import transformers

    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.train.data import retap_cache

    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "target"))
    target = TargetModel.from_pretrained(tmp_path / "target")
    src = tmp_path / "src"
    src.mkdir()
    samples = generate_with_taps(target, [[5, 9, 20], [30, 31, 4, 4, 6]], 12, (), (1, 3))
    write_shard(src / "shard-00000.safetensors", samples)
    (src / "meta.json").write_text(json.dumps({"tap_layers": [1, 3], "max_new_tokens": 12, "num_prompts": 2}))

    same = read_shard(retap_cache(target, src, tmp_path / "same", (1, 3))[0])
    for a, b in zip(samples, same):
        assert a.ids.tolist() == b.ids.tolist() and a.prompt_len == b.prompt_len
        torch.testing.assert_close(b.taps.float(), a.taps.float(), atol=2e-2, rtol=2e-2)
    other = read_shard(retap_cache(target, src, tmp_path / "other", (2,))[0])
    assert other[0].taps.shape == (len(samples[0].ids), HIDDEN)
    assert not torch.allclose(other[0].taps[:-1].float(), samples[0].taps[:-1, :HIDDEN].float(), atol=1e-2)
    assert json.loads((tmp_path / "other" / "meta.json").read_text())["tap_layers"] == [2]
    with pytest.raises(ValueError, match="different settings"):
        retap_cache(target, src, tmp_path / "other", (3,))


def test_trainer_returns_freed_heap_memory_every_few_steps(trained, tmp_path, monkeypatch):
    """glibc keeps what a step frees (a real run grew 60-110 MB a step): the loop trims the heap every TRIM_EVERY
    steps and logs its resident memory (perf/bench_trainer_memory.py at 0620e3a measured the effect)."""
    from trtllm_dflash.train import trainer

    assert trainer._MALLOC_TRIM is not None  # glibc on our machines: the trim is real here, not a no-op
    calls = []
    monkeypatch.setattr(trainer, "_MALLOC_TRIM", lambda pad: calls.append(pad) or 1)
    cfg, tdir, target, spec, shard = trained
    steps = 2 * trainer.TRIM_EVERY + 1
    run = dataclasses.replace(cfg, steps=steps, out=str(tmp_path / "d"), work_dir=str(tmp_path / "w"), log_every=1)
    Path(run.work_dir).mkdir()
    train(run, Path(run.work_dir), target, spec, [shard], resume=False)
    assert calls == [0, 0]
    records = json.loads((Path(run.out) / "training_log.json").read_text())["records"]
    assert len(records) == steps and all(r["resident_mb"] > 0 for r in records)
    monkeypatch.setattr(trainer, "TRIM_EVERY", 0)  # 0 = never
    calls.clear()
    run = dataclasses.replace(run, steps=9, out=str(tmp_path / "d0"), work_dir=str(tmp_path / "w0"))
    Path(run.work_dir).mkdir()
    train(run, Path(run.work_dir), target, spec, [shard], resume=False)
    assert calls == []
