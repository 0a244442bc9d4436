"""make-repo --backend trtllm-engine: rendering from fake engine dirs, the executor/Session adapter's pure parts checked
against facts recorded from TensorRT-LLM 1.2.1 (tests/data/trtllm_1_2_1/runtime_api.json), and the shared loop run
over the engine verifier with a stand-in executor (the tiny torch target) — lossless like the torch path."""

import asyncio
import json
import types
from pathlib import Path

import pytest
import torch

from conftest import greedy_reference
from trtllm_dflash.engine import contract
from trtllm_dflash.errors import ArtifactError, ConfigError
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.serve.trtllm import engine as te
from trtllm_dflash.runtime.local import LocalSteps
from trtllm_dflash.runtime.stepper import run_generation
from trtllm_dflash.runtime.protocol import GenerateRequest
from trtllm_dflash.serve.triton.render import MODELS, RepoConfig, make_repo
from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead

FACTS = json.loads((Path(__file__).parents[1] / "data" / "trtllm_1_2_1" / "runtime_api.json").read_text())
API = FACTS["executor"]


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def write_engines(root: Path, block_size=16, max_draft_len=15, drop=None, bad_key=None, taps=None) -> Path:
    for name in contract.ENGINES:
        if name == drop:
            continue
        (root / name).mkdir(parents=True)
        cfg = {"version": "1.2.1", "pretrained_config": {"dtype": "float16", "architecture": "x"},
               "build_config": {"max_batch_size": 8, "max_draft_len": max_draft_len if name == "target" else 0}}
        cfg.pop(bad_key, None)
        (root / name / "config.json").write_text(json.dumps(cfg))
        (root / name / "rank0.engine").write_bytes(b"not a real plan")
    manifest = {"format": 1, "block_size": block_size}  # engine/build.py writes these keys (and more)
    if taps is not None:
        manifest["target_layer_ids"] = taps
    (root / te.BUILD_MANIFEST).write_text(json.dumps(manifest))
    return root


def test_render_trtllm_engine_repo(tiny_dirs, tmp_path):
    t, d = tiny_dirs["llama"]
    engines = write_engines(tmp_path / "eng")
    out = make_repo(RepoConfig(str(t), str(d), "trtllm-engine", 8, max_seq_len=256, engines_dir=str(engines)),
                    tmp_path / "repo")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(MODELS)
    for model in MODELS:
        assert "${" not in (out / model / "config.pbtxt").read_text()
    for step in ("target_verify", "kv_inject", "drafter"):
        text = (out / step / "config.pbtxt").read_text()
        assert 'key: "backend" value: { string_value: "trtllm-engine" }' in text
        assert f'string_value: "{engines.resolve()}"' in text
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "trtllm-engine" and set(manifest["engines"]) == set(contract.ENGINES)
    assert "plugin.trt" in manifest["plugin_preload"]
    from trtllm_dflash.engine.build import MANIFEST

    assert te.BUILD_MANIFEST == MANIFEST  # the file `trtllm-dflash build` writes
    torch_repo = make_repo(RepoConfig(str(t), str(d), block_size=8, max_seq_len=256), tmp_path / "torch")
    assert 'string_value: "torch"' in (torch_repo / "drafter" / "config.pbtxt").read_text()
    for model in ("dflash", "baseline", "dflash_bls", "preprocessing", "postprocessing"):  # the shared models
        assert (out / model / "config.pbtxt").read_text() == (torch_repo / model / "config.pbtxt").read_text()


