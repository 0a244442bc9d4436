"""`trtllm-dflash serve` as a user runs it (a real process, real Triton, real SmolLM2): a killed step model is
reported and reloaded, and SIGTERM with generations in flight ends everything, stubs included, within seconds."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from trtllm_dflash.client.grpc import DFlashClient, GenerateParams, build_inputs
from trtllm_dflash.perf.health import stub_processes
from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
from trtllm_dflash.serve.triton.server import SHM_DIR, STOP_GRACE_S, free_ports, remove_shm_regions

pytestmark = pytest.mark.slow
grpcclient = pytest.importorskip("tritonclient.grpc")


def _ready(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0



def sixteen_streams(url: str):
    """16 long generations streaming from ``dflash``, each past its first response; returns the client."""
    c = grpcclient.InferenceServerClient(url)
    got = []
    c.start_stream(callback=lambda result, error: got.append(error))
    for i in range(16):
        c.async_stream_infer("dflash", build_inputs(GenerateParams(f"Write a long story {i}.", 200)))
    t0 = time.monotonic()
    while len(got) < 16 and time.monotonic() - t0 < 120:
        time.sleep(0.1)
    return c


def test_serve_reloads_a_killed_model_and_sigterm_leaves_nothing_behind(smollm2, tmp_path):
    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size=8, max_seq_len=256,
                                max_sequences=16), tmp_path / "repo")
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "trtllm_dflash", "serve", "--repo", str(repo), "--http-port",
                             str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--log",
                             str(tmp_path / "server.log")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events: list[dict] = []
    threading.Thread(target=lambda: [events.append(json.loads(line)) for line in proc.stderr
                                     if line.startswith("{")], daemon=True).start()
    try:
        assert json.loads(proc.stdout.readline())["grpc"] == f"127.0.0.1:{grpc}", "serve did not start"
        url = f"127.0.0.1:{grpc}"

        # A killed step model: in-flight requests fail naming it, serve unloads and reloads it.
        errors: list[str] = []
        c = grpcclient.InferenceServerClient(url)
        c.start_stream(callback=lambda result, error: error is not None and errors.append(str(error)))
        for i in range(4):
            c.async_stream_infer("dflash", build_inputs(GenerateParams(f"Tell me about {i}.", 200)))
        time.sleep(3.0)
        victim = next(pid for pid, model in stub_processes(repo).items() if model == "target_verify")
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        while len(errors) < 4 and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        c.stop_stream()
        assert len(errors) == 4 and all("target_verify" in e for e in errors), errors
        while not any(e.get("event") == "model_reloaded" for e in events) and time.monotonic() - t0 < 300:
            time.sleep(0.5)
        assert [e["event"] for e in events] == ["model_died", "model_reloaded"], events
        assert events[0]["model"] == "target_verify" and events[0]["stub_pids"] == [victim]
        assert _ready(http) == 200
        with DFlashClient(url) as client:
            assert client.generate("dflash", GenerateParams("Say yes.", 4)).token_ids

        # SIGTERM with 16 generations in flight: serve exits promptly and no stub of this repository survives it.
        c = sixteen_streams(url)
        assert stub_processes(repo), "no stubs to begin with"
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        proc.wait(timeout=STOP_GRACE_S + 20)
        exited_s = time.monotonic() - t0
        while stub_processes(repo) and time.monotonic() - t0 < exited_s + 3:
            time.sleep(0.1)
        assert not stub_processes(repo), stub_processes(repo)
        print(f"serve exited {exited_s:.1f} s after SIGTERM with 16 generations in flight; no stub left")
        try:
            c.stop_stream()
        except Exception:  # noqa: BLE001 - the server is gone
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_killed_with_sigkill_leaves_no_server_and_no_stub(smollm2, tmp_path):
    """serve itself SIGKILLed (no clean-up of its own) with 16 generations in flight: its tritonserver dies with it
    (PR_SET_PDEATHSIG) and every stub within seconds (serve/triton/lifecycle.py), none left computing."""
    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size=8, max_seq_len=256,
                                max_sequences=16), tmp_path / "repo")
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "trtllm_dflash", "serve", "--repo", str(repo), "--http-port",
                             str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert json.loads(proc.stdout.readline())["grpc"] == f"127.0.0.1:{grpc}", "serve did not start"
        c = sixteen_streams(f"127.0.0.1:{grpc}")
        assert len(stub_processes(repo)) == len([m for m in repo.iterdir() if m.is_dir()])  # one per model
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        while stub_processes(repo) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
        assert not stub_processes(repo), stub_processes(repo)
        servers = [p for p in os.listdir("/proc") if p.isdigit() and _is_server_of(p, repo)]
        assert not servers, f"tritonserver {servers} outlived serve"
        # a SIGKILLed serve frees nothing itself: the next server start sweeps the regions of exited processes
        left = {f.name for f in SHM_DIR.glob(f"dflash{proc.pid}_{grpc}_*")}
        assert left <= set(remove_shm_regions()) and not list(SHM_DIR.glob(f"dflash{proc.pid}_{grpc}_*"))
        print(f"serve SIGKILLed: every stub gone {gone_s:.1f} s later, no tritonserver left, "
              f"{len(left)} shared-memory regions swept")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _is_server_of(pid: str, repo) -> bool:
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and argv[0].endswith(b"bin/tritonserver") and f"--model-repository={repo}".encode() in argv
