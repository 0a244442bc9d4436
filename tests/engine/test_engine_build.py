"""``trtllm-dflash build``: the trtllm-build commands planned for config-only checkpoints (Qwen3-8B dims and the real
SmolLM2 demo pair), checked flag by flag against the recorded TensorRT-LLM 1.2.x flag set and support matrix
(tests/data/trtllm_1_2_1/build_flags.json), and the errors for combinations that cannot build. Nothing here runs
TensorRT: --dry-run only, and a real run without trtllm-build on PATH."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_dflash.checkpoints import drafter_spec_for
from trtllm_dflash.cli import main as cli_main
from trtllm_dflash.convert import configs
from trtllm_dflash.engine import build as eb
from trtllm_dflash.engine import contract
from trtllm_dflash.errors import ArtifactError, ConfigError
from trtllm_dflash.specs import DrafterSpec, TargetSpec

FACTS = json.loads((Path(__file__).parents[1] / "data" / "trtllm_1_2_1" / "build_flags.json").read_text())
OPTIONS = FACTS["core"]["options"] | FACTS["plugin"]["options"]
ALIASES = {a: name for name, o in OPTIONS.items() for a in o.get("aliases", [])}
REPO = Path(__file__).resolve().parents[2]

QWEN3_8B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
            "tie_word_embeddings": False, "eos_token_id": [151645], "torch_dtype": "bfloat16"}


def write_ckpt(root: Path, target: TargetSpec, drafter: DrafterSpec, quant_algo=None, kv_cache_quant_algo=None,
               tp: int = 1) -> Path:
    """A config-only `convert`/`quantize` output: target/ and drafter/ config.json plus a manifest, no weights."""
    tcfg = configs.target_config(target, "bfloat16", tp)
    tcfg["quantization"] |= {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo}
    for name, cfg in (("target", tcfg), ("drafter", configs.drafter_config(drafter, target, "bfloat16", tp))):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(cfg))
    (root / "manifest.json").write_text(json.dumps({"format": "trtllm_dflash.checkpoint/1", "outputs": {}}))
    return root


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory, one_thread):
    """(TargetSpec, DrafterSpec) with the real Qwen3-8B dims and a 5-layer, B=16 drafter (z-lab Qwen3-8B-DFlash-b16)."""
    target = TargetSpec.from_hf_config(QWEN3_8B)
    return target, drafter_spec_for(target, num_layers=5, block_size=16, mask_token_id=151669)


@pytest.fixture
def ckpt(tmp_path, qwen3_8b):
    def make(quant_algo=None, kv=None, tp=1, name="ckpt"):
        return write_ckpt(tmp_path / name, *qwen3_8b, quant_algo=quant_algo, kv_cache_quant_algo=kv, tp=tp)
    return make


def plan(ckpt_dir: Path, gpu: str, **kw) -> eb.BuildPlan:
    return eb.plan_build(eb.BuildConfig(ckpt_dir=ckpt_dir, out_dir=ckpt_dir.parent / "engines", gpu=eb.Gpu(gpu), **kw))


def flags(argv: list[str]) -> dict[str, str | None]:
    """--flag value pairs of one trtllm-build argv (every recorded option we emit takes a value)."""
    assert argv[0] == "trtllm-build"
    out, i = {}, 1
    while i < len(argv):
        name = argv[i]
        assert name.startswith("--"), argv
        takes_value = OPTIONS.get(ALIASES.get(name, name), {}).get("type") != "switch"
        out[name] = argv[i + 1] if takes_value else None
        i += 2 if takes_value else 1
    return out


def check_recorded(argv: list[str], gpu: str) -> None:
    """Every flag is a trtllm-build option of 1.2.x, every value one of its recorded choices, no plugin the GPU
    rejects is switched on."""
    rejected = FACTS["support_matrix"]["gpus"][gpu].get("rejected_plugins", [])
    for name, value in flags(argv).items():
        opt = OPTIONS.get(ALIASES.get(name, name))
        assert opt is not None, f"{name} is not a recorded trtllm-build option"
        if "choices" in opt:
            ok = value.lower() in opt["choices"] if opt.get("case_insensitive") else value in opt["choices"]
            assert ok, f"{name} {value} not in {opt['choices']}"
        if opt["type"] == "int":
            int(value)
        assert name[2:] not in rejected or value == "disable", f"{name} {value} is rejected on {gpu}"


@pytest.mark.parametrize("gpu,algo,kv,gemm,fp8_fmha", [
    ("hopper", None, None, "auto", "disable"),
    ("hopper", "FP8", None, "auto", "disable"),
    ("hopper", "FP8", "FP8", "auto", "enable"),
    ("blackwell", "FP8", "FP8", "auto", "enable"),
    ("blackwell", "NVFP4", None, "nvfp4", "disable"),
    ("blackwell", "NVFP4", "FP8", "nvfp4", "enable"),
])
def test_qwen3_8b_commands(ckpt, gpu, algo, kv, gemm, fp8_fmha):
    p = plan(ckpt(algo, kv), gpu)
    assert tuple(p.commands) == contract.ENGINES
    for argv in p.commands.values():
        check_recorded(argv, gpu)
    t = flags(p.commands["target"])
    assert t["--checkpoint_dir"] == str(p.ckpt.root.resolve() / "target")
    assert t["--output_dir"] == str((p.cfg.out_dir / "target").resolve())
    assert t["--model_cls_file"] == str(REPO / "trtllm_dflash" / "engine" / "models" / "target_taps.py")
    assert t["--model_cls_name"] == contract.TARGET_CLASS["Qwen3ForCausalLM"] == "DFlashQwen3WithTaps"
    assert (t["--speculative_decoding_mode"], t["--max_draft_len"]) == ("draft_tokens_external", "15")  # B - 1
    assert (t["--kv_cache_type"], t["--use_paged_context_fmha"], t["--gpt_attention_plugin"]) == (
        "paged", "enable", "auto")
    assert (t["--gemm_plugin"], t["--use_fp8_context_fmha"]) == (gemm, fp8_fmha)
    # defaults: 8 sequences, min(4096, 40960) tokens, max(8192, 8 x 16) tokens per call
    assert (t["--max_batch_size"], t["--max_seq_len"], t["--max_input_len"], t["--max_num_tokens"]) == (
        "8", "4096", "4096", "8192")
    for engine, cls in (("kv_inject", contract.KV_INJECT_CLASS), ("drafter", contract.DRAFTER_CLASS)):
        d = flags(p.commands[engine])
        assert d["--checkpoint_dir"] == str(p.ckpt.root.resolve() / "drafter")
        assert d["--model_cls_file"] == str(REPO / "trtllm_dflash" / "engine" / "models" / "drafter.py")
        assert d["--model_cls_name"] == cls
        assert (d["--kv_cache_type"], d["--gemm_plugin"]) == ("disabled", "auto")
        assert "--speculative_decoding_mode" not in d


def test_support_table_matches_recorded_matrix():
    for gpu, sup in eb.SUPPORT.items():
        rec = FACTS["support_matrix"]["gpus"][gpu.value]
        assert sup.sm == rec["sm"]
        assert {str(a): why is None for a, why in sup.quant_algos.items()} == {
            ("None" if k == "null" else k): v for k, v in rec["quant_algo"].items()}
        assert {str(k) for k in sup.kv_cache_quant_algos} == {
            "None" if k == "null" else k for k, ok in rec["kv_cache_quant_algo"].items() if ok}


def test_nvfp4_on_hopper_is_refused(ckpt):
    with pytest.raises(ConfigError) as e:
        plan(ckpt("NVFP4"), "hopper")
    assert e.value.field == "target.quantization.quant_algo" and e.value.value == "NVFP4"
    assert "NVFP4 GEMMs need SM100+ (Blackwell)" in e.value.rule
    assert e.value.fix.startswith("quantize with --format fp8 for Hopper")


@pytest.mark.parametrize("kw,field,rule", [
    (dict(max_seq_len=40961), "max_seq_len", "max_position_embeddings"),
    (dict(max_seq_len=8), "max_seq_len", "block_size"),
    (dict(max_seq_len=1024, max_input_len=2048), "max_input_len", "max_seq_len=1024"),
    (dict(max_batch_size=64, max_num_tokens=1000), "max_num_tokens", "64 x 16 = 1024"),
    (dict(max_batch_size=0), "max_batch_size", ">= 1"),
])
def test_limits(ckpt, kw, field, rule):
    with pytest.raises(ConfigError) as e:
        plan(ckpt(), "hopper", **kw)
    assert e.value.field == field and rule in e.value.rule


def test_limits_resolve(ckpt):
    p = plan(ckpt(), "blackwell", max_batch_size=1024, max_seq_len=32768, max_input_len=30000)
    assert p.limits == eb.Limits(1024, 32768, 30000, 16384)  # max_num_tokens raised to 1024 x 16
    assert flags(p.commands["drafter"])["--max_num_tokens"] == "16384"


@pytest.mark.parametrize("change,field", [
    (lambda t, d: t["quantization"].update(kv_cache_quant_algo="NVFP4"), "target.quantization.kv_cache_quant_algo"),
    (lambda t, d: t["quantization"].update(quant_algo="W4A16_AWQ"), "target.quantization.quant_algo"),
    (lambda t, d: t["mapping"].update(tp_size=2), "target.mapping.tp_size"),
    (lambda t, d: d["dflash"].update(target_layer_ids=[1, 36]), "drafter.dflash.target_layer_ids"),
    (lambda t, d: d["dflash"].update(block_size=1), "drafter.dflash.block_size"),
    (lambda t, d: t.update(architecture="MistralForCausalLM"), "target.architecture"),
])
def test_bad_checkpoints(ckpt, change, field):
    root = ckpt()
    t, d = (json.loads((root / n / "config.json").read_text()) for n in ("target", "drafter"))
    change(t, d)
    for n, cfg in (("target", t), ("drafter", d)):
        (root / n / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        plan(root, "blackwell")
    assert e.value.field == field


def test_missing_checkpoint(tmp_path):
    with pytest.raises(ArtifactError, match="has no target/config.json"):
        plan(tmp_path, "hopper")


def test_smollm2_dry_run_cli(smollm2, tmp_path, capsys, one_thread):
    """The real demo pair (SmolLM2-135M target, the shipped B=16 drafter): Llama class, FP8 on Hopper via the CLI."""
    root = write_ckpt(tmp_path / "ckpt", TargetSpec.load(smollm2["target"]), DrafterSpec.load(smollm2["drafter"]),
                      quant_algo="FP8", kv_cache_quant_algo="FP8")
    out = tmp_path / "engines"
    rc = cli_main(["build", "--ckpt", str(root), "--out", str(out), "--gpu", "hopper", "--max-seq-len", "2048",
                   "--dry-run"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(lines) == 3 and not out.exists()
    argvs = [shlex.split(line) for line in lines]
    assert argvs == [plan(root, "hopper", max_seq_len=2048).commands[e] for e in contract.ENGINES]
    t = flags(argvs[0])
    assert t["--model_cls_name"] == "DFlashLlamaWithTaps" and t["--max_draft_len"] == "15"
    assert (t["--gemm_plugin"], t["--use_fp8_context_fmha"], t["--max_seq_len"]) == ("auto", "enable", "2048")


def test_cli_errors_exit_2_one_line(ckpt, tmp_path, capsys):
    root = ckpt("NVFP4")
    rc = cli_main(["build", "--ckpt", str(root), "--out", str(tmp_path / "e"), "--gpu", "hopper", "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("trtllm-dflash build: error: target.quantization.quant_algo='NVFP4'")


def test_run_without_trtllm_build(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no trtllm-build anywhere
    rc = cli_main(["build", "--ckpt", str(ckpt("FP8")), "--out", str(tmp_path / "e"), "--gpu", "hopper"])
    err = capsys.readouterr().err
    assert rc == 2 and "tritonserver:26.07-trtllm-python-py3" in err and not (tmp_path / "e").exists()


def test_run_with_a_stand_in_trtllm_build(ckpt, tmp_path, monkeypatch):
    """The run path itself (staging, rename, manifest) with a stand-in trtllm-build that only creates its output
    directory; it proves nothing about TensorRT, only that the commands are run as planned."""
    root = ckpt("FP8", "FP8")
    for n in ("target", "drafter"):
        (root / n / "rank0.safetensors").write_bytes(b"")
    fake = tmp_path / "bin" / "trtllm-build"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "--output_dir" ]; do shift; done\nmkdir -p "$2"\n'
                    'echo "$2" > "$2/argv_seen"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    out = tmp_path / "engines"
    art = eb.build(eb.BuildConfig(ckpt_dir=root, out_dir=out, gpu=eb.Gpu.HOPPER), dry_run=False)
    assert sorted(p.name for p in out.iterdir()) == sorted([*contract.ENGINES, eb.MANIFEST])
    m = json.loads(art.manifest_path.read_text())
    assert m["format"] == eb.FORMAT and list(m["commands"]) == list(contract.ENGINES)
    assert m["quantization"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"} and m["block_size"] == 16
    assert m["checkpoint"]["manifest_sha256"] and m["commands"]["target"][4] == str(out.resolve() / "target")
    with pytest.raises(ArtifactError, match="already exists"):
        eb.build(eb.BuildConfig(ckpt_dir=root, out_dir=out, gpu=eb.Gpu.HOPPER))


def test_build_engines_script(ckpt, tmp_path):
    """The shell wrapper is a thin call of the CLI (same commands) and passes shellcheck when it is installed."""
    root = ckpt("FP8")
    script = REPO / "build_scripts" / "build_engines.sh"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(script), str(root), str(root.parent / "engines"), "hopper", "--dry-run"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr
    assert [shlex.split(x) for x in done.stdout.strip().splitlines()] == list(plan(root, "hopper").commands.values())
    bad = subprocess.run(["bash", str(script), str(root)], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage:" in bad.stderr
    if shutil.which("shellcheck", path=env["PATH"]):
        sc = subprocess.run([shutil.which("shellcheck", path=env["PATH"]), str(script)], capture_output=True, text=True)
        assert sc.returncode == 0, sc.stdout
