"""The GPU training pipeline (build_scripts/gpu_train_drafter.sh, build_scripts/gpu_pipeline.py) rehearsed end to end on CPU
with a tiny random target: checksummed parts carried one command at a time, reassembly, the background job (regen →
taps → train → eval through perf/bench_runtime.py) polled by later commands, returned files within the machine's
limits, merge into a loadable drafter, and resume on a fresh machine from the returned checkpoint."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trtllm_dflash.errors import ConfigError
from conftest import repo_script, run_script

gp = repo_script("build_scripts/gpu_pipeline.py")
from tests.conftest import write_tiny_smol

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--device", "cpu", "--num-prompts", "10", "--max-new-tokens", "10", "--max-prompt-len", "300",
       "--gen-batch-size", "4", "--top-k", "4", "--samples-per-step", "2", "--anchors-per-sample", "6",
       "--num-layers", "1", "--block-size", "4", "--lr", "0.003", "--ckpt-every", "3", "--train-seconds", "300",
       "--eval-batch-size", "2", "--eval-max-new-tokens", "8", "--speed-limit", "0", "--distill", "0.5"]


def _script(*args, env=None):
    env = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    return subprocess.run([str(ROOT / "build_scripts" / "gpu_train_drafter.sh"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def _carry_only(carry: Path, dst: Path, names: list[str]) -> Path:
    """What one device command carries: the manifest plus the named parts/files."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    shutil.copyfile(carry / "manifest.json", dst / "manifest.json")
    for n in names:
        (dst / n).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(carry / n, dst / n)
    return dst


