"""The drafter-training pipeline for a borrowed GPU machine, in commands that each fit the machine's limits.

Development tooling, not part of the package: it exists for the project's own lent GPU machine and its transfer and
time limits. A user trains on any machine with ``trtllm-dflash train-drafter`` (docs/training.md); this script drives
the same trainer through ``build_scripts/gpu_train_drafter.sh``.

The machine (see README "Training a drafter on a GPU") runs one command at a time for at most 10 minutes, receives
at most 64 MiB per command (the repository's tracked files included), returns at most 8 files of 16 MiB, has no
network and no ``gguf`` package, and is lent for 30 minutes. So:

    pack     (here)  split the target (the SmolLM2 GGUF, 97 MB, or an HF directory for rehearsals) into checksummed
                     parts under an ignored folder (default artifacts/gpu), with the prompt pool, the evaluation
                     prompts and the gguf wheel; manifest.json records every size and SHA-256 and the device commands
                     (parts sized so that each fits next to the working tree, which every command carries)
    recv     (GPU)   verify the parts carried by this command and move them into the machine's state directory
                     (--home, outside the repository copy, kept while the machine stays warm)
    start    (GPU)   once every part is there: reassemble, verify, install the wheel (if needed), convert to an HF
                     directory, and launch ``run`` in the background (its own session, so it outlives the command)
    run      (GPU, background) prompts → regeneration (batched, ids + top-k logits) → training (time-boxed; taps from the
                     target at each step, or cached first with --taps cached) →
                     evaluation (τ over the evaluation prompts, DFlash vs autoregressive tokens/s) → done; status.json
                     after every shard and phase; resumable at each phase
    poll     (GPU)   wait up to --wait seconds for the job, print its status, and write the latest checkpoint to
                     --out: fp32 training-space weights in ≤ 16 MiB shards + config.json, training_config.json and
                     status.json (7 files for SmolLM2's drafter), enough to resume on a fresh machine (``start --resume-from``)
    merge    (here)  turn returned files into a z-lab drafter directory (bf16 model.safetensors)

Everything that crosses the boundary is checked: a part with a wrong size or SHA-256, a missing part, or a returned
file over the limits is an error naming the file and the fix.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from trtllm_dflash.errors import ArtifactError, ConfigError, DFlashError
from trtllm_dflash.runtime.datastore import DATASTORE_FILE

log = logging.getLogger(__name__)

MiB = 2**20
OUT_MAX_FILES, OUT_MAX_BYTES = 8, 16 * MiB
STATE_PREFIX = "drafter-fp32"
REPO = Path(__file__).resolve().parents[1]  # the repository root (the GPU machine runs from the source tree)
RUN_DEFAULTS = dict(num_prompts=24576, max_new_tokens=256, max_prompt_len=384, gen_batch_size=512, top_k=8,
                    steps=4000, samples_per_step=16, anchors_per_sample=128, num_layers=3, block_size=16, lr=6e-4,
                    seed=0, train_seconds=600, eval_limit=164, eval_batch_size=41, eval_max_new_tokens=256,
                    speed_limit=8, device="cuda", ckpt_every=200, autocast="bf16", distill=0.0, tv=0.0, taps="online",
                    init="target")  # start's flags, planned for one 30-minute lease
RUN_FLAGS = tuple(RUN_DEFAULTS)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4 * MiB), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: Path, obj) -> None:
    _write_text(path, json.dumps(obj, indent=1) + "\n")


def repo_relative(text: str) -> str:
    """Paths into this repository made repository-relative: the GPU machine runs from a checkout whose location means
    nothing where its files arrive (``--init`` of the shipped drafter in the training log, tracebacks in the log)."""
    return text.replace(f"{REPO}{os.sep}", "")


# ---------------------------------------------------------------- pack (here)

def pack(source: Path, carry: Path, part_mib: float | None, prompts: Path, eval_prompts: Path | None,
         wheels: list[Path], exclude: list[Path] = (), resume: Path | None = None, repo: Path | None = None,
         num_prompts: int | None = None) -> dict:
    """Split ``source`` (a .gguf file, or an HF directory which is tarred first) into parts of ``part_mib`` (None:
    the size that needs the fewest device commands next to this working tree); the prompt pool travels without the
    rows whose ids are in the ``exclude`` JSONL(.gz) files (a warm-start drafter's ``training_prompts.jsonl.gz``: the
    run then regenerates prompts it has never seen). ``resume``: a folder of files a previous poll returned, planned
    into the commands too (``recv --resume-from``). ``num_prompts``: the prompts the run regenerates (planned into
    ``start``); fewer pool rows left than that is refused here, not found out on the GPU. ``manifest["commands"]`` is
    the sequence of device calls."""
    if not source.exists():
        raise ArtifactError(source, "target source not found", "pass the GGUF file or an HF model directory")
    if not prompts.is_file():
        raise ArtifactError(prompts, "prompt pool not found", 'pass a JSONL of {"id", "prompt", "chat"}')
    if part_mib is not None and not part_mib > 0:
        raise ConfigError("--part-mib", part_mib, "must be > 0 (or left out: sized to the working tree)")
    resume_files = _resume_files(resume) if resume is not None else []
    for f in exclude:
        if not f.is_file():
            raise ArtifactError(f, "--exclude file not found", "pass JSONL files of {\"id\", ...} rows")
    from trtllm_dflash.train.pool import jsonl_ids

    drop = jsonl_ids(exclude)
    lines = [line for line in prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [line for line in lines if not drop or json.loads(line)["id"] not in drop]
    kept, excluded = len(rows), len(lines) - len(rows)
    if num_prompts is not None and kept < num_prompts:
        raise ConfigError("--num-prompts", num_prompts,
                          f"only {kept:,} rows of {prompts} are left after --exclude ({excluded:,} left behind); pack "
                          "the two-pass pool (python -m trtllm_dflash.train.pool --passes 2 --out "
                          "artifacts/pool/pool-p2.jsonl) or pass a smaller --num-prompts to pack")
    carry.mkdir(parents=True, exist_ok=True)
    for old in carry.glob("part-*"):
        old.unlink()
    with gzip.GzipFile(carry / "prompts.jsonl.gz", "wb", mtime=0) as g:
        g.write("".join(r + "\n" for r in rows).encode())
    files = {"prompts.jsonl.gz": sha256(carry / "prompts.jsonl.gz")}
    if eval_prompts is not None and str(eval_prompts) in ("humaneval", "mtbench"):
        from trtllm_dflash.datasets import load_prompts

        rows = "".join(json.dumps({"id": q.id, "prompt": q.text}) + "\n" for q in load_prompts(str(eval_prompts)))
        (carry / "eval.jsonl").write_text(rows)
        files["eval.jsonl"] = sha256(carry / "eval.jsonl")
    elif eval_prompts is not None:
        shutil.copyfile(eval_prompts, carry / "eval.jsonl")
        files["eval.jsonl"] = sha256(carry / "eval.jsonl")
    (carry / "wheels").mkdir(exist_ok=True)
    for old in (carry / "wheels").iterdir():  # the folder travels whole: no wheels of an earlier pack
        if old.name not in [w.name for w in wheels]:
            old.unlink()
    for w in wheels:
        shutil.copyfile(w, carry / "wheels" / w.name)
        files[f"wheels/{w.name}"] = sha256(carry / "wheels" / w.name)
    if source.is_dir():
        kind, blob = "hf-tar", carry / "target.tar"
        with tarfile.open(blob, "w") as tar:
            for f in sorted(source.iterdir()):
                if f.is_file():
                    tar.add(f, arcname=f.name)
        name = source.name
    else:
        kind, blob, name = "gguf", source, source.name
    size = blob.stat().st_size
    repo = repo or Path.cwd()
    room = TRANSFER_BUDGET - tree_bytes(repo)
    small = [(k, (carry / k).stat().st_size) for k in files]
    small += [(os.path.relpath(f, repo), f.stat().st_size) for f in resume_files]
    step = int(part_mib * MiB) if part_mib is not None else _auto_part_bytes(size, small, room)
    parts = []
    with open(blob, "rb") as f:
        for n in _part_sizes(size, step):
            data = f.read(n)
            path = carry / f"part-{len(parts):03d}"
            path.write_bytes(data)
            parts.append({"name": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    if kind == "hf-tar":
        blob.unlink()
    manifest = {"kind": kind, "name": name, "size": size, "sha256": sha256(source) if kind == "gguf" else None,
                "parts": parts, "files": files,
                "prompts": {"rows": kept, "excluded": excluded, "exclude": [str(f) for f in exclude]}}
    if num_prompts is not None:
        manifest["prompts"]["num_prompts"] = num_prompts
    if kind == "hf-tar":  # the whole tar's checksum, recomputed from the parts
        h = hashlib.sha256()
        for p in parts:
            h.update((carry / p["name"]).read_bytes())
        manifest["sha256"] = h.hexdigest()
    manifest["commands"] = plan_commands(os.path.relpath(carry, repo), manifest, small, room,
                                         os.path.relpath(resume, repo) if resume is not None else None)
    _write_json(carry / "manifest.json", manifest)
    return manifest


TRANSFER_BUDGET = 63 * MiB  # one command's working tree + carried paths (64 MiB), less a margin


def tree_bytes(repo: Path) -> int:
    """Bytes of what a device command sends besides ``carry``: tracked and untracked-not-ignored files."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                               capture_output=True, check=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    total = 0
    for n in filter(None, names):
        path = repo / os.fsdecode(n)
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


