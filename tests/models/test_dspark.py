"""DSpark drafters (speculators 0.9.0 ``DSparkDraftModel``): loaded as-is, drafted with their Markov head, their
confidence head feeding ``--block-size auto``, refused by name where a route cannot carry them.

With the peer venv (``build_scripts/peer_speculators.sh``): speculators' own classes build and save a random DSpark
drafter for a tiny target (``perf/peers/speculators_dspark.py``) for every Markov head type; we load it and compare
the Markov-corrected draft logits, the drafted tokens and the confidence with speculators' own modules. Without the
peer: random DSpark drafters built here decode losslessly in every loop, and the policy's plan follows the
confidence head.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from _lib.speculators_parity import (NO_PEER, PEER_PYTHON, dspark_parity, random_dspark_drafter,
                                     run_peer)
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.models import speculators
from trtllm_dflash.models.drafter import draft_block
from trtllm_dflash.runtime.cost import GRID, CostModel
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.policy import AdaptivePolicy
from trtllm_dflash.runtime.reference import reference_generate
from trtllm_dflash.specs import DrafterSpec, DSparkSpec, TargetSpec


# ----------------------------------------------------------------------------------------------------------------------
# Against speculators itself


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=NO_PEER)
@pytest.mark.parametrize("head_type, anchor, draft_vocab", [
    ("vanilla", 1, 64), ("gated", 1, 0), ("rnn", 1, 64), ("rnn", 0, 64), ("vanilla", 0, 0),
])
def test_against_speculators(tiny_dirs, tmp_path, head_type, anchor, draft_vocab):
    """speculators' drafter loaded here drafts what speculators drafts; ours written out, read back by speculators,
    drafts the same again."""
    tdir = tiny_dirs["llama"][0]
    run_peer("dspark", "make", tmp_path / "peer", "--target", tdir, "--head-type", head_type, "--anchor", anchor,
             "--draft-vocab", draft_vocab)
    target, drafter = load_pair(tdir, tmp_path / "peer" / "drafter")
    spec = drafter.spec
    assert spec.dspark == DSparkSpec(16, head_type, True, True) and spec.anchor_predicts == bool(anchor)
    assert spec.trained_block_size == 6 and spec.block_size == 6 + anchor
    assert spec.draft_vocab_size == (draft_vocab or None) and spec.target_layer_ids == (1, 3)
    got = dspark_parity(target, drafter, load_file(str(tmp_path / "peer" / "peer_io.safetensors")))
    worst, worst_conf, equal, changed = (got.max_logit_diff, got.max_confidence_diff, got.tokens_equal,
                                         got.markov_changes_drafts)
    # float32 on both sides, summed in different orders (eager attention over a masked [T + B] key set there, the
    # context cache here); |logit| up to ~9 (Markov weights std 0.6), observed 2.6e-6 (vanilla) to 1.5e-5 (rnn, whose
    # state runs through five tanh/sigmoid steps); confidence within 6e-7
    assert worst < 1e-4 and worst_conf < 1e-5 and equal, (worst, worst_conf, equal)
    assert changed  # the head is exercised: without it some anchor drafts other tokens

    speculators.write_speculators_drafter(tmp_path / "ours", drafter, target.spec, tdir, dtype=torch.float32)
    run_peer("dspark", "run", tmp_path / "ours", tmp_path / "back")
    back = dspark_parity(target, drafter, load_file(str(tmp_path / "back" / "peer_io.safetensors")))
    assert back.max_logit_diff < 1e-4 and back.max_confidence_diff < 1e-5 and back.tokens_equal, back


# ----------------------------------------------------------------------------------------------------------------------
# Without the peer: decoding, the policy's forecast, refusals


@pytest.mark.parametrize("head_type, anchor, draft_vocab", [("vanilla", True, 64), ("gated", False, None),
                                                            ("rnn", True, None)])
def test_lossless_in_every_loop(tiny_dirs, head_type, anchor, draft_vocab):
    """A DSpark drafter in the in-process decoder (fixed and auto blocks, the tree verify, eager and through rehearsed
    CUDA graphs) and the reference loop: the target's own greedy tokens; every loop accepts the same lengths (one
    draft_block for all)."""
    target, _ = load_pair(*tiny_dirs["llama"], dtype=torch.float64)
    drafter = random_dspark_drafter(target.spec, head_type, anchor, draft_vocab)
    requests = [Request((1, 17, 33, 4, 99), 24), Request((7, 8), 24)]
    want = [r.token_ids for r in SpeculativeDecoder(target, None, 1).generate(requests)]
    block = drafter.spec.block_size
    fixed = SpeculativeDecoder(target, drafter, block).generate(requests)
    assert [r.token_ids for r in fixed] == want
    assert all(1 <= t <= block for r in fixed for t in r.acceptance_lengths)
    policy = AdaptivePolicy(CostModel([1e-3] * len(GRID), [1e-5] * len(GRID)), block)
    assert [r.token_ids for r in SpeculativeDecoder(target, drafter, "auto", policy=policy).generate(requests)] == want
    # the calibrated policy times draft passes down to no drafts at all (a forward over the bonus alone)
    assert [r.token_ids for r in SpeculativeDecoder(target, drafter, "auto").generate(requests)] == want
    # the tree verify: the drafter's runner-ups per position, ranked on the greedy chain's Markov bias
    assert [r.token_ids for r in SpeculativeDecoder(target, drafter, block, tree=True).generate(requests)] == want
    graphed = SpeculativeDecoder(target, drafter, block, cuda_graphs="rehearse").generate(requests)  # CUDA graphs' path
    assert [r.acceptance_lengths for r in graphed] == [r.acceptance_lengths for r in fixed]
    for r, req in zip(fixed, requests):
        tokens, taus = reference_generate(target, drafter, list(req.prompt_ids), req.max_new_tokens, block)
        assert tokens == list(r.token_ids) and taus == list(r.acceptance_lengths)


def _run_auto(target, drafter):
    """One request under ``auto`` through the in-process step engines -> its policy state and the policy."""
    from trtllm_dflash.runtime.local import BatchedLocalSteps
    from trtllm_dflash.runtime.stepper import run_generation
    from trtllm_dflash.runtime.protocol import GenerateRequest
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier

    block = drafter.spec.block_size
    policy = AdaptivePolicy(CostModel([1e-3] * len(GRID), [1e-5] * len(GRID)), block)
    state = policy.new_sequence()
    steps = BatchedLocalSteps(TargetVerifier(target, drafter.spec.target_layer_ids, 1, 64, block),
                              KVInjector(drafter), BlockDrafter(drafter, TargetHead.of(target), 1, 64))

    async def update(_):
        pass

    asyncio.run(run_generation(steps, GenerateRequest((1, 17, 33), 12, SamplingParams(), (), False), "auto", 0,
                               update, policy=policy, state=state))
    return state, policy


def test_confidence_forecast_sets_the_plan(tiny_dirs):
    """The confidence head's estimates of a request's latest block are its next plan's acceptance prior: a confident
    forecast verifies more drafts than a doubtful one; a drafter without the head leaves the plan to the counts and
    the training-log prior."""
    target, zlab = load_pair(*tiny_dirs["llama"], dtype=torch.float64)
    state, policy = _run_auto(target, random_dspark_drafter(target.spec))
    assert state.forecast is not None and 1 <= len(state.forecast) <= policy.max_k
    assert all(0.0 < p < 1.0 for p in state.forecast)

    plans = {}
    for name, forecast in (("confident", [0.97] * policy.max_k), ("doubtful", [0.9, 0.05] + [0.02] * 4)):
        s = policy.new_sequence()
        s.drafted, s.forecast = 1, forecast
        plans[name] = policy.decide([s])[0]
    assert plans["confident"] == policy.max_k and plans["doubtful"] <= 1, plans

    # end to end: the same drafter made sure, then doubtful, of every position plans long, then short blocks
    chosen = {}
    for logit in (8.0, -8.0):
        drafter = random_dspark_drafter(target.spec)
        with torch.no_grad():
            drafter.dspark.confidence_head.proj.weight.zero_()
            drafter.dspark.confidence_head.proj.bias.fill_(logit)
        state, _ = _run_auto(target, drafter)
        chosen[logit] = state.chosen[1:]  # after the first draft, whose plan had no forecast yet
    # the first plan with a forecast; later ones also follow the random drafter's misses (held against the forecast's
    # 8 pseudo-observations), the step times the cost model observes and the probes of a row that stopped drafting
    assert chosen[8.0][0] == policy.max_k and chosen[-8.0][0] <= 1 and sum(chosen[8.0]) > sum(chosen[-8.0]), chosen

    assert _run_auto(target, random_dspark_drafter(target.spec, confidence=False))[0].forecast is None
    plain_state, plain_policy = _run_auto(target, zlab)  # the z-lab drafter: no confidence head, no forecast
    assert plain_state.forecast is None
    again = plain_policy.new_sequence()
    assert plain_policy.drafter_expectation(again) == again.acceptance.expected_accepted_all(
        plain_policy.drafter_prior())


def test_drafts_depend_on_the_markov_chain(tiny_dirs):
    """Each position's bias follows the draft chosen before it: drafting with the head differs from drafting
    without it, and the top-k alternatives' best is the greedy chain."""
    target, _ = load_pair(*tiny_dirs["llama"], dtype=torch.float64)
    drafter = random_dspark_drafter(target.spec, "gated", anchor=True)
    spec = drafter.spec
    taps = torch.randn(1, 10, spec.num_taps * spec.hidden_size, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64)

    def drafts(heads, top=1):
        cache = drafter.new_cache(3, 64)
        with torch.inference_mode():
            drafter.inject(taps.expand(3, -1, -1), torch.tensor([10, 10, 10]), cache)
            return draft_block(torch.tensor([3, 50, 200]), spec.block_size, spec.mask_token_id, target.embed,
                               lambda e: drafter.draft(e, cache), target.logits, top, heads=heads)

    greedy = drafts(drafter.dspark)
    assert greedy.shape == (3, spec.block_size - 1) and not torch.equal(greedy, drafts(None))
    assert torch.equal(drafts(drafter.dspark, top=4)[..., 0], greedy)


