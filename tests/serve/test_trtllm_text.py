"""``preprocessing`` / ``postprocessing`` with TensorRT-LLM's inputs and outputs (serve/trtllm/text.py), against its
recorded models (tests/data/trtllm_ensemble/text_models_io.json), on the real SmolLM2 tokenizer; the real server
chains them around the ``tensorrt_llm`` model in tests/serve/test_serving_token_model.py."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.serve.triton.render import MODELS, TEMPLATES, render_text
from trtllm_dflash.serve.trtllm.text import TextPostprocessor, TextPreprocessor, flag, word_lists

FACTS = json.loads((Path(__file__).parents[1] / "data" / "trtllm_ensemble" / "text_models_io.json").read_text())
ENTRY = re.compile(r'\{ name: "(\w+)" data_type: (\w+) dims: \[ ([-\d, ]+) \]( optional: true)? \}')


@pytest.fixture(scope="module")
def models(smollm2):
    from transformers import AutoTokenizer

    params = {"tokenizer_dir": smollm2["target"]}
    return TextPreprocessor(params), TextPostprocessor(params), AutoTokenizer.from_pretrained(smollm2["target"])


def strings(*rows) -> np.ndarray:
    return np.array([[w.encode() for w in row] for row in rows], dtype=object)


@pytest.mark.parametrize("model", ["preprocessing", "postprocessing"])
def test_declared_io_is_tensorrt_llms_own(model):
    """Every input and output the rendered config declares has TensorRT-LLM's name, dtype, dims and optionality
    (apply_chat_template, ours, aside); what it leaves out is the recorded multimodal / encoder / prompt-table set."""
    _, keys = MODELS[model]
    values = {k: {"max_batch_size": 8, "target_dir": "/t", "instances": 1, "io_nice": 0}[k] for k in keys}
    text = render_text((TEMPLATES / model / "config.pbtxt").read_text(), values, model)
    inputs, outputs = (text.split("output [")[i] for i in (0, 1))
    declared_in = {m[0]: (m[1], [int(d) for d in m[2].split(",")], bool(m[3])) for m in ENTRY.findall(inputs)}
    declared_out = {m[0]: (m[1], [int(d) for d in m[2].split(",")]) for m in ENTRY.findall(outputs)}
    facts = FACTS[model]
    assert declared_in.pop("apply_chat_template", None) == (("TYPE_BOOL", [1], True) if model == "preprocessing"
                                                             else None)
    for name, got in declared_in.items():
        fact = facts["inputs"][name]
        assert got == (fact["data_type"], fact["dims"], fact["optional"]), name
    for name, got in declared_out.items():
        assert got == (facts["outputs"][name]["data_type"], facts["outputs"][name]["dims"]), name
    left_out = set(facts["inputs"]) - set(declared_in) | set(facts["outputs"]) - set(declared_out)
    assert left_out == set(FACTS["not_declared_here"].get(model, []))


def test_preprocessing_sends_what_tensorrt_llms_sends(models):
    """Two rows: ids right-padded with the pad id; the decoder-only DECODER_INPUT_ID; words in [B, 2, L] with 0 / -1
    padding (an empty word bans nothing: [[0], [-1]]); a dense bias on every token of each word; END_ID / PAD_ID as
    sent, else the tokenizer's."""
    pre, _, tok = models
    out = dict(pre({"QUERY": strings(["What is ML?"], ["hi"]), "REQUEST_OUTPUT_LEN": np.array([[5], [6]], np.int32),
                    "BAD_WORDS_DICT": strings([" Nile", " Paris France"], ["", ""]),
                    "EMBEDDING_BIAS_WORDS": strings([" yes"], [" no way"]),
                    "EMBEDDING_BIAS_WEIGHTS": np.array([[2.0], [-1.5]], np.float32),
                    "END_ID": np.array([[7], [8]], np.int32)}.get))
    assert list(out) == ["INPUT_ID", "REQUEST_INPUT_LEN", "DECODER_INPUT_ID", "REQUEST_DECODER_INPUT_LEN",
                         "BAD_WORDS_IDS", "STOP_WORDS_IDS", "REQUEST_OUTPUT_LEN", "EMBEDDING_BIAS", "OUT_END_ID",
                         "OUT_PAD_ID"]
    a, b = tok.encode("What is ML?"), tok.encode("hi")
    pad = tok.encode(tok.pad_token, add_special_tokens=False)[0]
    assert out["INPUT_ID"].tolist() == [a, b + [pad] * (len(a) - len(b))] and out["INPUT_ID"].dtype == np.int32
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(a)], [len(b)]]
    assert out["DECODER_INPUT_ID"].tolist() == [[pad], [pad]] and out["REQUEST_DECODER_INPUT_LEN"].tolist() == [[1], [1]]
    nile, paris = (tok.encode(w, add_special_tokens=False) for w in (" Nile", " Paris France"))
    width = len(nile) + len(paris)
    assert out["BAD_WORDS_IDS"].tolist() == [[nile + paris, [len(nile), width] + [-1] * (width - 2)],
                                             [[0] * width, [-1] * width]]
    assert out["STOP_WORDS_IDS"].shape == (2, 2, 0) and out["REQUEST_OUTPUT_LEN"].tolist() == [[5], [6]]
    bias = out["EMBEDDING_BIAS"]
    assert bias.shape == (2, len(tok)) and bias.dtype == np.float32
    assert {int(t): float(bias[0, t]) for t in np.nonzero(bias[0])[0]} == {t: 2.0 for t in tok.encode(" yes")}
    assert {int(t) for t in np.nonzero(bias[1])[0]} == set(tok.encode(" no way")) and len(tok.encode(" no way")) > 1
    assert out["OUT_END_ID"].tolist() == [[7], [8]] and out["OUT_PAD_ID"].tolist() == [[pad], [pad]]
    plain = dict(pre({"QUERY": strings(["hi"]), "REQUEST_OUTPUT_LEN": np.array([[3]], np.int32)}.get))
    assert plain["EMBEDDING_BIAS"].shape == (1, 0) and plain["BAD_WORDS_IDS"].shape == (1, 2, 0)
    assert plain["OUT_END_ID"].tolist() == [[tok.encode(tok.eos_token, add_special_tokens=False)[0]]]


