"""make-repo: strict rendering, every placeholder filled and every key used; loop logic over in-process steps."""

import asyncio
import json

import pytest
import torch

from conftest import greedy_reference
from trtllm_dflash.cli import main
from trtllm_dflash.errors import ArtifactError, ConfigError
from trtllm_dflash.runtime.cost import GRID, CostModel
from trtllm_dflash.runtime.policy import AdaptivePolicy
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.local import LocalSteps
from trtllm_dflash.runtime.stepper import run_generation
from trtllm_dflash.runtime.protocol import GenerateRequest, StopMatcher, decode_stops, encode_stops
from trtllm_dflash.serve.triton.render import MODELS, RepoConfig, make_repo, render_text
from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier


def test_render_text_is_strict():
    assert render_text("a: ${x} b: ${y}", {"x": 1, "y": "z"}, "t") == "a: 1 b: z"
    with pytest.raises(ConfigError, match=r"t placeholders=\['y'\]: have no value"):
        render_text("a: ${x} b: ${y}", {"x": 1}, "t")
    with pytest.raises(ConfigError, match=r"t values=\['extra'\]: are not used by the template"):
        render_text("a: ${x}", {"x": 1, "extra": 2}, "t")
    with pytest.raises(ConfigError, match="malformed placeholder"):
        render_text("a: ${x} $y", {"x": 1}, "t")


def test_make_repo_renders_every_model_without_placeholders(tiny_dirs, tmp_path):
    t, d = tiny_dirs["llama"]
    out = make_repo(RepoConfig(str(t), str(d), block_size=8, max_seq_len=256), tmp_path / "repo")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(MODELS)
    for model in MODELS:
        text = (out / model / "config.pbtxt").read_text()
        assert "${" not in text and f'name: "{model}"' in text
    assert 'string_value: "1"' in (out / "baseline_bls" / "config.pbtxt").read_text()  # block size 1
    assert (out / "dflash_bls" / "1" / "model.py").is_file()
    assert json.loads((out / "manifest.json").read_text())["repo_config"]["block_size"] == 8
    for model in ("dflash_bls", "dflash", "baseline"):  # prompt lookup is off unless asked for
        assert 'key: "ngram" value: { string_value: "off" }' in (out / model / "config.pbtxt").read_text()
    with pytest.raises(ArtifactError, match="already exists; pass --force"):
        make_repo(RepoConfig(str(t), str(d)), out)


def test_make_repo_ngram_reaches_the_dflash_loops_only(tiny_dirs, tmp_path, capsys):
    """make-repo turns prompt lookup on by default (--no-ngram: off) in the dflash loops only; TRT-LLM's own
    speculative decoding (trtllm-pytorch) gets it off by default and refuses an explicit --ngram."""
    t, d = tiny_dirs["llama"]
    for flags, dflash in (([], "on"), (["--no-ngram"], "off")):
        out = tmp_path / f"repo{len(flags)}"
        assert main(["make-repo", "--target", str(t), "--drafter", str(d), "--out", str(out), "--block-size", "8",
                     "--max-seq-len", "256", *flags]) == 0
        for model, want in (("dflash_bls", dflash), ("dflash", dflash), ("baseline_bls", "off"), ("baseline", "off")):
            text = (out / model / "config.pbtxt").read_text()
            assert f'key: "ngram" value: {{ string_value: "{want}" }}' in text, (flags, model)
    capsys.readouterr()
    assert main(["make-repo", "--backend", "trtllm-pytorch", "--checkpoint", str(t), "--drafter", str(d),
                 "--out", str(tmp_path / "r2"), "--ngram"]) == 2
    assert "--ngram=True: runs in the BLS loop over step models" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()