def _config(**over):
    """A speculators DSpark config.json as ``DSparkDraftModel.save_pretrained`` writes it, trimmed."""
    cfg = {
        "architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark", "speculators_version": "0.9.0",
        "block_size": 8, "draft_vocab_size": 32000, "mask_token_id": 151669, "aux_hidden_state_layer_ids": [2, 18],
        "sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "transformer_layer_config": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
                                     "num_hidden_layers": 1, "num_attention_heads": 16, "num_key_value_heads": 8},
        "speculators_config": {"algorithm": "dspark", "verifier": {"name_or_path": "Qwen/Qwen3-1.7B"}},
    }
    return cfg | over


def test_config_translation():
    spec = DrafterSpec.from_hf_config(_config())
    assert spec.dspark == DSparkSpec(256, "vanilla", True, True) and spec.anchor_predicts
    assert (spec.block_size, spec.trained_block_size, spec.draft_vocab_size) == (9, 8, 32000)
    trimmed = {k: v for k, v in _config().items() if k not in ("markov_rank", "sample_from_anchor")}
    assert DrafterSpec.from_hf_config(trimmed) == spec  # DSparkSpeculatorConfig's defaults
    assert DrafterSpec.from_hf_config(_config(sample_from_anchor=None)) == spec
    dflash_like = DrafterSpec.from_hf_config(_config(sample_from_anchor=False, markov_head_type="rnn"))
    assert (dflash_like.block_size, dflash_like.anchor_predicts, dflash_like.dspark.markov_head_type) == (8, False,
                                                                                                          "rnn")