def test_word_lists_match_tensorrt_llms_format():
    assert word_lists([[]]).tolist() == [[[0], [-1]]]
    assert word_lists([[[5, 6], [7]], [[9]]]).tolist() == [[[5, 6, 7], [2, 3, -1]], [[9, 0, 0], [1, -1, -1]]]


def test_postprocessing_decodes_each_beams_length(models):
    _, post, tok = models
    ids = tok.encode("Rome is the capital.") + [tok.eos_token_id]
    batch = np.array([[ids + [0, 0]], [ids[:2] + [0] * (len(ids))]], np.int32)
    out = dict(post({"TOKENS_BATCH": batch, "SEQUENCE_LENGTH": np.array([[len(ids)], [2]], np.int32)}.get))
    assert out["OUTPUT"].tolist() == [tok.decode(ids, skip_special_tokens=True).encode(),
                                      tok.decode(ids[:2]).encode()]
    assert not flag({"skip_special_tokens": "no"}, "skip_special_tokens") and flag({}, "skip_special_tokens")


@pytest.mark.parametrize("inputs, message", [
    ({"QUERY": [[""]]}, "QUERY[0]='': must not be empty"),
    ({"EMBEDDING_BIAS_WORDS": [[" a", " b"]], "EMBEDDING_BIAS_WEIGHTS": [[1.0]]},
     "EMBEDDING_BIAS_WEIGHTS[0] count=1: must equal the number of EMBEDDING_BIAS_WORDS[0] (2)"),
    ({"EMBEDDING_BIAS_WORDS": [[" a"]], "EMBEDDING_BIAS_WEIGHTS": [[float("nan")]]}, "must be finite"),
    ({"END_ID": [[1], [2]]}, "END_ID shape=[2, 1]: must be [1, 1]"),
    ({"QUERY": [[b"\xff"]]}, "QUERY[0][0]"),
])
def test_bad_preprocessing_input_is_named(models, inputs, message):
    pre = models[0]
    req = {"QUERY": strings(["hi"]), "REQUEST_OUTPUT_LEN": np.array([[3]], np.int32)}
    for name, value in inputs.items():
        req[name] = np.array([[v.encode() if isinstance(v, str) else v for v in row] for row in value],
                             dtype=object if name in ("QUERY", "EMBEDDING_BIAS_WORDS") else None)
    with pytest.raises(DFlashError, match=re.escape(message)):
        pre(req.get)


def test_bad_postprocessing_input_is_named(models):
    post = models[1]
    tokens = np.zeros((1, 1, 4), np.int32)
    with pytest.raises(DFlashError, match=re.escape("SEQUENCE_LENGTH shape=[1]: must be [1, 1]")):
        post({"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": np.array([4], np.int32)}.get)
    with pytest.raises(DFlashError, match=re.escape("SEQUENCE_LENGTH=5: must be in [0, 4]")):
        post({"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": np.array([[5]], np.int32)}.get)