def test_make_repo_auto_writes_the_loop_policy(tiny_dirs, tmp_path, monkeypatch):
    """--block-size auto: the step models are built for the longest block, dflash_bls gets "auto" and the settings
    file (calibrated cost model + the drafter's prior) that its loop loads; the baseline stays autoregressive."""
    from trtllm_dflash.serve.triton.bls import load_policy

    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path / "cache"))
    t, d = tiny_dirs["llama"]
    out = make_repo(RepoConfig(str(t), str(d), block_size="auto", max_block_size=8, max_seq_len=256),
                    tmp_path / "repo")
    bls = (out / "dflash_bls" / "config.pbtxt").read_text()
    path = out.resolve() / "dflash_bls" / "1" / "adaptive.json"
    assert 'key: "block_size" value: { string_value: "auto" }' in bls and f'string_value: "{path}"' in bls
    assert 'key: "adaptive" value: { string_value: "" }' in (out / "baseline_bls" / "config.pbtxt").read_text()
    assert 'key: "max_block_size" value: { string_value: "8" }' in (out / "target_verify" / "config.pbtxt").read_text()
    policy = load_policy(str(path))
    assert policy.max_k == 7 and policy.cost.verify(8) > 0
    with pytest.raises(ConfigError, match="--block-size='auto': 'auto' runs in the BLS loop"):
        make_repo(RepoConfig(str(t), str(d), backend="trtllm-engine", engines_dir=str(tmp_path), block_size="auto"),
                  tmp_path / "r2")
    with pytest.raises(ConfigError, match="--max-block-size=8: only applies to --block-size auto"):
        make_repo(RepoConfig(str(t), str(d), block_size=8, max_block_size=8), tmp_path / "r3")


def test_make_repo_defaults_to_auto_on_the_torch_backend(tiny_dirs, tmp_path, monkeypatch, capsys):
    """With no --block-size the torch backend's dflash loops run auto (a fixed block is slower than autoregressive
    decoding wherever a wide verify costs several narrow ones and the drafter is weak); the TensorRT-LLM engines,
    which verify a fixed block, keep the drafter's block size."""
    from test_serving_trtllm import write_engines

    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path / "cache"))
    t, d = tiny_dirs["llama"]
    assert main(["make-repo", "--target", str(t), "--drafter", str(d), "--out", str(tmp_path / "r"),
                 "--max-seq-len", "256", "--max-block-size", "4"]) == 0
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())["repo_config"]
    assert manifest["block_size"] == "auto" and manifest["max_block_size"] == 4
    for model in ("dflash_bls", "dflash"):
        assert 'key: "block_size" value: { string_value: "auto" }' in (tmp_path / "r" / model / "config.pbtxt").read_text()
    assert (tmp_path / "r" / "dflash_bls" / "1" / "adaptive.json").is_file()
    engines = write_engines(tmp_path / "eng")
    assert main(["make-repo", "--target", str(t), "--drafter", str(d), "--backend", "trtllm-engine", "--engines",
                 str(engines), "--out", str(tmp_path / "e"), "--max-seq-len", "256"]) == 0
    block = json.loads((d / "config.json").read_text())["block_size"]
    assert json.loads((tmp_path / "e" / "manifest.json").read_text())["repo_config"]["block_size"] == block
    capsys.readouterr()


def test_make_repo_template_with_missing_or_extra_key_fails(tiny_dirs, tmp_path):
    t, d = tiny_dirs["llama"]
    templates = tmp_path / "templates"
    import shutil

    from trtllm_dflash.serve.triton.render import TEMPLATES

    shutil.copytree(TEMPLATES, templates)
    cfg = templates / "kv_inject" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("${torch_threads}", "1"))  # a key the renderer gives is now unused
    with pytest.raises(ConfigError, match=r"kv_inject/config.pbtxt values=\['torch_threads'\]"):
        make_repo(RepoConfig(str(t), str(d), max_seq_len=256), tmp_path / "r1", templates=templates)
    cfg.write_text(cfg.read_text() + '\nparameters { key: "x" value: { string_value: "${unknown_key}" } }\n')
    with pytest.raises(ConfigError, match=r"placeholders=\['unknown_key'\]: have no value"):
        make_repo(RepoConfig(str(t), str(d), max_seq_len=256), tmp_path / "r2", templates=templates)
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_make_repo_cli_bad_values_exit_2(tiny_dirs, tmp_path, capsys):
    t, d = tiny_dirs["llama"]
    assert main(["make-repo", "--target", str(t), "--drafter", str(d), "--out", str(tmp_path / "r"),
                 "--block-size", "32"]) == 2
    assert "--block-size=32: must be in [2, 16]" in capsys.readouterr().err
    assert main(["make-repo", "--target", str(t), "--drafter", str(d), "--out", str(tmp_path / "r"),
                 "--backend", "trtllm-engine"]) == 2
    assert "--engines=None: is required by --backend trtllm-engine" in capsys.readouterr().err