@pytest.mark.parametrize("over, field, value, fix", [
    (dict(markov_head_type="lstm"), "drafter.markov_head_type", "lstm", "vanilla, gated or rnn"),
    (dict(markov_rank=0), "drafter.confidence_head_with_markov", True, "confidence_head_with_markov false"),
    (dict(markov_rank=-1), "drafter.markov_rank", -1, None),
    (dict(speculators_model_type="dflash"), "drafter.markov_rank", 256, '"dspark"'),
    (dict(conv_kernel_size=4), "drafter.conv_kernel_size", 4, "DSpark or DFlash drafter"),
    (dict(selector_rank=8), "drafter.selector_rank", 8, "DSpark or DFlash drafter"),
    (dict(sample_from_anchor="yes"), "drafter.sample_from_anchor", "yes", None),
    (dict(speculators_model_type="dflash", markov_rank=0, enable_confidence_head=False, sample_from_anchor=True,
          architectures=["DFlashDraftModel"]), "drafter.sample_from_anchor", True, "sample_from_anchor false"),
])
def test_config_refusals(over, field, value, fix):
    with pytest.raises(ConfigError) as e:
        DrafterSpec.from_hf_config(_config(**over))
    assert (e.value.field, e.value.value) == (field, value), str(e.value)
    assert fix is None or fix in e.value.fix, str(e.value)


