"""The --model_cls_file classes (trtllm_dflash/engine/models/) checked without TensorRT-LLM: they parse, define the
class names of contract.py, import only TensorRT-LLM symbols recorded in tests/data/trtllm_1_2_1/model_api.json,
declare exactly the parameter names our converter writes (read off their module tree in the source), take and mark
contract.py's I/O names, call plugin ops that plugin/trt.py registers with the right arity; plus the pure helpers in
engine/layout.py that those classes call at build time."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from trtllm_dflash.convert import configs
from trtllm_dflash.convert import weight_map as wm
from trtllm_dflash.engine import contract, layout
from trtllm_dflash.models.layers import Rotary
from trtllm_dflash.specs import RopeSpec

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "trtllm_dflash" / "engine" / "models"
DATA = Path(__file__).parents[1] / "data" / "trtllm_1_2_1"
API = json.loads((DATA / "model_api.json").read_text())
FLAGS = json.loads((DATA / "build_flags.json").read_text())

# Parameters of the TensorRT-LLM layers the drafter classes use (model_api.json tensorrt_llm.layers: Linear-type
# layers, RmsNorm and Embedding hold "weight" when built with bias=False; GatedMLP holds fc, gate, proj).
LEAF_PARAMS = {"ColumnLinear": ["weight"], "RowLinear": ["weight"], "RmsNorm": ["weight"], "Embedding": ["weight"],
               "GatedMLP": ["fc.weight", "gate.weight", "proj.weight"]}


def tree(name: str) -> ast.Module:
    return ast.parse((MODELS / name).read_text())


def classes(mod: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in mod.body if isinstance(n, ast.ClassDef)}


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def parameter_names(mod: ast.Module, cls_name: str, flags: dict[str, bool] | None = None) -> set[str]:
    """Parameter names of a Module subclass, from ``self.<attr> = <Layer>(...)`` in its __init__ (and its bases'),
    following our own submodule classes, ModuleList comprehensions ("{i}") and ``if [not] <flag>:`` blocks."""
    defs, flags = classes(mod), flags or {}
    cls = defs[cls_name]
    names: set[str] = set()
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in defs:
            names |= parameter_names(mod, base.id, flags)
    init = method(cls, "__init__")
    if init is None:
        return names

    def visit(stmts):
        for st in stmts:
            if isinstance(st, ast.If):
                test, negate = st.test, False
                if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                    test, negate = test.operand, True
                if isinstance(test, ast.Name) and test.id in flags:
                    visit(st.body if flags[test.id] != negate else st.orelse)
                else:  # a guard (e.g. a raise): whatever both branches assign
                    visit(st.body + st.orelse)
            elif isinstance(st, ast.Assign) and isinstance(st.value, ast.Call):
                target = st.targets[0]
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    names.update(f"{target.attr}.{p}" for p in submodule_params(st.value))

    def submodule_params(call: ast.Call) -> list[str]:
        fn = call.func.id if isinstance(call.func, ast.Name) else None
        if fn in LEAF_PARAMS:
            return LEAF_PARAMS[fn]
        if fn == "ModuleList":
            (comp,) = call.args
            assert isinstance(comp, ast.ListComp)
            return [f"{{i}}.{p}" for p in submodule_params(comp.elt)]
        if fn in defs:
            kw = {k.arg: k.value.value for k in call.keywords if isinstance(k.value, ast.Constant)}
            return sorted(parameter_names(mod, fn, kw))
        return []  # not a module (e.g. the parsed spec)

    visit(init.body)
    return names


def converter_names(rules) -> set[str]:
    return {r.dst for r in rules}


@pytest.fixture(scope="module")
def drafter_mod():
    return tree("drafter.py")


def test_files_parse_and_define_contract_classes(drafter_mod):
    assert set(contract.TARGET_CLASS.values()) <= set(classes(tree("target_taps.py")))
    assert {contract.KV_INJECT_CLASS, contract.DRAFTER_CLASS} <= set(classes(drafter_mod))
    assert contract.DRAFTER_CLASS == configs.DRAFTER_ARCHITECTURE  # the checkpoint architecture is the class name


@pytest.mark.parametrize("name", ["target_taps.py", "drafter.py"])
def test_trtllm_imports_are_recorded(name):
    recorded = {m: set(v["symbols"]) for m, v in API["modules"].items()}
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "tensorrt_llm":
            assert node.module in recorded, f"{name}: module {node.module} not in model_api.json"
            missing = {a.name for a in node.names} - recorded[node.module]
            assert not missing, f"{name}: {node.module}.{missing} not in model_api.json"
        if isinstance(node, ast.Import):
            for a in node.names:
                assert a.name.split(".")[0] != "tensorrt_llm", f"{name}: use from-imports of recorded symbols"
                if a.name.startswith("tensorrt"):
                    assert a.name == "tensorrt.plugin" and "tensorrt_plugin" in API


def test_parameter_names_match_the_converter(drafter_mod):
    """What each engine class declares must be what ``convert`` writes (weight_map.DRAFTER_*), plus the two tensors
    the drafter engine borrows from the target; together the engines use every converted drafter tensor."""
    written = converter_names(wm.DRAFTER_GLOBAL) | converter_names(wm.DRAFTER_LAYER)
    kv_inject = parameter_names(drafter_mod, contract.KV_INJECT_CLASS)
    drafter = parameter_names(drafter_mod, contract.DRAFTER_CLASS)
    assert kv_inject <= written, kv_inject - written
    assert drafter - set(layout.BORROWED) <= written, drafter - set(layout.BORROWED) - written
    assert set(layout.BORROWED) <= drafter
    assert kv_inject | drafter - set(layout.BORROWED) == written
    assert converter_names(wm.DRAFTER_LAYER) <= drafter  # the block forward needs every layer weight
    assert kv_inject == {"drafter.context_proj.weight", "drafter.context_norm.weight",
                         "drafter.layers.{i}.attention.qkv.weight", "drafter.layers.{i}.attention.k_layernorm.weight"}


def test_io_names_are_the_contract(drafter_mod):
    defs = classes(drafter_mod)
    for cls_name, ins, outs, attr in ((contract.KV_INJECT_CLASS, contract.KV_INJECT_INPUTS, contract.KV_INJECT_OUTPUTS,
                                       "KV_INJECT"),
                                      (contract.DRAFTER_CLASS, contract.DRAFTER_INPUTS, contract.DRAFTER_OUTPUTS,
                                       "DRAFTER")):
        fwd = method(defs[cls_name], "forward")
        assert [a.arg for a in fwd.args.args[1:]] == [io.name for io in ins]  # builder calls model(**inputs)
        src = ast.unparse(defs[cls_name])
        assert f"INPUTS = contract.{attr}_INPUTS" in src and f"contract.{attr}_OUTPUTS" in src
        marks = [n for n in ast.walk(fwd) if isinstance(n, ast.Attribute) and n.attr == "mark_output"]
        assert len(marks) == len(outs)
    base = method(defs["_DFlashEngine"], "prepare_inputs")
    assert [a.arg for a in base.args.args[1:]] == FLAGS["builder_rules"]["prepare_inputs_kwargs"]
    taps = ast.unparse(classes(tree("target_taps.py"))["_Taps"])
    assert "mark_output(contract.TAPS_OUTPUT" in taps


def test_plugin_ops_exist_with_their_arity(drafter_mod):
    """Each ``_plugin("<op>", [...])`` call names an op plugin/trt.py registers, with as many inputs as its desc."""
    registered = {}
    for fn in ast.walk(ast.parse((REPO / "trtllm_dflash" / "plugin" / "trt.py").read_text())):
        if isinstance(fn, ast.FunctionDef):
            for dec in fn.decorator_list:
                if isinstance(dec, ast.Call) and ast.unparse(dec.func) == "trtp.register":
                    op = ast.unparse(dec.args[0]).split("::")[-1].rstrip("'\"")
                    registered[op] = len(fn.args.args)
    calls = [n for n in ast.walk(drafter_mod) if isinstance(n, ast.Call) and ast.unparse(n.func) == "_plugin"]
    assert {c.args[0].value for c in calls} == {"kv_rope", "block_attention"}
    for c in calls:
        assert len(c.args[1].elts) == registered[c.args[0].value], ast.unparse(c)


def test_input_profiles_cover_the_contract():
    dims = layout.engine_dims(num_layers=5, num_kv_heads=8, head_dim=128, block_size=16, taps_width=5 * 4096,
                              max_batch_size=8, max_seq_len=4096, max_num_tokens=8192)
    kv = layout.input_profiles(contract.KV_INJECT_INPUTS, dims)
    assert kv["taps"][0] == [-1, 20480] and kv["taps"][1]["T"] == [(1, 4096, 8192)]
    dr = layout.input_profiles(contract.DRAFTER_INPUTS, dims)
    assert dr["ctx_k"][0] == [5, -1, -1, 8, 128] and dr["ctx_k"][1]["S"] == [(1, 2048, 4096)]
    assert dr["block_ids"][0] == [-1, 16] and dr["ctx_lens"][1]["n"] == [(1, 4, 8)]
    for io in contract.KV_INJECT_OUTPUTS + contract.DRAFTER_OUTPUTS:
        assert set(io.shape) <= set(dims), io  # output shapes are expressible in the same symbols
    with pytest.raises(Exception, match="has no size"):
        layout.input_profiles(contract.KV_INJECT_INPUTS, {"T": 4})


def test_rope_tables_match_the_torch_runtime():
    rope = RopeSpec(theta=1e6)
    cos, sin = layout.rope_tables(rope.inv_freq(128), 64)
    ref = Rotary(rope, 128, 64, torch.float32, "cpu")
    assert torch.allclose(torch.from_numpy(cos), ref.cos, atol=1e-6)  # float32 rounding of the same float64 values
    assert torch.allclose(torch.from_numpy(sin), ref.sin, atol=1e-6)


def test_qkv_rows():
    assert layout.qkv_rows(32, 8, 128) == {"q": (0, 4096), "k": (4096, 1024), "v": (5120, 1024)}


def test_checkpoint_layout_helpers(tmp_path, tiny_dirs, one_thread):
    """tap_layer_ids / borrowed_tensors on a real `convert` output (tiny Qwen3 pair)."""
    from trtllm_dflash.convert.checkpoint import convert

    t, d = tiny_dirs["qwen3"]
    out = convert(t, d, tmp_path / "ckpt")
    dcfg = json.loads((out / "drafter" / "config.json").read_text())
    assert layout.tap_layer_ids(out / "target") == tuple(dcfg["dflash"]["target_layer_ids"])
    borrowed = layout.borrowed_tensors(dcfg, "drafter")
    assert borrowed == {"vocab_embedding.weight": "transformer.vocab_embedding.weight",
                        "lm_head.weight": "lm_head.weight"}
    from safetensors import safe_open

    with safe_open(str(out / "target" / "rank0.safetensors"), framework="pt") as f:
        assert set(borrowed.values()) <= set(f.keys())
    with safe_open(str(out / "drafter" / "rank0.safetensors"), framework="pt") as f:
        written = set(f.keys())
    n = json.loads((out / "drafter" / "config.json").read_text())["num_hidden_layers"]
    expected = {r.dst.format(i=i) for r in wm.DRAFTER_LAYER for i in range(n)} | converter_names(wm.DRAFTER_GLOBAL)
    assert written == expected  # the names test_parameter_names_match_the_converter compares against
