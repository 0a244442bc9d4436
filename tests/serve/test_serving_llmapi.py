"""make-repo --backend trtllm-pytorch: the rendered LLM-API repository against facts recorded from TensorRT-LLM >= 1.3
(tests/data/trtllm_llmapi/llmapi_facts.json), identical ensemble I/O across backends, and the bridge's mappings."""

import asyncio
import json
import re
import types
from pathlib import Path

import numpy as np
import pytest
import yaml

from trtllm_dflash.errors import ArtifactError, ConfigError
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.serve.trtllm import compat, llmapi
from trtllm_dflash.serve.triton.render import LLMAPI_MODELS, RepoConfig, make_repo
from trtllm_dflash.specs import DrafterSpec

FACTS = json.loads((Path(__file__).parents[1] / "data" / "trtllm_llmapi" / "llmapi_facts.json").read_text())


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def pbtxt_io(text: str) -> dict[str, list[tuple]]:
    """{'input': [(name, data_type, dims, optional)], 'output': [...]} of a config.pbtxt (top-level blocks only)."""
    out = {}
    for kind in ("input", "output"):
        block = re.search(rf"^{kind} \[(.*?)^\]", text, re.S | re.M)
        out[kind] = [(m[0], m[1], m[2].replace(" ", ""), "optional: true" in m[3]) for m in re.findall(
            r'\{ name: "(\w+)" data_type: (\w+) dims: \[([^\]]*)\]([^}]*)\}', block.group(1))] if block else []
    return out


@pytest.fixture(scope="module")
def repos(tiny_dirs, tmp_path_factory):
    t, d = tiny_dirs["qwen3"]
    root = tmp_path_factory.mktemp("llmapi")
    ckpt = root / "hf"  # a fake modelopt unified-HF export: the target's config + a quantization block
    ckpt.mkdir()
    cfg = json.loads((Path(t) / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "modelopt"}}))
    for f in Path(t).iterdir():
        if f.name != "config.json":
            (ckpt / f.name).symlink_to(f)
    llm = make_repo(RepoConfig(str(ckpt), str(d), "trtllm-pytorch", 8, max_seq_len=256, checkpoint_dir=str(ckpt)),
                    root / "llm")
    torch_repo = make_repo(RepoConfig(str(t), str(d), block_size=8, max_seq_len=256), root / "torch")
    return llm, torch_repo, ckpt, Path(d)


def test_rendered_llmapi_repo(repos):
    llm, _, ckpt, drafter = repos
    assert sorted(p.name for p in llm.iterdir() if p.is_dir()) == sorted(LLMAPI_MODELS)
    for model in LLMAPI_MODELS:
        assert "${" not in (llm / model / "config.pbtxt").read_text()
    manifest = json.loads((llm / "manifest.json").read_text())
    for model in ("tensorrt_llm_dflash", "tensorrt_llm_baseline"):
        assert not (llm / model / "1" / "model.py").exists()  # NVIDIA's, copied in by the Dockerfile
        assert "llmapi/tensorrt_llm/1/model.py" in manifest["model_py_source"][model]
        assert "${" not in (llm / model / "1" / "model.yaml").read_text()
    assert set(manifest["derived_outputs"]) >= {"output_ids", "acceptance_lengths"} and "end_id" in \
        manifest["unavailable_inputs"]
    spec = yaml.safe_load((llm / "tensorrt_llm_dflash" / "1" / "model.yaml").read_text())
    base = yaml.safe_load((llm / "tensorrt_llm_baseline" / "1" / "model.yaml").read_text())
    ds = DrafterSpec.load(drafter)
    assert spec["speculative_config"] == {"decoding_type": "DFlash", "max_draft_len": 7,
                                          "speculative_model": str(drafter.resolve()),
                                          "target_layer_ids": list(ds.target_layer_ids),
                                          "mask_token_id": ds.mask_token_id}
    assert "speculative_config" not in base and spec["model"] == base["model"] == str(ckpt.resolve())
    assert 'string_value: "7"' in (llm / "dflash_llmapi" / "config.pbtxt").read_text()
    assert 'string_value: "tensorrt_llm_baseline"' in (llm / "baseline_llmapi" / "config.pbtxt").read_text()


def test_model_yaml_keys_are_recorded_llmapi_facts(repos):
    llm = repos[0]
    facts = FACTS["llmapi_model_yaml"]
    dfc = FACTS["DFlashDecodingConfig"]
    for model in ("tensorrt_llm_dflash", "tensorrt_llm_baseline"):
        cfg = yaml.safe_load((llm / model / "1" / "model.yaml").read_text())
        assert set(cfg) <= set(facts["top_level_keys"])
        assert set(cfg["triton_config"]) <= set(facts["triton_config_keys"])
        assert cfg["triton_config"] == {"max_batch_size": 0, "decoupled": True}
        assert set(cfg["kv_cache_config"]) <= set(FACTS["kv_cache_config_keys"])
        if "speculative_config" in cfg:
            assert set(cfg["speculative_config"]) <= set(dfc["fields"])
            assert cfg["speculative_config"]["decoding_type"] == dfc["decoding_type"]