def test_stop_sequences_roundtrip_and_truncation():
    stops = ((5,), (7, 8))
    assert decode_stops(encode_stops([list(s) for s in stops])) == stops
    m = StopMatcher(stops)
    assert m.truncate([1, 2, 7, 8, 9], 0) == 2
    assert m.truncate([1, 2, 7], 2) is None
    assert m.truncate([1, 2, 7, 8], 3) == 2  # a stop spanning the previous chunk
    assert m.longest == 2


def test_indexed_stops_cut_where_comparing_every_stop_does():
    """StopMatcher compares a new token with the stops ending in it only: the same cut as comparing every stop at
    every position, on random streams and stop lists over a small vocabulary (many overlaps)."""
    import random

    def every_stop(tokens, stops, checked):
        """The naive cut: every stop compared at every position since ``checked``."""
        for end in range(max(checked, 0) + 1, len(tokens) + 1):
            for stop in stops:
                if end >= len(stop) and tuple(tokens[end - len(stop): end]) == stop:
                    return end - len(stop)
        return None

    rng = random.Random(0)
    for _ in range(2000):
        stops = tuple(tuple(rng.randrange(6) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6)))
        tokens = [rng.randrange(6) for _ in range(rng.randint(0, 12))]
        checked = rng.randint(0, len(tokens))
        assert StopMatcher(stops).truncate(tokens, checked) == every_stop(tokens, stops, checked), (stops, tokens)


class OracleSteps(LocalSteps):
    """Drafts = the known continuation, partly corrupted: exercises every accepted length through the loop."""

    def __init__(self, *a, ref, prompt_len, seed=0):
        super().__init__(*a)
        self.ref, self.prompt_len = ref, prompt_len
        self.gen = torch.Generator().manual_seed(seed)
        self.drafts = 0

    async def draft(self, seq_id, k, v, bonus, block_size):
        self.drafts += 1
        real = await super().draft(seq_id, k, v, bonus, block_size)
        row = self.verifier.slots.rows[seq_id]
        emitted = int(self.verifier.cache.lengths[row]) - self.prompt_len + 1
        out = []
        for i in range(block_size - 1):
            tok = self.ref[emitted + i] if emitted + i < len(self.ref) else real[i]
            out.append(tok if torch.rand(1, generator=self.gen).item() > 0.3 else 3)
        return out


@pytest.mark.parametrize("block_size", [1, 4, 16, "16+ngram", "auto", "auto+ngram"])
def test_loop_over_step_engines_is_lossless(tiny_dirs, tiny_models, block_size):
    target, drafter = tiny_models["qwen3"]
    prompt = [9, 8, 7, 9, 8, 7, 9, 8] if "ngram" in str(block_size) else [9, 8, 7, 6, 5, 4]  # the first repeats
    ref = list(greedy_reference(target, [prompt], 40)[0])
    verifier = TargetVerifier(target, drafter.spec.target_layer_ids, 2, 256, 16)
    steps = OracleSteps(verifier, KVInjector(drafter), BlockDrafter(drafter, TargetHead(tiny_dirs["qwen3"][0],
                        torch.float64), 2, 256), ref=ref, prompt_len=len(prompt))
    updates = []

    async def on_update(u):
        updates.append(u)

    req = GenerateRequest(tuple(prompt), 40, SamplingParams(), ((ref[30],),) if block_size == 4 else (), True)
    policy = AdaptivePolicy(CostModel([1e-3 * (1 + n / 64) for n in GRID], [5e-4 * (1 + n / 64) for n in GRID]), 16,
                            [0.6] * 15, ngram=block_size == "auto+ngram") if "auto" in str(block_size) else None
    fixed = int(str(block_size).removesuffix("+ngram")) if not policy else None
    reason = asyncio.run(run_generation(steps, req, "auto" if policy else fixed, 7, on_update, policy=policy,
                                        ngram=block_size == "16+ngram"))
    expect = ref[: ref.index(ref[30])] if block_size == 4 else ref
    assert updates[-1].final and updates[-1].tokens == expect
    assert reason == ("stop" if block_size == 4 else "length")
    taus = [t for u in updates for t in u.acceptance_lengths]
    longest = 16 if policy else fixed
    assert all(1 <= t <= longest for t in taus) and (block_size == 1 or max(taus) > 1)
    ks = [k for u in updates for k in u.draft_lengths]
    assert len(ks) == len(taus) and all(t <= k + 1 for k, t in zip(ks, taus))
    if policy:
        assert len(set(ks)) > 1 and policy.telemetry.steps == len(ks)
    if block_size == "16+ngram":  # the tiny model repeats itself: some steps verify prompt lookup's continuation
        assert 0 < steps.drafts < len(taus)
    elif block_size in (4, 16):
        assert steps.drafts == len(taus)
    assert [u.prev_len for u in updates[1:]] == [len(u.tokens) for u in updates[:-1]]
    assert not verifier.slots.rows and not steps.drafter.slots.rows  # state freed