@pytest.fixture(scope="module")
def tiny_target_with_tokenizer(smollm2, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template, so prompts, chat template and the HumanEval
    evaluation go through the same code as on the GPU."""
    return write_tiny_smol(tmp_path_factory.mktemp("gpu") / "tiny-smol", smollm2["target"])


@pytest.mark.slow
def test_gpu_pipeline_rehearsal(tiny_target_with_tokenizer, tmp_path):
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Tell me fact number {i} about rivers.", "chat": True})
                            + "\n" for i in range(12)))
    carry, home = tmp_path / "carry", tmp_path / "home"
    r = _script("pack", "--source", tiny_target_with_tokenizer, "--carry", carry, "--part-mib", "4",
                "--prompts", pool, "--eval-prompts", "humaneval", "--num-prompts", "10")
    assert r.returncode == 0, r.stderr
    m = json.loads((carry / "manifest.json").read_text())
    assert m["commands"][-1]["command"].endswith("start --wait 420 --out $OUT --num-prompts 10")
    parts = [p["name"] for p in m["parts"]]
    assert m["kind"] == "hf-tar" and len(parts) >= 3 and all(p["size"] <= 4 * gp.MiB for p in m["parts"])
    assert sum(1 for _ in open(carry / "eval.jsonl")) == 164

    # one part per command; a corrupted part is refused, naming the file
    bad = _carry_only(carry, tmp_path / "cmd-bad", [parts[0]])
    with open(bad / parts[0], "r+b") as f:
        f.write(b"\x00")
    assert gp.main(["recv", "--carry", str(bad), "--home", str(home)]) == 2
    missing = None
    for i, name in enumerate(parts[:-1]):
        extra = list(m["files"]) if i == 0 else []
        res = gp.recv(_carry_only(carry, tmp_path / f"cmd-{i}", [name, *extra]), home)
        assert name in res["have"] and (missing is None or len(res["missing"]) < len(missing))
        missing = res["missing"]
    assert missing == [parts[-1]]
    with pytest.raises(gp.ArtifactError, match="missing"):
        gp.assemble(home)

    # the last part + start: reassembled, verified, job launched in the background; later commands poll it
    last = _carry_only(carry, tmp_path / "cmd-last", [parts[-1]])
    r = _script("start", "--carry", last, "--home", home, *RUN, "--steps", "6", "--eval-limit", "2", "--taps", "cached",
                "--wait", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["started"] is True
    out = tmp_path / "out1"
    for _ in range(8):
        status = gp.poll(home, 30, out)
        if status.get("phase") in ("done", "failed"):
            break
    log_tail = (home / "job.log").read_text()[-3000:]
    assert status["phase"] == "done", log_tail
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= gp.OUT_MAX_FILES and all((out / f).stat().st_size <= gp.OUT_MAX_BYTES for f in files)
    assert {"config.json", "training_config.json", "status.json", "datastore.dflash"} <= set(files)
    returned = json.loads((out / "status.json").read_text())
    assert str(gp.REPO) not in (out / "status.json").read_text()  # repository paths come back repository-relative
    assert returned["train_log"]["records"][-1]["step"] == 6 and set(returned["timings"]) >= {"regen", "taps", "train"}
    tau = returned["eval"]["tau"][0]
    assert tau["lossless"] and tau["num_prompts"] == 2 and tau["block_size"] == 4
    assert [(x["block_size"], x["lossless"]) for x in returned["eval"]["tau"][1:]] == [("4+ngram", True),
                                                                                      ("4+tree", True)]
    assert returned["eval"]["tau"][2]["datastore_tokens"] > 0  # the run's regen, indexed, proposes in the tree

    # returned files -> a drafter the runtime loads, identical to what the machine exported
    from trtllm_dflash.checkpoints import load_pair

    merged = tmp_path / "merged"
    assert gp.main(["merge", "--parts", str(out), "--out", str(merged)]) == 0
    _, d_merged = load_pair(tiny_target_with_tokenizer, merged)
    from trtllm_dflash.runtime.datastore import Datastore

    assert Datastore.load(merged / "datastore.dflash").num_tokens == returned["eval"]["tau"][2]["datastore_tokens"]
    for name in ("training_config.json", "training_log.json"):  # the GPU machine's paths, marked as its own
        text = (merged / name).read_text()
        assert '"/' not in text and '"gpu-machine:/' in text, name
    _, d_home = load_pair(tiny_target_with_tokenizer, home / "drafter")
    for k, v in d_home.state_dict().items():
        torch.testing.assert_close(d_merged.state_dict()[k], v, rtol=1e-2, atol=1e-3)

    # a later run may continue an exported drafter (the shipped one travels with the tracked files): --init is checked
    # before anything is received, and the job warm-starts from it
    assert gp.main(["start", "--carry", str(last), "--home", str(tmp_path / "home-bad"),
                    "--init", str(tmp_path / "no-such-drafter")]) == 2
    assert not (tmp_path / "home-bad").exists()
    r = _script("start", "--carry", carry, "--home", tmp_path / "home3", *RUN, "--steps", "2", "--eval-limit", "0",
                "--taps", "cached", "--init", merged, "--wait", "240", "--out", tmp_path / "out3")
    assert r.returncode == 0, r.stderr
    status3 = json.loads((tmp_path / "out3" / "status.json").read_text())
    assert status3["phase"] == "done", status3.get("job_log_tail")
    assert f"warm start from the drafter in {merged.resolve()}" in status3["job_log_tail"]

    # a fresh machine next time: every part again + the returned checkpoint; training continues at step 6 (taps now
    # computed online by the target at each step, the default)
    home2 = tmp_path / "home2"
    r = _script("start", "--carry", carry, "--home", home2, "--resume-from", out, *RUN, "--steps", "9",
                "--eval-limit", "0", "--wait", "240", "--out", tmp_path / "out2")
    assert r.returncode == 0, r.stderr
    status2 = json.loads((tmp_path / "out2" / "status.json").read_text())
    assert status2["phase"] == "done", status2.get("job_log_tail")
    steps = [rec["step"] for rec in status2["train_log"]["records"]]
    assert steps[-1] == 9 and "resumed from" in status2["job_log_tail"] and "optimizer" in status2["job_log_tail"]
    assert "taps" not in status2["timings"] and status2["train_log"]["data"]["num_sequences"] >= 8


def test_pack_leaves_a_warm_start_drafters_training_prompts_behind(tmp_path):
    source = tmp_path / "target.gguf"  # pack only splits and checksums the file
    source.write_bytes(bytes(range(256)) * 40)
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"fact {i}", "chat": True}) + "\n" for i in range(12)))
    used = tmp_path / "training_prompts.jsonl"
    used.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "", "chat": True}) + "\n" for i in (0, 5, 11, 99)))
    m = gp.pack(source, tmp_path / "carry", 0.004, pool, None, [], [used])
    with gzip.open(tmp_path / "carry" / "prompts.jsonl.gz", "rt") as f:
        ids = [json.loads(line)["id"] for line in f]
    assert ids == [f"p{i}" for i in range(12) if i not in (0, 5, 11)]  # the rest, in pool order
    assert m["prompts"] == {"rows": 9, "excluded": 3, "exclude": [str(used)]}
    assert b"".join((tmp_path / "carry" / p["name"]).read_bytes() for p in m["parts"]) == source.read_bytes()
    everything = gp.pack(source, tmp_path / "carry2", 0.004, pool, None, [])
    assert everything["prompts"]["rows"] == 12
    assert gp.main(["pack", "--source", str(source), "--carry", str(tmp_path / "c3"), "--prompts", str(pool),
                    "--exclude", str(tmp_path / "nope.jsonl")]) == 2  # named, exit 2
    # a pool that an exclude has used up is refused before anything is written, naming the fix
    with pytest.raises(ConfigError, match=r"--num-prompts.*only 9 rows .* left after --exclude \(3 left behind\).*"
                                          r"--passes 2"):
        gp.pack(source, tmp_path / "c4", 0.004, pool, None, [], [used], num_prompts=10)
    assert not (tmp_path / "c4").exists()
    assert gp.main(["pack", "--source", str(source), "--carry", str(tmp_path / "c5"), "--prompts", str(pool)]) == 2
    ok = gp.pack(source, tmp_path / "c6", 0.004, pool, None, [], [used], num_prompts=9)
    assert ok["prompts"]["num_prompts"] == 9 and ok["commands"][-1]["command"].endswith("--num-prompts 9")
    assert everything["commands"][-1]["command"].endswith("start --wait 420 --out $OUT")  # the default: no flag


def test_pack_plans_the_fewest_commands_within_the_transfer_cap(tmp_path, monkeypatch):
    """Part size chosen against the working tree's size (it grows as the shipped drafter does), resume files planned
    into the same sequence of device calls, and no command over the cap."""
    monkeypatch.setattr(gp, "TRANSFER_BUDGET", 8 * gp.MiB)
    monkeypatch.setattr(gp, "tree_bytes", lambda repo: 3 * gp.MiB)  # room: 5 MiB per command
    source = tmp_path / "target.gguf"
    source.write_bytes(os.urandom(12 * gp.MiB))
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"fact {i}", "chat": True}) + "\n" for i in range(9)))
    resume = tmp_path / "resume"
    resume.mkdir()
    for i in (1, 2):
        (resume / f"{gp.STATE_PREFIX}-{i:05d}-of-00002.safetensors").write_bytes(os.urandom(2 * gp.MiB))
    (resume / "status.json").write_text("{}")
    m = gp.pack(source, tmp_path / "carry", None, pool, None, [], resume=resume, repo=tmp_path)
    # 4 MiB parts: 3 commands for the parts, 1 for both 2 MiB shards (3 MiB parts would need 5, 2 MiB parts 6)
    assert [p["size"] for p in m["parts"]] == [4 * gp.MiB] * 3
    cmds = m["commands"]
    assert len(cmds) == 4 and all(c["bytes"] <= 5 * gp.MiB for c in cmds)
    carried = [c for cmd in cmds for c in cmd["carry"] if not c.endswith("manifest.json")]
    want = [f"carry/{p['name']}" for p in m["parts"]] + ["carry/prompts.jsonl.gz"]
    want += [f"resume/{f.name}" for f in sorted(resume.iterdir())]
    assert sorted(carried) == sorted(want)  # each once
    verbs = [c["command"].split("gpu_train_drafter.sh ")[1] for c in cmds]
    assert verbs[-1] == "start --wait 420 --out $OUT --resume-from resume"
    assert all(v.startswith("recv") for v in verbs[:-1])
    for cmd, v in zip(cmds[:-1], verbs):
        assert ("--resume-from resume" in v) == any(c.startswith("resume/") for c in cmd["carry"])
    # an explicit part size that cannot fit is refused, naming the flag and the size that would
    with pytest.raises(gp.ConfigError, match="--part-mib 4 or less"):
        gp.pack(source, tmp_path / "carry", 6, pool, None, [], repo=tmp_path)
    # a resume folder without every shard is refused before anything is written
    (resume / f"{gp.STATE_PREFIX}-00002-of-00002.safetensors").unlink()
    with pytest.raises(gp.ArtifactError, match="missing"):
        gp.pack(source, tmp_path / "carry", None, pool, None, [], resume=resume, repo=tmp_path)


@pytest.mark.slow
def test_short_lease_command_rehearsal(tiny_target_with_tokenizer, tmp_path):
    """build_scripts/gpu_short_lease.sh, the one command a short lease's last call runs, end to end on the CPU: the job
    trains and evaluates beside the correctness steps, the timed steps run after it, and $OUT holds exactly what the
    device tool gives back (at most 8 files)."""
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Name river number {i}.", "chat": True}) + "\n"
                            for i in range(12)))
    carry, prompts, out = tmp_path / "carry", tmp_path / "prompts", tmp_path / "out"
    r = _script("pack", "--source", tiny_target_with_tokenizer, "--carry", carry, "--part-mib", "4",
                "--prompts", pool, "--eval-prompts", "humaneval", "--num-prompts", "10")
    assert r.returncode == 0, r.stderr
    export = run_script("perf/gpu_session.py", ["--export-prompts", prompts])
    assert export.returncode == 0, export.stderr
    run_flags = [f for f in RUN if f not in ("--speed-limit", "0")]
    env = dict(os.environ, PYTHON=sys.executable, LEASE_DEVICE="cpu", DFLASH_GPU_HOME=str(tmp_path / "home"),
               OUT=str(out), LEASE_PROMPTS=str(prompts), LEASE_CHECKS="env,kernel_tests", LEASE_TIMED="dflash_vs_ar",
               LEASE_BLOCK_SIZES="4", LEASE_LIMIT="1")
    lease = subprocess.run(["bash", str(ROOT / "build_scripts" / "gpu_short_lease.sh"), "420", "rehearsal", "--",
                            "--carry", str(carry), *run_flags, "--speed-limit", "1", "--steps", "100000",
                            "--train-seconds", "8", "--eval-limit", "2"],
                           capture_output=True, text=True, env=env, timeout=600)
    assert lease.returncode == 0, lease.stdout[-3000:] + lease.stderr[-3000:]
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert len(files) <= gp.OUT_MAX_FILES and "session.tgz" in files, files
    assert {"p/config.json", "p/training_config.json", "p/status.json", "p/datastore.dflash"} <= set(files)
    status = json.loads((out / "p" / "status.json").read_text())
    assert status["phase"] == "done" and status["eval"]["speed_b1"][0]["lossless"], status.get("job_log_tail")
    import tarfile

    with tarfile.open(out / "session.tgz") as tar:
        names = set(tar.getnames())
        assert {"lease/lease.log", "lease/checks/gpu_session.json", "lease/timed/gpu_session.json"} <= names, names
        checks = json.load(tar.extractfile("lease/checks/gpu_session.json"))["steps"]
        timed = json.load(tar.extractfile("lease/timed/gpu_session.json"))["steps"]
    assert checks["env"]["commit"] == "rehearsal" and checks["kernel_tests"]["exit"] == 0
    runs = timed["dflash_vs_ar"]["runs"]
    assert [r["exit"] for r in runs] == [0, 0, 0, 0] and all(line["lossless"] for r in runs for line in r["results"])
    assert "job still running" not in lease.stdout


def test_repository_paths_come_back_repository_relative():
    """The job runs from the GPU machine's checkout: a path into it (``--init`` of the shipped drafter) is returned
    relative to the repository, other absolute paths stay for ``merge`` to mark as the GPU machine's."""
    text = json.dumps({"init": str(gp.REPO / "trtllm_dflash" / "data" / "drafters" / "d"), "out": "/tmp/x"})
    assert gp.repo_relative(text) == '{"init": "trtllm_dflash/data/drafters/d", "out": "/tmp/x"}'
    marked = '{"init": "trtllm_dflash/data/drafters/d", "out": "gpu-machine:/tmp/x"}'
    assert gp.gpu_portable(gp.repo_relative(text)) == marked


def test_start_passes_the_tv_weight_on_and_refuses_a_bad_one_before_the_job(tmp_path):
    """``start --tv W`` reaches the trainer's config (the total-variation objective, ``train --tv``); a weight the
    trainer would refuse (here more than 1 - distill) exits 2 naming it before anything is received or started."""
    cfg = gp._train_config(tmp_path, {**gp.RUN_DEFAULTS, "distill": 0.25, "tv": 0.5})
    assert (cfg.distill, cfg.tv, cfg.loss_vocab) == (0.25, 0.5, "full")
    assert gp._train_config(tmp_path, {k: v for k, v in gp.RUN_DEFAULTS.items() if k != "tv"}).tv == 0.0
    home = tmp_path / "home"
    r = _script("start", "--carry", tmp_path / "no-carry", "--home", home, *RUN, "--tv", "0.8")
    assert r.returncode == 2 and "tv" in r.stderr and "0.8" in r.stderr, r.stderr
    assert not (home / "run_args.json").exists() and not (home / "status.json").exists()