MANIFEST_BYTES = 64 * 1024  # manifest.json travels with every command (a few KiB; this much is reserved)


def _part_sizes(size: int, step: int) -> list[int]:
    return [min(step, size - i) for i in range(0, max(size, 1), step)]


def _bins(parts: list[int], small: list[tuple[str, int]], room: int) -> list[dict]:
    """One command per part, then each other file (largest first) into the command with the most room left, or a
    command of its own; a ConfigError names whatever cannot fit one command at all."""
    bins = []
    for i, size in enumerate(parts):
        if size + MANIFEST_BYTES > room:
            raise ConfigError("--part-mib", round(size / MiB, 1), f"does not fit one command next to the "
                              f"{(TRANSFER_BUDGET - room) / MiB:.1f} MiB working tree (64 MiB cap)",
                              f"use --part-mib {max(1, int((room - MiB) / MiB))} or less, or leave it out")
        bins.append({"part": i, "files": [], "bytes": size + MANIFEST_BYTES})
    for name, size in sorted(small, key=lambda f: -f[1]):
        if size + MANIFEST_BYTES > room:
            raise ConfigError("carried file", f"{name} ({size / MiB:.1f} MiB)", "does not fit any command next to "
                              f"the {(TRANSFER_BUDGET - room) / MiB:.1f} MiB working tree", "carry a smaller one")
        best = min(bins, key=lambda c: c["bytes"], default=None)
        if best is None or best["bytes"] + size > room:
            best = {"part": None, "files": [], "bytes": MANIFEST_BYTES}
            bins.append(best)
        best["files"].append(name)
        best["bytes"] += size
    return bins