def test_server_env_bounds_openmp_spinning(tmp_path, monkeypatch):
    """Step-model processes share the cores: by default their idle OpenMP threads spin a bounded while (neither the
    unbounded default nor a futex sleep after every op); a user's own OMP_WAIT_POLICY / GOMP_SPINCOUNT wins."""
    from trtllm_dflash.serve.triton.server import OMP_SPINCOUNT, server_command

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    env = server_command(tmp_path, 1, 2, 3).env
    assert env["GOMP_SPINCOUNT"] == str(OMP_SPINCOUNT) and "OMP_WAIT_POLICY" not in env
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = server_command(tmp_path, 1, 2, 3).env
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env


def test_cpu_step_threads_follow_the_load():
    """A CPU step model computes on every core while it serves one sequence and on one thread once several overlap
    (the target's and the drafter's processes would otherwise fight over the cores at each op's barrier); a fixed
    ``torch_threads`` wins at any load."""
    from trtllm_dflash.serve.triton.handlers import CpuThreads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        auto = CpuThreads({"torch_threads": "0"})
        assert [auto.threads_for(n) for n in (0, 1, 2, 16)] == [2, 2, 1, 1]
        auto(live=4)
        assert torch.get_num_threads() == 1
        auto(live=1)
        assert torch.get_num_threads() == 2  # back to every core when the load is gone
        fixed = CpuThreads({"torch_threads": "3"})
        assert torch.get_num_threads() == 3 and [fixed.threads_for(n) for n in (1, 16)] == [3, 3]
        fixed(live=16)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_coalescing_loops_one_row_requests_get_every_core():
    """A step coalescer runs one stage at a time, so its requests get every core at any load: several rows, or one
    row that says ``coalesced`` (a step where one sequence drafts, a sequence's start). Counted as overlapping, such a
    row would run every prefill on one thread with 16 DFlash sequences live."""
    from types import SimpleNamespace

    import numpy as np

    from trtllm_dflash.serve.triton.handlers import CpuThreads, _coalesced

    pb = SimpleNamespace(get_input_tensor_by_name=lambda request, name: SimpleNamespace(
        as_numpy=lambda: request[name]) if name in request else None)
    assert not _coalesced(pb, {}, [7]) and _coalesced(pb, {}, [7, 8])
    assert _coalesced(pb, {"coalesced": np.ones((1, 1), bool)}, [7])
    assert not _coalesced(pb, {"coalesced": np.zeros((1, 1), bool)}, [7])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        auto = CpuThreads({"torch_threads": "0"})
        assert [auto.threads_for(16, coalesced) for coalesced in (False, True)] == [1, 2]
    finally:
        torch.set_num_threads(before)