def test_llmapi_model_config_matches_recorded_io(repos):
    llm = repos[0]
    facts = FACTS["llmapi_config_pbtxt"]
    io = pbtxt_io((llm / "tensorrt_llm_dflash" / "config.pbtxt").read_text())
    assert {n: t for n, t, *_ in io["input"]} == facts["inputs"]
    assert {n: t for n, t, *_ in io["output"]} == facts["outputs"]
    assert not re.search(r"^max_batch_size", (llm / "tensorrt_llm_dflash" / "config.pbtxt").read_text(), re.M)
    sent = llmapi.llmapi_inputs(llmapi.BridgeRequest("hi", 8, True, SamplingParams(0.5, 10, 0.9, 2), ("x",)))
    assert set(sent) <= set(facts["inputs"])
    greedy = llmapi.llmapi_inputs(llmapi.BridgeRequest("hi", 8, False, SamplingParams()))
    assert greedy["sampling_param_top_k"].tolist() == [1] and "sampling_param_temperature" not in greedy
    assert {"text_output", "total_draft_tokens", "total_accepted_draft_tokens"} <= set(facts["outputs"])


def test_ensemble_io_identical_across_backends(repos):
    llm, torch_repo, *_ = repos
    for ens in ("dflash", "baseline"):
        a = pbtxt_io((llm / ens / "config.pbtxt").read_text())
        b = pbtxt_io((torch_repo / ens / "config.pbtxt").read_text())
        assert a == b and len(a["input"]) == 10 + len(compat.INPUTS) and len(a["output"]) == 5 + len(compat.OUTPUTS)
        bridge = pbtxt_io((llm / f"{ens}_llmapi" / "config.pbtxt").read_text())
        assert bridge == a  # the single ensemble step takes and returns exactly the ensemble's tensors
        assert f'model_name: "{ens}_llmapi"' in (llm / ens / "config.pbtxt").read_text()


def test_llmapi_validation(tiny_dirs, tmp_path):
    t, d = tiny_dirs["qwen3"]
    with pytest.raises(ConfigError, match="--checkpoint=None: is required by --backend trtllm-pytorch"):
        RepoConfig(str(t), str(d), "trtllm-pytorch", 8, max_seq_len=256).validate()
    with pytest.raises(ArtifactError, match="config.json: missing"):
        RepoConfig(str(t), str(d), "trtllm-pytorch", 8, max_seq_len=256, checkpoint_dir=str(tmp_path)).validate()
    with pytest.raises(ConfigError, match="--checkpoint=.*is only used by --backend trtllm-pytorch"):
        RepoConfig(str(t), str(d), "torch", 8, checkpoint_dir=str(t)).validate()


