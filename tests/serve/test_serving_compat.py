"""Clients written for TensorRT-LLM's Triton ensemble (serve/trtllm/compat.py): the inputs they send are declared with the
ensemble's dtypes and dims, honoured or refused by name; min_tokens is lossless in the runtime."""

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_pair, pbtxt_inputs
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import SamplingParams, ban_tokens
from trtllm_dflash.serve.trtllm import compat
from trtllm_dflash.runtime.protocol import StopMatcher
from trtllm_dflash.serve.triton.render import RepoConfig, make_repo

FACTS = json.loads((Path(__file__).parents[1] / "data" / "trtllm_ensemble" / "ensemble_io.json").read_text())
# the ensemble's inputs not declared here (Triton refuses them naming the input): prompt tables, embedding bias,
# LoRA, guided decoding and the encoder-decoder prompt
NOT_DECLARED = {"decoder_text_input", "prompt_embedding_table", "prompt_table_extra_id", "prompt_vocab_size",
                "lora_task_id", "lora_weights", "lora_config",
                "guided_decoding_guide_type", "guided_decoding_guide"}


def test_the_entry_declares_the_ensembles_inputs_as_tensorrt_llm_does(tiny_dirs, tmp_path):
    t, d = tiny_dirs["llama"]
    repo = make_repo(RepoConfig(str(t), str(d), block_size=4, max_seq_len=128), tmp_path / "repo")
    ours = pbtxt_inputs((repo / "dflash" / "config.pbtxt").read_text())
    theirs = FACTS["inputs"]
    assert set(theirs) - set(ours) == NOT_DECLARED
    for name, fact in theirs.items():
        if name in ours:
            assert ours[name] == (fact["data_type"], fact["dims"], fact["optional"]), name
    # GenAI-Perf 0.0.16's request (min_length: the older name of min_tokens) and TRT-LLM's example client's
    assert set(FACTS["genai_perf_request"]) <= set(ours)
    assert all(ours[n][0] == dtype for n, dtype in FACTS["genai_perf_request"].items())
    assert set(FACTS["end_to_end_grpc_client_request"]) <= set(ours)
    assert all(ours[n][0] == dtype for n, dtype in FACTS["openai_frontend_request"].items())  # Triton's OpenAI API
    for name, (dtype, dims) in compat.OUTPUTS.items():  # the extra outputs carry TRT-LLM's names, dtypes and dims
        assert FACTS["outputs"][name]["data_type"] == dtype
        assert FACTS["outputs"][name]["dims"] == [int(x) for x in dims.split(",")], name


def read_from(values: dict):
    return lambda name, default, kind: kind(values[name]) if name in values else default


@pytest.mark.parametrize("values, message", [
    ({"beam_width": 2}, "beam_width=2: is not supported: speculative decoding here runs one beam; send "
                        "beam_width 1"),
    ({"num_return_sequences": 0}, "num_return_sequences=0: must be at least 1"),
    ({"return_context_logits": True}, "return_context_logits=True: is not supported: logits are not returned; "
                                      "send return_context_logits false"),
    ({"return_generation_logits": True}, "return_generation_logits=True: is not supported"),
    ({"length_penalty": float("nan")}, "length_penalty=nan: must be finite"),
    ({"pad_id": 999}, r"pad_id=999: must be a token id in \[0, 256\)"),
    ({"min_tokens": 9}, r"min_tokens=9: must be in \[0, max_tokens=8\]"),
    ({"min_length": -1}, r"min_length=-1: must be in \[0, max_tokens=8\]"),
    ({"min_tokens": 2, "min_length": 3}, "min_length=3: differs from min_tokens=2"),
])
def test_inputs_this_server_does_not_do_are_refused_by_name(values, message):
    with pytest.raises(ConfigError, match=message):
        compat.parse_options(read_from(values), 8, 256)


def test_neutral_values_and_honoured_inputs_are_accepted():
    neutral = {"beam_width": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "presence_penalty": 0.0,
               "frequency_penalty": 0.0, "return_log_probs": False, "length_penalty": 0.7, "pad_id": 2}
    assert compat.parse_options(read_from(neutral), 8, 256) == compat.Options()
    opts = compat.parse_options(read_from({"min_length": 8, "exclude_input_in_output": False,
                                           "return_perf_metrics": True, "return_num_output_tokens": True}),
                                8, 256)
    assert opts == compat.Options(8, False, True, False, True)
    out = dict(compat.response_outputs(opts, 5, 8, drafted=12, accepted=3))
    assert set(out) == {"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_output_tokens",
                        *compat.KV_CACHE_METRICS}
    assert out["acceptance_rate"].tolist() == [[0.25]] and out["num_output_tokens"].tolist() == [[8]]
    # [batch 1, beam 1], as TensorRT-LLM's tensorrt_llm model sends them and its example client reads them: [0][0]
    assert all(v.shape == (1, 1) for v in out.values())
    assert [out[m][0][0] for m in compat.KV_CACHE_METRICS] == [1, 0, 1]
    assert compat.parse_options(read_from({"num_return_sequences": 3}), 8, 256) == compat.Options(sequences=3)