def test_raise_niceness_sets_every_thread_and_io_nice_renders_only_to_io_models(tiny_dirs, tmp_path):
    """raise_niceness raises every thread of a process (threads started later inherit it), never lowers one;
    io_nice reaches the entry / loop / tokenizer models' configs and not the step models'."""
    import subprocess
    import sys

    code = ("import os, threading, time\n"
            "from trtllm_dflash.serve.triton.lifecycle import raise_niceness, yield_to_compute\n"
            "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"
            "assert yield_to_compute(0) is False\n"
            "n = raise_niceness(3); again = raise_niceness(2)\n"
            "late = threading.Thread(target=time.sleep, args=(1,)); late.start()\n"
            "print(n, again, sorted({os.getpriority(os.PRIO_PROCESS, int(x)) for x in os.listdir('/proc/self/task')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "2" and out[1] == "0" and out[2:] == ["[3]"], out
    target, drafter = map(str, tiny_dirs["llama"])
    repo = make_repo(RepoConfig(target, drafter, max_seq_len=256, io_nice=7), tmp_path / "repo")
    line = 'parameters { key: "io_nice" value: { string_value: "7" } }'
    rendered = {p.parent.name for p in repo.glob("*/config.pbtxt") if line in p.read_text()}
    assert rendered == {"dflash", "baseline", "dflash_bls", "baseline_bls", "tensorrt_llm", "preprocessing",
                        "postprocessing", "ensemble", "tensorrt_llm_bls"}
    with pytest.raises(ConfigError, match="--io-nice"):
        make_repo(RepoConfig(target, drafter, max_seq_len=256, io_nice=20), tmp_path / "bad")


def test_a_server_that_exits_while_loading_names_the_model_and_why(tmp_path):
    """startup_failure puts the log's error and failed-load lines, which the model table and the shutdown push out
    of any short tail, ahead of the tail."""
    from trtllm_dflash.serve.triton.server import startup_failure

    lines = ['I1128 01:07:55.313238 2792 model_lifecycle.cc:472] "loading: dflash:1"',
             'E1128 01:08:06.021758 2792 model_lifecycle.cc:642] "failed to load \'dflash\' version 1: Internal: '
             'Stub process \'dflash_0_0\' is not healthy."',
             "trtllm-dflash: stub 4242 exits: no stub of target_verify, kv_inject, drafter left: the server is shutting down"]
    lines += [f'I1128 01:08:1{i % 10}.0 2792 server.cc:345] "Timeout {i}: unloading"' for i in range(200)]
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines) + "\nerror: creating server: Internal - failed to load all models\n")
    text = startup_failure(log, tail_chars=300)
    assert text.index("Stub process 'dflash_0_0' is not healthy") < text.index("stub 4242 exits") < text.index("...")
    assert text.rstrip().endswith("failed to load all models") and "loading: dflash:1" not in text
    assert startup_failure(None) == startup_failure(tmp_path / "missing.log") == "(no log; pass log_path)"


def test_verify_takes_its_rows_in_slot_order_and_answers_in_the_callers(tiny_models):
    """``TargetVerifier.verify`` sorts a batch by cache slot (consecutive slots are read as views) and returns the
    results in the caller's order: the same tokens and taps as the batch sent in slot order."""
    target, drafter = tiny_models["qwen3"]
    prompts = {10: [9, 8, 7, 6], 11: [1, 2, 3], 12: [5, 5, 5, 5, 5]}
    blocks = {10: [4, 3, 2], 11: [7, 7, 7], 12: [1, 1, 1]}
    got = {}
    for order in ([10, 11, 12], [12, 10, 11]):
        verifier = TargetVerifier(target, drafter.spec.target_layer_ids, 4, 64, 4)
        for seq in (10, 11, 12):  # slots 0, 1, 2
            verifier.start(seq, prompts[seq], SamplingParams(), True)
        results = verifier.verify(order, [blocks[s] for s in order], True)
        got[tuple(order)] = {s: r for s, r in zip(order, results)}
    for seq in (10, 11, 12):
        a, b = got[(10, 11, 12)][seq], got[(12, 10, 11)][seq]
        assert a.emitted == b.emitted
        torch.testing.assert_close(a.taps, b.taps, atol=1e-12, rtol=0)