def _dspark_dir(tiny_dirs, tmp_path, **over) -> Path:
    """A full-vocabulary speculators DSpark drafter directory for the tiny Qwen3 target: its DFlash twin written by
    our writer, the config turned into the DSpark one speculators' save_pretrained writes (the repository reads the
    config only)."""
    import torch

    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.models import speculators

    t, d = tiny_dirs["qwen3"]
    target, zlab = load_pair(t, d)
    out = speculators.write_speculators_drafter(tmp_path / "dspark", zlab, target.spec, t, dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({"architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark", "block_size": 7,
                "sample_from_anchor": True, "markov_rank": 32, "markov_head_type": "gated",
                "enable_confidence_head": True, "confidence_head_with_markov": True, **over})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("head_type", FACTS["DSparkDecodingConfig"]["markov_head_type"])
def test_dspark_maps_to_dspark_decoding_config(tiny_dirs, tmp_path, head_type):
    """A DSpark drafter's repository carries DSparkDecodingConfig: its trained block (7; an anchor-predicting block
    drafts 7 tokens, so max_draft_len 7), the Markov head's rank and type, every key one TensorRT-LLM records."""
    t = str(tiny_dirs["qwen3"][0])
    drafter = _dspark_dir(tiny_dirs, tmp_path, markov_head_type=head_type)
    llm = make_repo(RepoConfig(t, str(drafter), "trtllm-pytorch", 8, max_seq_len=256, checkpoint_dir=t),
                    tmp_path / "llm")
    spec = yaml.safe_load((llm / "tensorrt_llm_dflash" / "1" / "model.yaml").read_text())["speculative_config"]
    ds, dsc = DrafterSpec.load(drafter), FACTS["DSparkDecodingConfig"]
    assert spec == {"decoding_type": "DSpark", "max_draft_len": 7, "speculative_model": str(drafter.resolve()),
                    "target_layer_ids": list(ds.target_layer_ids), "mask_token_id": ds.mask_token_id,
                    "block_size": 7, "markov_rank": 32, "markov_head_type": head_type}
    assert set(spec) <= set(dsc["fields"]) and spec["decoding_type"] == dsc["decoding_type"]
    assert spec["markov_head_type"] in dsc["markov_head_type"]
    with pytest.raises(ConfigError) as e:  # the engine drafter has no Markov head: refused, not degraded
        RepoConfig(t, str(drafter), "trtllm-engine", 8, engines_dir=str(tmp_path), max_seq_len=256).validate()
    assert (e.value.field, e.value.value) == ("drafter.speculators_model_type", "dspark")
    assert "trtllm-pytorch" in e.value.fix


def test_cli_trtllm_pytorch_defaults_target_to_checkpoint(tiny_dirs, tmp_path, capsys):
    from trtllm_dflash.cli import main

    t, d = tiny_dirs["qwen3"]
    assert main(["make-repo", "--backend", "trtllm-pytorch", "--checkpoint", str(t), "--drafter", str(d),
                 "--out", str(tmp_path / "r"), "--max-seq-len", "256"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["models"]) == sorted(LLMAPI_MODELS)
    assert main(["make-repo", "--drafter", str(d), "--out", str(tmp_path / "r2")]) == 2
    assert "--target=None: is required by --backend torch" in capsys.readouterr().err


def test_bridge_updates_derive_deltas_and_stats():
    st = llmapi.BridgeState(max_draft_len=7)
    u1 = llmapi.bridge_update(st, "Hello", [1, 2], 7, 3)  # one drafting step: 3 of 7 accepted -> tau 4
    assert (u1.text_delta, u1.acceptance_lengths, u1.num_draft_tokens, u1.num_accepted_draft_tokens) == \
        ("Hello", [4], 7, 3)
    u2 = llmapi.bridge_update(st, "Hello world", [1, 2, 3], 21, 10)  # two steps in one response: no per-step tau
    assert (u2.text_delta, u2.acceptance_lengths, u2.num_draft_tokens, u2.num_accepted_draft_tokens) == \
        (" world", [], 14, 7)
    u3 = llmapi.bridge_update(st, "Hello world!", [1, 2, 3, 4], None, None)  # no perf metrics in this response
    assert (u3.text_delta, u3.num_draft_tokens) == ("!", 0)
    with pytest.raises(ConfigError, match="must extend the previous response's text"):
        llmapi.bridge_update(st, "Bye", [5], None, None)
    base = llmapi.BridgeState(max_draft_len=0)
    assert llmapi.bridge_update(base, "ab", [1, 2], 0, 0).acceptance_lengths == [1, 1]
    with pytest.raises(ConfigError, match="end_id=2: is not supported by the trtllm-pytorch backend"):
        llmapi.reject_unavailable({"end_id": 2})


class FakePb:
    """Just enough of triton_python_backend_utils for LlmApiBridge, with a scripted llmapi model behind BLS."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonError:
        INVALID_ARG, INTERNAL = 3, 13

        def __init__(self, msg, code=13):
            self.msg = msg

        def message(self):
            return self.msg

    def __init__(self, script):
        self.script, self.calls = script, []

    class Tensor:
        def __init__(self, name, arr):
            self.name, self.arr = name, np.asarray(arr)

        def as_numpy(self):
            return self.arr

    def get_input_tensor_by_name(self, req, name):
        return req.inputs.get(name)

    def get_output_tensor_by_name(self, resp, name):
        return resp.outputs.get(name)

    def InferenceResponse(self, output_tensors=(), error=None):
        return types.SimpleNamespace(outputs={t.name: t.arr for t in output_tensors}, error=error)

    def InferenceRequest(self, model_name, inputs, requested_output_names):
        self.calls.append((model_name, {t.name: t.arr for t in inputs}, requested_output_names))
        pb = self

        class Call:
            async def async_exec(self, decoupled):
                assert decoupled

                async def gen():
                    for text, drafts, acc in pb.script:
                        yield types.SimpleNamespace(has_error=lambda: False, outputs={
                            "text_output": pb.Tensor("text_output", np.array([text.encode()], dtype=object)),
                            "total_draft_tokens": pb.Tensor("t", np.array([drafts], np.int32)),
                            "total_accepted_draft_tokens": pb.Tensor("a", np.array([acc], np.int32))})
                return gen()
        return Call()


def test_bridge_model_over_fake_bls(tiny_dirs):
    t, _ = tiny_dirs["qwen3"]
    pb = FakePb([("ab", 7, 2), ("abc", 14, 2)])
    bridge = llmapi.LlmApiBridge({"llm_model": "tensorrt_llm_dflash", "max_draft_len": "7", "tokenizer_dir": str(t)},
                                 pb)
    sent = []
    sender = types.SimpleNamespace(send=lambda r=None, flags=0: sent.append((r, flags)))

    def request(**inputs):
        return types.SimpleNamespace(inputs={k: pb.Tensor(k, np.asarray(v)[None]) for k, v in inputs.items()},
                                     get_response_sender=lambda: sender)

    asyncio.run(bridge._serve(request(text_input=np.array([b"hi"], dtype=object), max_tokens=np.array([5], np.int32),
                                      stream=np.array([True]))))
    model, inputs, wanted = pb.calls[0]
    assert model == "tensorrt_llm_dflash" and inputs["sampling_param_max_tokens"].tolist() == [5]
    assert inputs["streaming"].tolist() == [True] and "total_draft_tokens" in wanted
    assert [f for _, f in sent] == [0, 1]
    texts = [r.outputs["text_output"][0].decode() for r, _ in sent]  # 1-D, as TensorRT-LLM's
    assert texts == ["ab", "c"] and sent[0][0].outputs["acceptance_lengths"][0].tolist() == [3]
    sent.clear()
    asyncio.run(bridge._serve(request(text_input=np.array([b"hi"], dtype=object), max_tokens=np.array([5], np.int32),
                                      end_id=np.array([2], np.int32))))
    (resp, flags), = sent
    assert flags == 1 and "end_id=2" in resp.error.message()
    # TensorRT-LLM's ensemble inputs (serve/trtllm/compat.py): the prompt echoed when not streaming, each response's own
    # token count and the draft totals so far; min_tokens, which the llmapi model has no input for, refused by name
    sent.clear()
    asyncio.run(bridge._serve(request(text_input=np.array([b"hi"], dtype=object), max_tokens=np.array([5], np.int32),
                                      stream=np.array([True]), return_num_output_tokens=np.array([True]),
                                      return_perf_metrics=np.array([True]))))
    counts = [int(r.outputs["num_output_tokens"][0, 0]) for r, _ in sent]
    assert sum(counts) == len(sent[-1][0].outputs["output_ids"][0]) and len(counts) == 2
    assert [int(r.outputs["total_draft_tokens"][0, 0]) for r, _ in sent] == [7, 14]
    assert sent[-1][0].outputs["acceptance_rate"].tolist() == [[pytest.approx(2 / 14)]]
    sent.clear()
    asyncio.run(bridge._serve(request(text_input=np.array([b"hi"], dtype=object), max_tokens=np.array([5], np.int32),
                                      exclude_input_in_output=np.array([False]))))
    assert sent[-1][0].outputs["text_output"][0].decode() == "hiabc" and sent[-1][1] == 1
    sent.clear()
    asyncio.run(bridge._serve(request(text_input=np.array([b"hi"], dtype=object), max_tokens=np.array([5], np.int32),
                                      min_tokens=np.array([3], np.int32))))
    (resp, flags), = sent
    assert flags == 1 and "min_tokens=3: is not supported by the trtllm-pytorch backend" in resp.error.message()
    # return_log_probs and non-empty bad_words (honoured by the torch backend), which the llmapi model has no input
    # for, refused by name; empty bad words, as TensorRT-LLM's examples send them, accepted
    for extra, words in ((dict(return_log_probs=np.array([True])), "return_log_probs=True: is not supported"),
                         (dict(bad_words=np.array([b"", b"foo"], dtype=object)),
                          "bad_words=['foo']: is not supported"),
                         (dict(embedding_bias_words=np.array([b"foo"], dtype=object),
                               embedding_bias_weights=np.array([2.0], np.float32)),
                          "embedding_bias_words=['foo']: is not supported")):
        sent.clear()
        asyncio.run(bridge._serve(request(text_input=np.array([b"hi"], dtype=object),
                                          max_tokens=np.array([5], np.int32), **extra)))
        (resp, flags), = sent
        assert flags == 1 and words in resp.error.message()
    sent.clear()
    asyncio.run(bridge._serve(request(text_input=np.array([b"hi"], dtype=object), max_tokens=np.array([5], np.int32),
                                      bad_words=np.array([b""], dtype=object))))
    assert sent[-1][1] == 1 and all(r.error is None for r, _ in sent)
    assert "".join(r.outputs["text_output"][0].decode() for r, _ in sent) == "abc"