@pytest.mark.parametrize("head_type, anchor, draft_vocab", [("rnn", True, 64), ("gated", False, None)])
def test_own_writer_round_trip(tiny_dirs, tmp_path, head_type, anchor, draft_vocab):
    """A DSpark drafter written in speculators' layout by our writer loads back with the same spec, the same
    tensors (heads under ``dspark.``) and the same drafts and confidence."""
    tdir = tiny_dirs["llama"][0]
    target, _ = load_pair(*tiny_dirs["llama"], dtype=torch.float64)
    model = random_dspark_drafter(target.spec, head_type, anchor, draft_vocab)
    out = speculators.write_speculators_drafter(tmp_path / "spec", model, target.spec, tdir, dtype=torch.float64)
    names = set(load_file(str(out / "model.safetensors")))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias"} <= names
    _, loaded = load_pair(tdir, out, dtype=torch.float64)
    assert loaded.spec == model.spec
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    taps = torch.randn(1, 9, model.spec.num_taps * model.spec.hidden_size, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))

    def drafts(drafter):
        cache = drafter.new_cache(1, 64)
        with torch.inference_mode():
            drafter.inject(taps, torch.tensor([9]), cache)
            return draft_block(torch.tensor([11]), drafter.spec.block_size, drafter.spec.mask_token_id, target.embed,
                               lambda e: drafter.draft(e, cache), target.logits, own_head=drafter.draft_head,
                               heads=drafter.dspark, scores=True)

    (want, want_conf), (got, got_conf) = drafts(model), drafts(loaded)
    assert torch.equal(got, want) and torch.equal(got_conf, want_conf)


def test_routes_without_the_heads_refuse_dspark(tiny_dirs, tmp_path):
    """The z-lab layout and the TensorRT-LLM checkpoint converter have no Markov or confidence head: refused by
    name, never converted as the backbone alone."""
    from trtllm_dflash.convert.checkpoint import convert

    tdir = tiny_dirs["llama"][0]
    target_spec = TargetSpec.load(tdir)
    drafter = random_dspark_drafter(target_spec, draft_vocab=None)
    with pytest.raises(ConfigError, match="Markov or confidence head"):
        drafter.spec.to_hf_config(target=target_spec)
    out = speculators.write_speculators_drafter(tmp_path / "spec", drafter, target_spec, tdir, dtype=torch.float32)
    with pytest.raises(ConfigError) as e:
        convert(tdir, out, tmp_path / "ckpt", dtype="float32")
    assert (e.value.field, e.value.value) == ("drafter.speculators_model_type", "dspark")
    assert "DSparkDecodingConfig" in e.value.fix
    # a head derived from the target's rows (``--draft-vocab``) would not match the Markov head's vocabulary
    import numpy as np

    from trtllm_dflash.models import draft_vocab

    vocab_file = draft_vocab.write(out / draft_vocab.DRAFT_VOCAB_FILE, np.arange(0, 256, 2), {})
    with pytest.raises(ConfigError) as e:
        load_pair(tdir, out)
    assert (e.value.field, e.value.value) == ("--draft-vocab", str(vocab_file)) and "full" in e.value.fix
    assert load_pair(tdir, out, draft_vocab="full")[1].draft_head is None


def test_triton_drafter_model_drafts_with_the_heads(tiny_dirs, tmp_path, capsys):
    """make-repo --backend torch with a DSpark drafter: the Triton drafter step model loads its heads and drafts the
    tokens, and keeps the confidence, of the in-process draft (both through ``draft_block``)."""
    from trtllm_dflash.cli import main
    from trtllm_dflash.serve.settings import ModelSettings
    from trtllm_dflash.serve.triton.handlers import DrafterStepModel
    from trtllm_dflash.serve.triton.render import config_parameters

    tdir = tiny_dirs["llama"][0]
    target, _ = load_pair(*tiny_dirs["llama"])
    drafter = random_dspark_drafter(target.spec, "rnn", anchor=True, draft_vocab=64, dtype=torch.float32)
    out = speculators.write_speculators_drafter(tmp_path / "spec", drafter, target.spec, tdir, dtype=torch.float32)
    assert main(["make-repo", "--target", str(tdir), "--drafter", str(out), "--out", str(tmp_path / "repo"),
                 "--max-seq-len", "64", "--max-sequences", "2"]) == 0
    capsys.readouterr()
    text = (tmp_path / "repo" / "drafter" / "config.pbtxt").read_text()
    served = DrafterStepModel(ModelSettings.from_parameters(config_parameters(text))).drafter
    assert served.drafter.dspark is not None and served.scored
    spec = drafter.spec
    taps = torch.randn(1, 9, spec.num_taps * spec.hidden_size, generator=torch.Generator().manual_seed(4))
    k, v = drafter.context_kv(taps, torch.arange(9)[None])  # [L, 1, 9, kv, d]
    got = served.draft([0], [k[:, 0]], [v[:, 0]], [11], spec.block_size)
    cache = drafter.new_cache(1, 64)
    with torch.inference_mode():
        drafter.inject(taps, torch.tensor([9]), cache)
        want, conf = draft_block(torch.tensor([11]), spec.block_size, spec.mask_token_id, target.embed,
                                 lambda e: drafter.draft(e, cache), target.logits, own_head=drafter.draft_head,
                                 heads=drafter.dspark, scores=True)
    assert torch.equal(got, want)
    assert served.forecast(0) == pytest.approx(conf[0].tolist(), abs=1e-6)  # float32, the same modules