@pytest.mark.parametrize("kind,kw,match", [
    ("artifact", {"drop": "kv_inject"}, r"kv_inject/config.json: missing"),
    ("config", {"bad_key": "build_config"}, r"target/config.json keys=\['build_config'\]"),
    ("config", {"block_size": 4}, r"--block-size=8: must be in \[2, 4\]"),
    ("config", {"max_draft_len": 3}, r"max_draft_len=3: must be >= block_size - 1 = 7"),
    ("config", {"taps": [0, 1, 2, 99]}, r"target_layer_ids=\[0, 1, 2, 99\]: must equal the drafter's"),
])
def test_engine_dir_validation(tiny_dirs, tmp_path, kind, kw, match):
    t, d = tiny_dirs["llama"]
    engines = write_engines(tmp_path / "eng", **kw)
    err = ArtifactError if kind == "artifact" else ConfigError
    with pytest.raises(err, match=match):
        make_repo(RepoConfig(str(t), str(d), "trtllm-engine", 8, max_seq_len=256, engines_dir=str(engines)),
                  tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    with pytest.raises(ConfigError, match="--engines=.*is only used by --backend trtllm-engine"):
        RepoConfig(str(t), str(d), "torch", 8, engines_dir=str(engines)).validate()


def test_cli_engine_backend_and_serve_refusal(tiny_dirs, tmp_path, capsys):
    from trtllm_dflash.cli import main

    t, d = tiny_dirs["llama"]
    engines = write_engines(tmp_path / "eng")
    assert main(["make-repo", "--target", str(t), "--drafter", str(d), "--backend", "trtllm-engine", "--engines",
                 str(engines), "--out", str(tmp_path / "r"), "--block-size", "8", "--max-seq-len", "256"]) == 0
    capsys.readouterr()
    assert main(["serve", "--repo", str(tmp_path / "r")]) == 2  # no tensorrt_llm on this machine
    assert "needs TensorRT-LLM" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# Contract: every kwarg we build is a recorded binding name


def test_request_kwargs_are_recorded_binding_names():
    sampled = SamplingParams(0.7, 20, 0.9, 3)
    for sampling in (SamplingParams(), sampled):
        for drafts, taps in (([4, 5, 6], True), ([], False)):
            kw = te.request_kwargs([1, 2, 3], drafts, sampling, taps)
            assert set(kw) <= set(API["Request"])
            assert set(kw["sampling_config"]) <= set(API["SamplingConfig"])
            assert set(kw["output_config"]) <= set(API["OutputConfig"])
            for o in kw["output_config"].get("additional_model_outputs", []):
                assert set(o) <= set(API["AdditionalModelOutput"]) and o["name"] == contract.TAPS_OUTPUT
            if drafts:
                assert set(kw["external_draft_tokens_config"]) <= set(API["ExternalDraftTokensConfig"])
                assert kw["max_tokens"] == len(drafts) + 1
    assert te.request_kwargs([1], [], SamplingParams(), False)["sampling_config"] == {"beam_width": 1, "top_k": 1}
    assert te.request_kwargs([1], [], sampled, False)["sampling_config"]["temperature"] == pytest.approx(0.7)
    cfg = te.executor_config_kwargs(8)
    assert set(cfg) <= set(API["ExecutorConfig"]) and set(cfg["kv_cache_config"]) <= set(API["KvCacheConfig"])
    assert cfg["kv_cache_config"]["enable_block_reuse"] is True
    assert cfg["additional_model_outputs"] == [{"name": contract.TAPS_OUTPUT, "gather_context": True}]
    assert te.TAPS_CONTEXT_OUTPUT == API["additional_output_prefixes"]["context"] + contract.TAPS_OUTPUT
    assert "DECODER_ONLY" in API["ModelType"]
    assert {"from_serialized_engine"} <= set(FACTS["session"]["Session"]["constructors"])
    assert FACTS["session"]["Session"]["methods"]["run"][:3] == ["inputs", "outputs", "stream"]


def test_binding_translation_with_a_fake_module():
    """_binding turns the plain dicts into binding objects: positional input_token_ids/max_tokens, nested configs."""
    made = []

    def cls(name):
        def ctor(*args, **kwargs):
            made.append((name, args, kwargs))
            return (name, args, kwargs)
        return ctor

    names = ["Request", "SamplingConfig", "OutputConfig", "ExternalDraftTokensConfig", "KvCacheConfig",
             "AdditionalModelOutput", "ExecutorConfig"]
    tle = types.SimpleNamespace(**{n: cls(n) for n in names})
    req = te._binding(tle, "Request", te.request_kwargs([1, 2], [3], SamplingParams(), True))
    assert req[0] == "Request" and req[1] == ([1, 2], 2)
    assert req[2]["external_draft_tokens_config"] == ("ExternalDraftTokensConfig", (), {"tokens": [3]})
    out_cfg = req[2]["output_config"][2]
    assert out_cfg["additional_model_outputs"] == [("AdditionalModelOutput", (), {"name": contract.TAPS_OUTPUT,
                                                                                  "gather_context": True})]
    ex = te._binding(tle, "ExecutorConfig", te.executor_config_kwargs(4))
    assert ex[2]["kv_cache_config"][0] == "KvCacheConfig"


# ---------------------------------------------------------------------------------------------------------------------
# Output parsing: the torch path's acceptance rule


@pytest.mark.parametrize("drafts,output,accepted", [
    ([7, 8, 9, 10, 11, 12, 13], [7, 8, 5, 4], 2),  # mismatch at d_3; a continuation token after the bonus
    ([7, 8, 9, 10, 11, 12, 13], [7, 8, 9, 10, 11, 12, 13, 99], 7),  # all accepted + bonus
    ([7, 8, 9, 10, 11, 12, 13], [1, 7, 8], 0),  # first draft rejected: only the bonus
    ([7, 8, 9, 10, 11, 12, 13], [7, 8, 9], 2),  # short output (executor stopped): a capped at len − 1
    ([], [42, 43], 0),  # prefill / baseline step
])
def test_parse_step_matches_torch_rule(drafts, output, accepted):
    from trtllm_dflash.runtime.sampling import accepted_lengths

    P = 5
    width = 6
    taps = torch.arange((P + len(drafts)) * width, dtype=torch.float32).reshape(-1, width)  # row i = position i
    step = te.parse_step(drafts, output, taps, P)
    assert step.accepted == accepted and step.emitted == output[: accepted + 1]
    assert torch.equal(step.taps, taps[P - 1: P + accepted])  # [bonus, d_1..d_a]
    if drafts and len(output) == len(drafts) + 1:
        ref = accepted_lengths(torch.tensor([drafts]), torch.tensor([output]))  # the torch path on the same samples
        assert int(ref[0]) == accepted
    with pytest.raises(ConfigError, match="must cover positions"):
        te.parse_step(drafts, output, taps[: P - 1 + accepted], P)  # no rows for the drafts


def test_additional_output_lookup():
    assert te.additional_output([("generation_x", 1), (te.TAPS_CONTEXT_OUTPUT, 2)], te.TAPS_CONTEXT_OUTPUT) == 2
    with pytest.raises(ConfigError, match="has no 'context_dflash_taps'"):
        te.additional_output([("generation_dflash_taps", 1)], te.TAPS_CONTEXT_OUTPUT)


def test_sequence_book_and_context_cache():
    book = te.SequenceBook(2, 64, 120.0)
    book.start(1, [5, 6, 7], SamplingParams())
    book.state[1].tokens.append(9)
    assert book.get(1, [9, 1, 2]).tokens == [5, 6, 7, 9]
    with pytest.raises(ConfigError, match="must be the sequence's bonus token 9"):
        book.get(1, [8, 1])
    book.start(2, [1], SamplingParams())
    with pytest.raises(ConfigError, match="slots are in use"):
        book.start(3, [1], SamplingParams())
    assert book.free(1) and not book.free(1) and 1 not in book.state
    with pytest.raises(ConfigError, match="not a live sequence"):
        book.get(1, [9])
    for sampling, match in ((SamplingParams(bad_words=((4,),)), r"bad_words=\[\[4\]\]: is not supported"),
                            (SamplingParams(logit_bias=((4, 1.0),)), r"logit_bias=\[4\]: is not supported")):
        with pytest.raises(ConfigError, match=match):  # refused by name, holding no slot
            book.start(3, [1], sampling)
    assert 3 not in book.state

    cache = te.ContextCache(2, 3, 10, 1, 4, torch.float32, "cpu")
    cache.append(0, torch.ones(2, 3, 1, 4), torch.ones(2, 3, 1, 4))
    cache.append(2, torch.full((2, 5, 1, 4), 2.0), torch.full((2, 5, 1, 4), 2.0))
    cache.append(0, torch.full((2, 1, 1, 4), 3.0), torch.full((2, 1, 1, 4), 3.0))
    k, v, lens = cache.gather([2, 0])
    assert k.shape == (2, 2, 5, 1, 4) and lens.tolist() == [5, 4] and lens.dtype == torch.int32
    assert k[0, 1, :4, 0, 0].tolist() == [1, 1, 1, 3]
    with pytest.raises(ConfigError, match="exceeds the context cache"):
        cache.append(2, torch.ones(2, 6, 1, 4), torch.ones(2, 6, 1, 4))
    blk = te.drafter_block_inputs([11, 12], 4, 5, [5, 4])
    assert set(blk) | {"ctx_k", "ctx_v", "ctx_lens"} == {t.name for t in contract.DRAFTER_INPUTS}
    assert blk["block_ids"].tolist() == [[11, 5, 5, 5], [12, 5, 5, 5]]
    assert blk["position_ids"].tolist() == [[5, 6, 7, 8], [4, 5, 6, 7]]


def test_engine_step_classes_use_contract_tensor_names():
    seen = {}

    def fake_engine(outputs):
        def run(inputs):
            seen.update(inputs)
            return outputs(inputs)
        return run

    inj = te.EngineKVInjector.__new__(te.EngineKVInjector)
    inj.dtype = torch.float16
    inj.engine = fake_engine(lambda i: {"ctx_k": torch.zeros(2, i["taps"].shape[0], 1, 4), "ctx_v": None})
    k, _ = inj(torch.ones(3, 8), 7)
    assert set(seen) == {t.name for t in contract.KV_INJECT_INPUTS} and k.shape == (2, 3, 1, 4)
    assert seen["position_ids"].tolist() == [7, 8, 9] and seen["taps"].dtype == torch.float16

    seen.clear()
    dr = te.EngineBlockDrafter.__new__(te.EngineBlockDrafter)
    dr.spec = types.SimpleNamespace(block_size=4, mask_token_id=5)
    dr.slots = te.SlotTable(2, 120.0)
    dr.cache = te.ContextCache(2, 2, 16, 1, 4, torch.float32, "cpu")
    dr.engine = fake_engine(lambda i: {"draft_ids": i["block_ids"][:, 1:] + 100})
    drafts = dr.draft([7], [torch.ones(2, 3, 1, 4)], [torch.ones(2, 3, 1, 4)], [11], 4)
    assert set(seen) == {t.name for t in contract.DRAFTER_INPUTS}
    assert drafts.tolist() == [[105, 105, 105]] and seen["ctx_lens"].tolist() == [3]
    assert seen["position_ids"].tolist() == [[3, 4, 5, 6]]


# ---------------------------------------------------------------------------------------------------------------------
# The shared loop over the engine verifier, with the tiny torch target standing in for the executor


class TorchExecutorVerifier(te.EngineTargetVerifier):
    """EngineTargetVerifier whose executor is emulated by the torch target (recompute from scratch, greedy): returns
    what the recorded executor contract says — generated tokens (input excluded, one extra continuation token past
    the bonus, as a max_tokens = len(drafts)+1 request may produce) and context taps for prompt + drafts."""

    def __init__(self, target, tap_layers, max_sequences, max_seq_len):
        self.target, self.tap_layers = target, tap_layers
        self.book = te.SequenceBook(max_sequences, max_seq_len, 120.0)
        self.slots = self.book.slots
        self.requests = []

    def _run(self, kwargs):
        out = []
        for kw in kwargs:
            self.requests.append(kw)
            assert set(kw) <= set(API["Request"])
            drafts = kw.get("external_draft_tokens_config", {}).get("tokens", [])
            ids = kw["input_token_ids"] + drafts
            cache = self.target.new_cache(1, len(ids) + 1)
            with torch.inference_mode():
                hidden, taps = self.target(torch.tensor([ids]), cache, torch.tensor([0]), self.tap_layers)
                x = self.target.logits(hidden[0, len(kw["input_token_ids"]) - 1:]).argmax(-1).tolist()
            a = next((i for i, d in enumerate(drafts) if d != x[i]), len(drafts))
            want = "additional_model_outputs" in kw["output_config"]
            out.append((x[: a + 1] + [0], taps[0] if want else None))
        return out


@pytest.mark.parametrize("block_size", [1, 4])
def test_loop_over_engine_verifier_is_lossless(tiny_dirs, tiny_models, block_size):
    from test_serving_render import OracleSteps

    target, drafter = tiny_models["qwen3"]
    prompt = [9, 8, 7, 6, 5, 4]
    ref = list(greedy_reference(target, [prompt], 24)[0])
    verifier = TorchExecutorVerifier(target, drafter.spec.target_layer_ids, 2, 256)

    class Steps(OracleSteps):
        async def draft(self, seq_id, k, v, bonus, block_size):  # oracle drafts keyed by the book's committed tokens
            real = await LocalSteps.draft(self, seq_id, k, v, bonus, block_size)
            emitted = len(self.verifier.book.state[seq_id].tokens) - self.prompt_len
            return [self.ref[emitted + i] if emitted + i < len(self.ref) and i % 3 != 2 else real[i]
                    for i in range(block_size - 1)]

    steps = Steps(verifier, KVInjector(drafter), BlockDrafter(drafter, TargetHead(tiny_dirs["qwen3"][0],
                  torch.float64), 2, 256), ref=ref, prompt_len=len(prompt))
    updates = []

    async def on_update(u):
        updates.append(u)

    req = GenerateRequest(tuple(prompt), 24, SamplingParams(), (), True)
    asyncio.run(run_generation(steps, req, block_size, 3, on_update))
    assert updates[-1].final and updates[-1].tokens == ref
    taus = [t for u in updates for t in u.acceptance_lengths]
    assert all(1 <= t <= block_size for t in taus) and (block_size == 1 or max(taus) > 1)
    assert not verifier.book.state and not verifier.slots.rows
    assert all(r["input_token_ids"][: len(prompt)] == prompt for r in verifier.requests)