def test_log_probs_go_out_shaped_as_the_tensorrt_llm_model_sends_them():
    """[batch 1, beam 1, this response's tokens] and [1, 1] the sum over every token so far."""
    opts = compat.parse_options(read_from({"return_log_probs": True}), 8, 256)
    assert opts == compat.Options(log_probs=True)
    out = dict(compat.response_outputs(opts, 5, 2, 0, 0, [-0.5, -1.0, -0.25, -2.0]))
    assert out["output_log_probs"].shape == (1, 1, 2) and out["output_log_probs"].tolist() == [[[-0.25, -2.0]]]
    assert out["cum_log_probs"].tolist() == [[-3.75]] and out["cum_log_probs"].dtype.name == "float32"
    empty = dict(compat.response_outputs(opts, 5, 0, 0, 0, [-0.5]))  # a final response with no new token
    assert empty["output_log_probs"].shape == (1, 1, 0) and empty["cum_log_probs"].tolist() == [[-0.5]]


def test_stops_do_not_count_before_min_tokens():
    stops = ((7,), (3, 4))
    assert StopMatcher(stops).truncate([1, 7, 2], 0) == 1
    assert StopMatcher(stops, min_tokens=2).truncate([1, 7, 2], 0) is None
    assert StopMatcher(stops, min_tokens=2).truncate([1, 7, 2, 7], 0) == 3
    assert StopMatcher(stops, min_tokens=2).truncate([3, 4, 5, 3, 4], 2) == 3  # (3, 4) ending at 2 tokens: ignored


def test_ban_masks_only_the_slots_before_the_position():
    logits = torch.zeros(2, 4, 10)
    logits[..., 5] = 1.0  # every slot's argmax is 5
    p = SamplingParams().with_min_tokens(3, prompt_len=10, end_ids=[5])
    assert p.banned_ids == (5,) and p.banned_before == 13
    out = ban_tokens(logits, [p, SamplingParams()], torch.tensor([11, 11]))
    assert out[0].argmax(-1).tolist() == [0, 0, 5, 5] and out[1].argmax(-1).tolist() == [5, 5, 5, 5]
    assert ban_tokens(logits, [SamplingParams(), SamplingParams()], None) is logits
    tree = ban_tokens(logits, [p, p], torch.tensor([12, 12]), offsets=[0, 1, 1, 0])  # a tree's node depths
    assert tree[0].argmax(-1).tolist() == [0, 5, 5, 0]


@pytest.mark.parametrize("block_size", [4, "auto"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_min_new_tokens_is_lossless_at_any_block_size(tmp_path_factory, block_size, temperature):
    """A target that wants to stop almost at once (its favourite token is a stop): with min_new_tokens the output
    is as long as asked and every decoder kind gives the autoregressive tokens."""
    root = tmp_path_factory.mktemp("pair")
    t, d = make_tiny_pair(root, block_size=4, seed=3)
    target, drafter = load_pair(t, d, dtype=torch.float64)
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(256) for _ in range(rng.randrange(3, 9))) for _ in range(4)]
    sampling = SamplingParams(temperature, seed=11)
    plain = SpeculativeDecoder(target, None, 1).generate([Request(p, 24, sampling) for p in prompts])
    stops = tuple({r.token_ids[1] for r in plain if len(r.token_ids) > 1})  # tokens it does choose early on
    reqs = [Request(p, 24, sampling, stop_token_ids=stops, min_new_tokens=m) for p, m in zip(prompts, (0, 5, 12, 24))]
    ar = SpeculativeDecoder(target, None, 1).generate(reqs)
    assert [len(r.token_ids) >= m for r, m in zip(ar, (0, 5, 12, 24))] == [True] * 4
    assert len(ar[3].token_ids) == 24 and not set(ar[3].token_ids) & set(stops)
    assert any(len(r.token_ids) < 24 for r in SpeculativeDecoder(target, None, 1).generate(
        [Request(p, 24, sampling, stop_token_ids=stops) for p in prompts]))  # without: some stop early
    spec = SpeculativeDecoder(target, drafter, block_size, ngram=True).generate(reqs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    with pytest.raises(ConfigError, match=r"min_new_tokens=25: must be in \[0, max_new_tokens=24\]"):
        SpeculativeDecoder(target, None, 1).generate([Request(prompts[0], 24, min_new_tokens=25)])
