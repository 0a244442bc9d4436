"""serve.settings.ModelSettings: the parameters a rendered model reads, typed once, refused by name when wrong."""

import json

import pytest

from trtllm_dflash.errors import ConfigError
from trtllm_dflash.serve.settings import ModelSettings
from trtllm_dflash.serve.triton.render import config_parameters


def test_strings_become_typed_fields_with_the_readers_defaults():
    s = ModelSettings.from_parameters({"block_size": "auto", "ngram": "on", "tree": "off", "tap_layers": "1,14,27",
                                       "max_sequences": "32", "idle_timeout_s": "120.0", "coalesce": "off",
                                       "decoupled": "false", "skip_special_tokens": "no", "cuda_graphs": "rehearse"})
    assert s.block_size == "auto" and s.adaptive_block and s.ngram and not s.tree and not s.coalesce
    assert s.tap_layers == (1, 14, 27) and s.max_sequences == 32 and s.idle_timeout_s == 120.0
    assert not s.decoupled and not s.skip_special_tokens and s.cuda_graphs == "rehearse"
    blank = ModelSettings.from_parameters({})
    assert (blank.block_size, blank.metrics, blank.coalesce, blank.frontend, blank.queue_timeout_s) == (16, True, True,
                                                                                                        "off", 300.0)
    assert blank.add_special_tokens and blank.decoupled and not blank.engine_backend
    # TensorRT-LLM's boolean spellings; an unknown one keeps the default, as its models read it
    assert not ModelSettings.from_parameters({"add_special_tokens": "F"}).add_special_tokens
    assert ModelSettings.from_parameters({"add_special_tokens": "maybe"}).add_special_tokens
    assert ModelSettings.of(s) is s and ModelSettings.of({"block_size": "4"}).block_size == 4


@pytest.mark.parametrize("params,field,why", [
    ({"blocksize": "16"}, "'blocksize'", "is not a setting any model reads"),
    ({"block_size": "sixteen"}, "'block_size'", "'auto' or an integer"),
    ({"ngram": "yes"}, "'ngram'", "on or off"),
    ({"max_sequences": "many"}, "'max_sequences'", "an integer"),
    ({"tap_layers": "1,x"}, "'tap_layers'", "comma-separated layer indices"),
    ({"idle_timeout_s": "soon"}, "'idle_timeout_s'", "a number"),
    ({"idle_timeout_s": "0"}, "'idle_timeout_s'", "must be > 0"),
    ({"backend": "onnx"}, "'backend'", "torch, trtllm-engine"),
    ({"cuda_graphs": "yes"}, "'cuda_graphs'", "off, on, rehearse"),
    ({"max_batch_size": "0"}, "'max_batch_size'", ">= 1"),
])
def test_a_bad_parameter_is_refused_naming_the_key_and_the_value(params, field, why):
    with pytest.raises(ConfigError, match=why) as err:
        ModelSettings.from_parameters(params)
    assert field in str(err.value) and str(next(iter(params.values()))) in str(err.value)


def test_from_args_reads_tritons_model_config_and_config_parameters_reads_a_rendered_file():
    text = ('parameters { key: "block_size" value: { string_value: "8" } }\n'
            'parameters { key: "datastore" value: { string_value: "/d/x \\"q\\".dflash" } }\n')
    params = config_parameters(text)
    assert params == {"block_size": "8", "datastore": '/d/x "q".dflash'}
    args = {"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}})}
    assert ModelSettings.from_args(args) == ModelSettings(block_size=8, datastore='/d/x "q".dflash')