def test_token_ids_outside_the_vocabulary_are_named_and_hold_no_slot(tiny_models):
    """A client of dflash_bls or target_verify sends token ids itself: one outside the vocabulary is refused naming
    it, before a slot is taken (failing inside the embedding after ``start`` had taken one would leave the slot taken
    until the idle time-out)."""
    target, drafter = tiny_models["llama"]
    vocab = target.spec.vocab_size
    v = TargetVerifier(target, drafter.spec.target_layer_ids, 2, 64, 8)
    for ids, bad in (([vocab, 1], vocab), ([-3, 1], -3), ([1, 10**6], 10**6)):
        with pytest.raises(ConfigError, match=rf"prompt token id={bad}: must be in"):
            v.start(7, ids, SamplingParams(), True)
    with pytest.raises(ConfigError, match=rf"banned_ids={vocab}: must be in"):  # min_tokens' end ids too
        v.start(7, [1, 2], SamplingParams(banned_ids=(1, vocab), banned_before=9), True)
    assert v.slots.rows == {}
    first = v.start(7, [1, 2], SamplingParams(), True).first_token
    with pytest.raises(ConfigError, match=rf"verify token id={vocab}: must be in \[0, {vocab}\)"):
        v.verify([7], [[first, vocab, -1]], True)
    assert len(v.verify([7], [[first, 3, -1]], True)[0].emitted) >= 1  # -1 pads; the sequence goes on
    head = TargetHead.__new__(TargetHead)  # the drafter model's copy of the target's embedding and LM head
    head.embed = head.lm_head = target.model.embed_tokens.weight.detach()
    d = BlockDrafter(drafter, head, 2, 64)
    with pytest.raises(ConfigError, match=rf"bonus={vocab}: must be a token id in \[0, {vocab}\)"):
        d.draft([7], [torch.zeros(0)], [torch.zeros(0)], [vocab], 4)  # refused before the K/V are looked at
    assert d.slots.rows == {}


def test_the_tensorrt_llm_model_is_decoupled_unless_rendered_unary(tiny_dirs, tmp_path):
    """make-repo --tensorrt-llm-unary: TensorRT-LLM's decoupled_mode false for the token-level model only."""
    from conftest import run_cli

    target, drafter = map(str, tiny_dirs["llama"])
    streamed = make_repo(RepoConfig(target, drafter, max_seq_len=256), tmp_path / "streamed")
    assert "model_transaction_policy { decoupled: true }" in (streamed / "tensorrt_llm" / "config.pbtxt").read_text()
    done = run_cli(["make-repo", "--target", target, "--drafter", drafter, "--block-size", "4", "--max-seq-len", "256",
                    "--tensorrt-llm-unary", "--out", str(tmp_path / "unary")])
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "unary" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "model_transaction_policy { decoupled: false }" in text and 'string_value: "false"' in text
    assert "decoupled: true" in (tmp_path / "unary" / "dflash" / "config.pbtxt").read_text()


def test_tensorrt_llm_names_are_the_dflash_entry_point_unless_left_out(tiny_dirs, tmp_path):
    """ensemble and tensorrt_llm_bls (TensorRT-LLM's text-level model names: its example client's only --model-name
    choices) render as dflash, their name aside; make-repo --no-trtllm-names leaves them out."""
    from conftest import run_cli

    from trtllm_dflash.serve.triton.render import TRTLLM_NAMES

    target, drafter = map(str, tiny_dirs["llama"])
    repo = make_repo(RepoConfig(target, drafter, block_size=4, max_seq_len=256), tmp_path / "named")
    dflash = (repo / "dflash" / "config.pbtxt").read_text()
    for name in TRTLLM_NAMES:
        text = (repo / name / "config.pbtxt").read_text()
        assert text == dflash.replace('"dflash"', f'"{name}"') and text != dflash
        assert (repo / name / "1" / "model.py").read_bytes() == (repo / "dflash" / "1" / "model.py").read_bytes()
    done = run_cli(["make-repo", "--target", target, "--drafter", drafter, "--block-size", "4", "--max-seq-len", "256",
                    "--no-trtllm-names", "--out", str(tmp_path / "plain")])
    assert done.returncode == 0, done.stderr
    models = json.loads(done.stdout)["models"]
    assert "dflash" in models and not set(TRTLLM_NAMES) & set(models)
    assert json.loads((tmp_path / "plain" / "manifest.json").read_text())["repo_config"]["trtllm_names"] is False