@pytest.mark.slow
def test_served_auto_loop_gets_the_confidence(smollm2, tmp_path):
    """Through a real Triton server (``make-repo --block-size auto``, torch backend): the drafter step model returns
    the confidence head's estimates with each drafted block (the in-process draft's, over gRPC), the repository's
    ``auto`` settings tell the loop to ask for them, and the served DSpark loop stays lossless."""
    pytest.importorskip("tritonclient.grpc")
    import json

    import numpy as np
    import tritonclient.grpc as grpcclient

    from conftest import grpc_inputs, write_tiny_smol
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams
    from trtllm_dflash.serve.triton.render import ADAPTIVE_FILE, RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer

    tdir = write_tiny_smol(tmp_path / "tiny-smol", smollm2["target"], num_layers=6)  # room for the drafter's taps
    target_spec = TargetSpec.load(tdir)
    drafter = random_dspark_drafter(target_spec, dtype=torch.float32)
    ddir = speculators.write_speculators_drafter(tmp_path / "dspark", drafter, target_spec, tdir, dtype=torch.float32)
    repo = make_repo(RepoConfig(str(tdir), str(ddir), block_size="auto", max_seq_len=256, max_sequences=4,
                                trtllm_names=False), tmp_path / "repo")
    assert json.loads((repo / "dflash_bls" / "1" / ADAPTIVE_FILE).read_text())["confidence"] is True

    spec = drafter.spec
    taps = torch.randn(1, 9, spec.num_taps * spec.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        k, v = drafter.context_kv(taps, torch.arange(9)[None])  # [L, 1, 9, kv, d]
    cache = drafter.new_cache(1, 64)
    target = load_pair(tdir, ddir, dtype=torch.float32)[0]
    with torch.inference_mode():
        drafter.inject(taps, torch.tensor([9]), cache)
        want, conf = draft_block(torch.tensor([11]), spec.block_size, spec.mask_token_id, target.embed,
                                 lambda e: drafter.draft(e, cache), target.logits, own_head=drafter.draft_head,
                                 heads=drafter.dspark, scores=True)
    with TritonServer(repo, log_path=tmp_path / "server.log") as server:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        draft = {"mode": np.zeros((1, 1), np.int32), "seq_id": np.full((1, 1), 77, np.uint64),
                 "ctx_k": np.ascontiguousarray(k.transpose(0, 1).numpy()),
                 "ctx_v": np.ascontiguousarray(v.transpose(0, 1).numpy()),
                 "bonus": np.full((1, 1), 11, np.int32), "ctx_len": np.full((1, 1), 9, np.int32),
                 "block_size": np.full((1, 1), spec.block_size, np.int32)}
        out = c.infer("drafter", grpc_inputs(draft), outputs=[grpcclient.InferRequestedOutput(n)
                                                               for n in ("drafts", "confidence")])
        c.infer("drafter", grpc_inputs({"mode": np.full((1, 1), 2, np.int32), "seq_id": draft["seq_id"]}))
        with DFlashClient(server.grpc_url) as client:
            answers = {m: client.generate(m, GenerateParams("Write a haiku about rain.", 24)).token_ids
                       for m in ("dflash", "baseline")}
    assert out.as_numpy("drafts").tolist() == want.tolist()
    np.testing.assert_allclose(out.as_numpy("confidence"), conf.numpy(), atol=1e-6)
    assert answers["dflash"] == answers["baseline"] and answers["dflash"]