def _auto_part_bytes(size: int, small: list[tuple[str, int]], room: int) -> int:
    """The whole-MiB part size that needs the fewest commands (the largest such) next to this working tree."""
    best = None
    for mib in range(max(1, (room - MANIFEST_BYTES) // MiB), 0, -1):
        step = mib * MiB
        try:
            n = len(_bins(_part_sizes(size, step), small, room))
        except ConfigError:
            continue
        if best is None or n < best[0]:
            best = (n, step)
    if best is None:
        raise ConfigError("working tree", f"{(TRANSFER_BUDGET - room) / MiB:.1f} MiB", "leaves no room for any part "
                          "(64 MiB per command, tracked and untracked-not-ignored files included)",
                          "move large untracked files under an ignored folder such as artifacts/")
    return best[1]


def plan_commands(rel: str, manifest: dict, small: list[tuple[str, int]], room: int,
                  resume_rel: str | None = None) -> list[dict]:
    """The device calls, in order, so that none exceeds ``room`` (the transfer budget less the working tree): ``recv``
    for each but the last (``--resume-from`` where it carries returned checkpoint files), then ``start``; each with the
    paths it carries. ``small``: (name, bytes) of the carry folder's files and the resume files (repository-relative)."""
    bins = _bins([p["size"] for p in manifest["parts"]], small, room)
    num_prompts = manifest.get("prompts", {}).get("num_prompts", RUN_DEFAULTS["num_prompts"])
    start = "start --wait 420 --out $OUT" + (
        f" --num-prompts {num_prompts}" if num_prompts != RUN_DEFAULTS["num_prompts"] else "")
    cmds = []
    for i, b in enumerate(bins):
        carried = [f"{rel}/manifest.json"] + ([f"{rel}/{manifest['parts'][b['part']]['name']}"]
                                             if b["part"] is not None else [])
        for name in b["files"]:
            if name in manifest["files"]:
                carried.append(f"{rel}/{name.split('/')[0]}" if name.startswith("wheels/") else f"{rel}/{name}")
            else:
                carried.append(name)
        verb = start if i == len(bins) - 1 else "recv"
        if resume_rel and (verb.startswith("start") or any(n not in manifest["files"] for n in b["files"])):
            verb += f" --resume-from {resume_rel}"
        cmds.append({"command": f"bash build_scripts/gpu_train_drafter.sh {verb}",
                     "carry": list(dict.fromkeys(carried)), "bytes": b["bytes"],
                     "tree_mib": round((TRANSFER_BUDGET - room + b["bytes"]) / MiB, 1)})
    return cmds


def _resume_files(d: Path) -> list[Path]:
    """The returned checkpoint files ``start --resume-from`` needs (see ``stash_resume``), all of them."""
    missing = _resume_missing(d)
    if missing:
        raise ArtifactError(d, f"missing {missing}", "copy every file the last poll returned there")
    names = [f.name for f in d.glob(f"{STATE_PREFIX}-*.safetensors")] + [
        n for n in ("status.json", "config.json", "training_config.json") if (d / n).is_file()]
    return [d / n for n in sorted(names)]


# ---------------------------------------------------------------- recv / start (GPU)

def _manifest(carry: Path) -> dict:
    path = carry / "manifest.json"
    if not path.is_file():
        raise ArtifactError(path, "manifest missing", "carry artifacts/gpu/manifest.json with every command (pack)")
    return json.loads(path.read_text())


def recv(carry: Path, home: Path) -> dict:
    """Verify every part and file carried this time; move them into ``home``; report what is still missing."""
    m = _manifest(carry)
    (home / "parts").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(carry / "manifest.json", home / "manifest.json")
    for p in m["parts"]:
        src = carry / p["name"]
        if src.is_file() and not (home / "parts" / p["name"]).is_file():
            got = (src.stat().st_size, sha256(src))
            if got != (p["size"], p["sha256"]):
                raise ArtifactError(src, f"size/sha256 {got} != manifest {(p['size'], p['sha256'])}",
                                    "re-run pack here and carry the new part")
            shutil.copyfile(src, home / "parts" / (p["name"] + ".tmp"))
            os.replace(home / "parts" / (p["name"] + ".tmp"), home / "parts" / p["name"])
    for rel, digest in m["files"].items():
        src, dst = carry / rel, home / rel
        if src.is_file() and not dst.is_file():
            if sha256(src) != digest:
                raise ArtifactError(src, "sha256 differs from the manifest", "re-run pack here")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    have = [p["name"] for p in m["parts"] if (home / "parts" / p["name"]).is_file()]
    missing = [p["name"] for p in m["parts"] if p["name"] not in have]
    missing += [rel for rel in m["files"] if not (home / rel).is_file()]
    return {"have": have, "missing": missing}


def assemble(home: Path) -> Path:
    """The target as an HF directory under ``home`` (from the verified parts), converted once."""
    m = json.loads((home / "manifest.json").read_text())
    target = home / "target"
    if (target / ".complete").is_file():
        return target
    missing = [p["name"] for p in m["parts"] if not (home / "parts" / p["name"]).is_file()]
    missing += [rel for rel in m["files"] if not (home / rel).is_file()]
    if missing:
        raise ArtifactError(home, f"missing {missing}", "run recv with a command that carries each of them")
    blob = home / ("target.gguf" if m["kind"] == "gguf" else "target.tar")
    h = hashlib.sha256()
    with open(blob, "wb") as out:
        for p in m["parts"]:
            data = (home / "parts" / p["name"]).read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != m["sha256"]:
        raise ArtifactError(blob, "reassembled sha256 differs from the manifest", "re-run pack and resend the parts")
    if m["kind"] == "gguf":
        _ensure_gguf(home)
        from trtllm_dflash.assets import convert_gguf

        gguf = home / "gguf" / m["name"]
        gguf.parent.mkdir(exist_ok=True)
        os.replace(blob, gguf)
        convert_gguf(gguf, target)
    else:
        tmp = home / "target.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(blob) as tar:
            tar.extractall(tmp, filter="data")
        (tmp / ".complete").write_text(f"unpacked from {m['name']}\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        blob.unlink()
    return target


def _ensure_gguf(home: Path) -> None:
    """transformers' GGUF loader needs the ``gguf`` package; install the carried wheel into this interpreter's
    environment if absent (its site-packages is already on the import path: no path to add)."""
    try:
        import gguf  # noqa: F401
        return
    except ImportError:
        pass
    wheels = sorted((home / "wheels").glob("gguf-*.whl"))
    if not wheels:
        raise ArtifactError(home / "wheels", "no gguf wheel", "pack with --wheel gguf-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *map(str, wheels)],
                   check=True)
    importlib.invalidate_caches()


def stash_resume(src: Path, home: Path) -> list[str]:
    """Copy the returned checkpoint files carried this time into home/resume (the fp32 shards may need more than one
    command next to a part); returns what is still missing there."""
    dst = home / "resume"
    dst.mkdir(parents=True, exist_ok=True)
    for f in list(src.glob(f"{STATE_PREFIX}-*.safetensors")) + [src / n for n in ("status.json", "config.json",
                                                                                   "training_config.json")]:
        if f.is_file():
            shutil.copyfile(f, dst / (f.name + ".tmp"))
            os.replace(dst / (f.name + ".tmp"), dst / f.name)
    return _resume_missing(dst)


def _resume_missing(d: Path) -> list[str]:
    shards = sorted(d.glob(f"{STATE_PREFIX}-*-of-*.safetensors"))
    if not shards:
        return [f"{STATE_PREFIX}-*.safetensors"]
    n = int(shards[0].stem.rsplit("-of-", 1)[1])
    want = [f"{STATE_PREFIX}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] + ["status.json"]
    return [w for w in want if not (d / w).is_file()]


def resolve_init(init: str) -> str:
    """``--init``: 'target', 'random', or a drafter directory (e.g. the shipped one, which travels with the repository's
    tracked files) made absolute here, since the background job may run from another directory."""
    if init in ("target", "random"):
        return init
    d = Path(init).resolve()
    if not ((d / "config.json").is_file() and (d / "model.safetensors").is_file()):
        raise ConfigError("--init", init, "is not a drafter directory (config.json + model.safetensors)",
                          "pass 'target', 'random' or e.g. trtllm_dflash/data/drafters/smollm2-135m-instruct-dflash")
    return str(d)


def start(carry: Path, home: Path, run_args: dict, resume_from: Path | None) -> dict:
    run_args = run_args | {"init": resolve_init(run_args.get("init", "target"))}
    _train_config(home, run_args).validate()  # a bad training flag is refused here, not after the regeneration
    state = recv(carry, home)
    if resume_from is not None:
        state["resume_missing"] = stash_resume(resume_from, home)
        if state["resume_missing"]:
            raise ArtifactError(home / "resume", f"missing {state['resume_missing']}",
                                "carry them with recv --resume-from DIR first")
    assemble(home)
    if (home / "resume").is_dir() and not _resume_missing(home / "resume"):
        _seed_resume(home / "resume", home)
    status = read_status(home)
    if status.get("pid") and _alive(status["pid"]) and status.get("phase") not in ("done", "failed"):
        return {"started": False, "why": f"job {status['pid']} already running", **state}
    _write_json(home / "run_args.json", run_args)
    logf = open(home / "job.log", "ab")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "run", "--home", str(home)],
                            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, cwd=os.getcwd())
    _update_status(home, pid=proc.pid, phase="starting", started=time.time())
    return {"started": True, "pid": proc.pid, **state}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (finished, not yet reaped by this process's parent) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def read_status(home: Path) -> dict:
    path = home / "status.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _update_status(home: Path, **kw) -> dict:
    s = read_status(home) | kw | {"updated": time.time()}
    _write_json(home / "status.json", s)
    return s


# ---------------------------------------------------------------- resume state

def _seed_resume(src: Path, home: Path) -> None:
    """A returned checkpoint (drafter-fp32-*.safetensors + status.json) becomes work/checkpoint.pt (no optimizer)."""
    import torch
    from safetensors import safe_open

    shards = sorted(src.glob(f"{STATE_PREFIX}-*.safetensors"))
    if not shards:
        raise ArtifactError(src, f"no {STATE_PREFIX}-*.safetensors", "pass the folder a previous poll returned")
    state, meta = {}, {}
    for s in shards:
        with safe_open(str(s), "pt") as f:
            meta = f.metadata() or meta
            state.update({k: f.get_tensor(k) for k in f.keys()})
    status = json.loads((src / "status.json").read_text()) if (src / "status.json").is_file() else {}
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    if (work / "checkpoint.pt").is_file():
        return  # the machine still holds a newer, complete checkpoint
    tap_scale = state.pop("tap_scale")
    log_doc = status.get("train_log") or {"records": [], "held_out": []}
    torch.save({"drafter": state, "step": int(meta["step"]), "log": log_doc, "tap_scale": tap_scale},
               work / "checkpoint.pt")


def emit(home: Path, out: Path) -> list[Path]:
    """The latest checkpoint + status into ``out`` within the return limits (≤ 8 files of ≤ 16 MiB)."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    written = []
    ckpt = home / "work" / "checkpoint.pt"
    status = read_status(home)
    if ckpt.is_file():
        from trtllm_dflash.models.weights import write_state_dict

        ck = torch.load(ckpt, map_location="cpu", weights_only=False)
        state = {k: v.float().contiguous() for k, v in ck["drafter"].items()} | {"tap_scale": ck["tap_scale"].float()}
        groups, cur, cur_bytes = [], {}, 0
        for k, v in state.items():
            nbytes = v.numel() * 4
            if cur and cur_bytes + nbytes > OUT_MAX_BYTES - MiB:  # headroom for the safetensors header
                groups.append(cur)
                cur, cur_bytes = {}, 0
            cur[k], cur_bytes = v, cur_bytes + nbytes
        groups.append(cur)
        for i, g in enumerate(groups):
            path = out / f"{STATE_PREFIX}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            write_state_dict(g, path, metadata={"format": "pt", "step": str(ck["step"])})
            written.append(path)
        status["train_log"] = ck["log"]
        store = home / "drafter" / DATASTORE_FILE
        if store.is_file() and store.stat().st_size <= OUT_MAX_BYTES:  # at the end of a run: the regen, indexed
            shutil.copyfile(store, out / DATASTORE_FILE)
            written.append(out / DATASTORE_FILE)
        for name in ("config.json", "training_config.json"):
            if (home / "drafter" / name).is_file():
                _write_text(out / name, repo_relative((home / "drafter" / name).read_text()))
                written.append(out / name)
    tail = (home / "job.log").read_bytes()[-6000:].decode(errors="replace") if (home / "job.log").is_file() else ""
    _write_text(out / "status.json", repo_relative(json.dumps(status | {"job_log_tail": tail}, indent=1)) + "\n")
    written.append(out / "status.json")
    check_out(out)
    return written


def check_out(out: Path) -> None:
    files = [p for p in out.rglob("*") if p.is_file()]
    if len(files) > OUT_MAX_FILES:
        raise ArtifactError(out, f"{len(files)} files", f"at most {OUT_MAX_FILES} come back; write fewer")
    for p in files:
        if p.stat().st_size > OUT_MAX_BYTES:
            raise ArtifactError(p, f"{p.stat().st_size} bytes", "files over 16 MiB do not come back; shard it")


def merge(parts: Path, out: Path) -> Path:
    """Returned files → a z-lab drafter directory: config.json + bf16 model.safetensors with the tap
    standardisation folded into fc (as train/trainer.exported_state), training_config.json, training_log.json."""
    import torch
    from safetensors import safe_open

    from trtllm_dflash.models.weights import write_state_dict
    from trtllm_dflash.staging import staged_output

    state = {}
    for s in sorted(parts.glob(f"{STATE_PREFIX}-*.safetensors")):
        with safe_open(str(s), "pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    if not state or not (parts / "config.json").is_file():
        raise ArtifactError(parts, "no returned drafter state or config.json", "pass the folder a poll returned")
    scale = state.pop("tap_scale")
    state["fc.weight"] = state["fc.weight"] * scale[None, :]
    status = json.loads((parts / "status.json").read_text()) if (parts / "status.json").is_file() else {}
    with staged_output(out, force=True) as tmp:
        write_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, tmp / "model.safetensors")
        for name in ("config.json", "training_config.json"):
            if (parts / name).is_file():
                (tmp / name).write_text(gpu_portable((parts / name).read_text()))
        if status.get("train_log"):
            (tmp / "training_log.json").write_text(gpu_portable(json.dumps(status["train_log"], indent=1)) + "\n")
        if status.get("eval"):
            (tmp / "gpu_eval.json").write_text(gpu_portable(json.dumps(status["eval"], indent=1)) + "\n")
        if (parts / DATASTORE_FILE).is_file():
            shutil.copyfile(parts / DATASTORE_FILE, tmp / DATASTORE_FILE)
    return out


def gpu_portable(text: str) -> str:
    """Provenance written on the GPU machine names its paths (``/tmp/dflash-gpu/target``): marked as that machine's
    (``gpu-machine:/tmp/...``) so no shipped file holds a path that reads as one on the user's machine."""
    return re.sub(r'"(/[^"]*)"', r'"gpu-machine:\1"', text)


# ---------------------------------------------------------------- run (GPU, background)

def run(home: Path) -> None:
    _update_status(home, pid=os.getpid(), phase="running")
    try:
        _run(home, json.loads((home / "run_args.json").read_text()))
    except BaseException as exc:
        _update_status(home, phase="failed", error=f"{type(exc).__name__}: {exc}")
        raise


def _run(home: Path, a: dict) -> None:
    import torch

    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.datasets import read_jsonl
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids
    from trtllm_dflash.train.regen import build_regen, samples_without_taps, tap_shards

    t0 = time.monotonic()
    timings = read_status(home).get("timings", {})

    def phase_done(name: str, since: float) -> None:
        timings[name] = round(timings.get(name, 0) + time.monotonic() - since, 1)
        _update_status(home, timings=timings)

    if a["device"] == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    target_dir = home / "target"
    tok = load_tokenizer(target_dir)
    rows = read_jsonl(home / "prompts.jsonl.gz")[: a["num_prompts"]]
    encoded = [encode_prompt(tok, r["prompt"], bool(r.get("chat", True))) for r in rows]
    encoded = [e for e in encoded if len(e) <= a["max_prompt_len"]]
    target = TargetModel.from_pretrained(target_dir, device=a["device"])
    stops = stop_token_ids(tok, target.spec.eos_token_ids)

    t = time.monotonic()
    regen = build_regen(target, encoded, home / "regen", max_new_tokens=a["max_new_tokens"], stop_token_ids=stops,
                        batch_size=a["gen_batch_size"], top_k=a["top_k"], seed=a["seed"],
                        progress=lambda d, n: _update_status(home, phase="regen", progress=[d, n]))
    phase_done("regen", t)
    cfg = _train_config(home, a)
    from trtllm_dflash.train.pipeline import drafter_spec
    from trtllm_dflash.train.trainer import train

    spec = drafter_spec(cfg, target.spec)
    shards, samples = [], None
    if a["taps"] == "online":  # taps computed per step by the target: ~40 B/token in memory instead of 3.5 KB
        samples = samples_without_taps(regen)
    else:
        t = time.monotonic()
        shards = tap_shards(target, regen, home / "taps", spec.target_layer_ids, batch_size=a["gen_batch_size"],
                            progress=lambda d, n: _update_status(home, phase="taps", progress=[d, n]))
        phase_done("taps", t)
    _update_status(home, phase="train", progress=None, num_sequences=len(encoded))
    Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    train(cfg, Path(cfg.work_dir), target, spec, shards, resume=(Path(cfg.work_dir) / "checkpoint.pt").is_file(),
          deadline=t + a["train_seconds"], samples=samples)
    phase_done("train", t)
    del target
    # the regenerated responses, indexed: the tree verify's retrieval datastore (runtime.datastore), in the drafter
    # directory where the evaluation's N+tree and ``merge`` find it
    from trtllm_dflash.commands.datastore import build

    build([home / "regen"]).save(home / "drafter" / DATASTORE_FILE)
    if a["eval_limit"] != 0:
        _update_status(home, phase="eval")
        t = time.monotonic()
        _update_status(home, eval=evaluate(home, a))
        phase_done("eval", t)
    _update_status(home, phase="done", wall_s=round(time.monotonic() - t0, 1))


def _train_config(home: Path, a: dict):
    from trtllm_dflash.train.cli import add_arguments
    from trtllm_dflash.train.config import TrainConfig

    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = ["--target", str(home / "target"), "--out", str(home / "drafter"), "--work-dir", str(home / "work"),
             "--num-layers", str(a["num_layers"]), "--block-size", str(a["block_size"]), "--steps", str(a["steps"]),
             "--samples-per-step", str(a["samples_per_step"]), "--anchors-per-sample", str(a["anchors_per_sample"]),
             "--lr", str(a["lr"]), "--seed", str(a["seed"]), "--device", a["device"], "--ckpt-every",
             str(a["ckpt_every"]), "--max-new-tokens", str(a["max_new_tokens"]), "--max-prompt-len",
             str(a["max_prompt_len"]), "--gen-batch-size", str(a["gen_batch_size"]), "--data",
             str(home / "prompts.jsonl.gz"), "--threads", str(os.cpu_count() or 1), "--log-every", "20",
             "--autocast", a["autocast"], "--distill", str(a["distill"]), "--tv", str(a.get("tv", 0.0)),
             "--init", a.get("init", "target")]
    return TrainConfig.from_args(p.parse_args(flags))


def evaluate(home: Path, a: dict) -> dict:
    """τ over the evaluation prompts (B = block size and 8, the block size with prompt lookup where the context repeats
    (``N+ngram``) and with the tree verify (``N+tree``), batched: τ does not depend on the batch) and the
    batch-1 DFlash (plain, ``N+ngram`` and ``N+tree``) vs autoregressive tokens/s on the first ``speed_limit`` of them,
    through perf/bench_runtime.py."""
    bench = [sys.executable, str(REPO / "perf" / "bench_runtime.py")]
    common = ["--dataset", str(home / "eval.jsonl"), "--target", str(home / "target"), "--drafter",
              str(home / "drafter"), "--device", a["device"], "--max-new-tokens", str(a["eval_max_new_tokens"]),
              "--json"]
    res = {}
    b, ngram, tree = str(a["block_size"]), f"{a['block_size']}+ngram", f"{a['block_size']}+tree"
    blocks = ",".join(dict.fromkeys([b, "8"] if a["block_size"] > 8 else [b]))
    runs = {"tau": ["--limit", str(a["eval_limit"]), "--batch-size", str(a["eval_batch_size"]), "--block-size",
                    f"{blocks},{ngram},{tree}"],
            "speed_b1": ["--limit", str(a["speed_limit"]), "--batch-size", "1", "--block-size", f"{b},{ngram},{tree}"]}
    for name, extra in runs.items():
        if name == "speed_b1" and a["speed_limit"] == 0:
            continue
        out = home / f"eval-{name}.jsonl"
        proc = subprocess.run([*bench, *common, *extra, "--out", str(out)], capture_output=True, text=True)
        res[name] = ([json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.is_file()
                     else {"error": proc.stderr[-2000:]})
    return res


# ---------------------------------------------------------------- command line

def poll(home: Path, wait: float, out: Path | None) -> dict:
    deadline = time.monotonic() + wait
    while True:
        s = read_status(home)
        finished = s.get("phase") in ("done", "failed") or (s.get("pid") and not _alive(s["pid"]))
        if finished or time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.1, deadline - time.monotonic())))  # a lease's seconds count
    if out is not None:
        emit(home, out)
    return read_status(home)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_pipeline", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    home_default = os.environ.get("DFLASH_GPU_HOME", "/tmp/dflash-gpu")
    q = sub.add_parser("pack", help="(here) split the target and the data into checksummed parts")
    q.add_argument("--source", required=True, help="the target: a .gguf file or an HF model directory")
    q.add_argument("--carry", default="artifacts/gpu", help="ignored folder the parts go to (default artifacts/gpu)")
    q.add_argument("--part-mib", type=float, default=None,
                   help="part size, MiB (default: the size needing the fewest commands next to this working tree; "
                        "every command is checked against the 64 MiB cap)")
    q.add_argument("--resume-from", default=None, metavar="DIR",
                   help="files a previous poll returned (e.g. artifacts/gpu/resume): planned into the commands")
    q.add_argument("--prompts", required=True, help='prompt pool JSONL of {"id", "prompt", "chat"}')
    q.add_argument("--eval-prompts", default=None,
                   help='evaluation prompts: "humaneval", "mtbench" or a JSONL of {"prompt"} (chat-templated)')
    q.add_argument("--wheel", action="append", default=[], help="wheel(s) to carry (the gguf wheel for a GGUF)")
    q.add_argument("--exclude", nargs="*", default=[], metavar="JSONL",
                   help="leave the pool rows with these files' ids behind (with start --init <drafter>: its "
                        "training_prompts.jsonl.gz)")
    q.add_argument("--num-prompts", type=int, default=RUN_DEFAULTS["num_prompts"],
                   help="prompts the run regenerates (default: start's); pack refuses a pool with fewer rows left and "
                        "plans the value into the start command")
    for name in ("recv", "start"):
        q = sub.add_parser(name)
        q.add_argument("--carry", default="artifacts/gpu")
        q.add_argument("--home", default=home_default, help="state directory on the GPU machine (default "
                       "$DFLASH_GPU_HOME or /tmp/dflash-gpu: outside the repository copy)")
        q.add_argument("--resume-from", default=None, help="folder a previous poll returned (carry its files)")
    q.add_argument("--wait", type=float, default=0, help="then poll for this many seconds")
    q.add_argument("--out", default=None, help="with --wait: where poll writes the checkpoint ($OUT)")
    for k, v in RUN_DEFAULTS.items():
        q.add_argument("--" + k.replace("_", "-"), type=type(v), default=v,
                       choices=("online", "cached") if k == "taps" else None)
    q = sub.add_parser("run", help="(background) the job itself")
    q.add_argument("--home", default=home_default)
    q = sub.add_parser("poll")
    q.add_argument("--home", default=home_default)
    q.add_argument("--wait", type=float, default=540.0, help="seconds to wait for the job (default 540)")
    q.add_argument("--out", default=os.environ.get("OUT"), help="write the checkpoint + status here (default $OUT)")
    q = sub.add_parser("merge", help="(here) returned files -> a z-lab drafter directory")
    q.add_argument("--parts", required=True)
    q.add_argument("--out", required=True)
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "pack":
            res = pack(Path(args.source), Path(args.carry), args.part_mib, Path(args.prompts),
                       Path(args.eval_prompts) if args.eval_prompts else None, [Path(w) for w in args.wheel],
                       [Path(f) for f in args.exclude], Path(args.resume_from) if args.resume_from else None,
                       num_prompts=args.num_prompts)
            res = {"parts": len(res["parts"]), "part_bytes": res["parts"][0]["size"], "prompts": res["prompts"],
                   "commands": res["commands"]}
        elif args.cmd == "recv":
            res = recv(Path(args.carry), Path(args.home))
            if args.resume_from:
                res["resume_missing"] = stash_resume(Path(args.resume_from), Path(args.home))
        elif args.cmd == "start":
            res = start(Path(args.carry), Path(args.home), {k: getattr(args, k) for k in RUN_FLAGS},
                        Path(args.resume_from) if args.resume_from else None)
            if args.wait > 0:
                res["status"] = poll(Path(args.home), args.wait, Path(args.out) if args.out else None)
        elif args.cmd == "run":
            run(Path(args.home))
            return 0
        elif args.cmd == "poll":
            res = poll(Path(args.home), args.wait, Path(args.out) if args.out else None)
        else:
            res = {"drafter": str(merge(Path(args.parts), Path(args.out)))}
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1, default=str)[-8000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
