"""Which processes count as a model's python stubs (serve/triton/lifecycle.py), on real processes laid out as Triton's
python backend starts them: argv[0] the stub binary, argv[1] ``<repo>/<model>/1/model.py``, argv[8] the stub's name
(the model's for the short-lived auto-complete stub, ``<model>_0_0`` for an instance)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trtllm_dflash.serve.triton.lifecycle import StubWatch, python_stubs, stub_pids, watchdog_argv


def fake_stub(tmp_path, model: str, name: str) -> subprocess.Popen:
    """A child of this process whose argv is a python-backend stub's (``tee`` under the stub's name, waiting on
    stdin; the arguments it takes for files land in ``tmp_path/files``)."""
    (tmp_path / "repo" / model / "1").mkdir(parents=True, exist_ok=True)
    (tmp_path / "files").mkdir(exist_ok=True)
    argv = [str(tmp_path / "triton_python_backend_stub"), str(tmp_path / "repo" / model / "1" / "model.py"),
            "shm", "1048576", "1048576", "1", "lib", "0", name, "modeldir"]
    return subprocess.Popen(["bash", "-c", 'exec -a "$0" tee "$@" > /dev/null', *argv], stdin=subprocess.PIPE,
                            cwd=tmp_path / "files")


def loop_stub(seconds: float) -> subprocess.Popen:
    """A sibling that watches the drafter's stubs as a loop model does (checks every 0.1 s); returns once it has
    watched for 0.5 s; it prints "alive" if it outlives ``seconds`` more."""
    code = ("import time\n"
            "from trtllm_dflash.serve.triton.lifecycle import watch_parent\n"
            "watch_parent(0.1, needs=('drafter',)); time.sleep(0.5); print('watching', flush=True)\n"
            f"time.sleep({seconds}); print('alive', flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "watching", proc.stderr.read()
    return proc


def _wait_for(pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_only_instance_stubs_count_and_an_autocomplete_stub_exiting_is_not_a_shutdown(tmp_path):
    """The auto-complete stub is not a stub serving the model; its exit before the instance stub starts (a gap of
    1.5 s here, as when the server loads several models on two cores) leaves a loop model's watcher running, and the
    instance stub exiting afterwards still ends it (the server shutting down)."""
    auto = fake_stub(tmp_path, "drafter", "drafter")
    loop = inst = None
    try:
        _wait_for(lambda: (Path(f"/proc/{auto.pid}/cmdline").read_bytes().split(b"\0")[8:9] == [b"drafter"]))
        assert stub_pids("drafter", parent=os.getpid()) == set()
        loop = loop_stub(3.0)
        auto.kill()
        auto.wait()
        time.sleep(1.5)
        inst = fake_stub(tmp_path, "drafter", "drafter_0_0")
        _wait_for(lambda: stub_pids("drafter", parent=os.getpid()) == {inst.pid})
        out, err = loop.communicate(timeout=30)
        assert out.strip() == "alive", f"the watcher took the auto-complete stub's exit for a shutdown: {err}"

        loop = loop_stub(20.0)
        t0 = time.monotonic()
        inst.kill()
        inst.wait()
        out, err = loop.communicate(timeout=15)
        assert out == "" and time.monotonic() - t0 < 5, "the watcher missed every step model gone at once"
        assert f"stub {loop.pid} exits: no stub of drafter left" in err, err  # the server's log says why
    finally:
        for proc in (auto, loop, inst):
            if proc is not None and proc.poll() is None:
                proc.kill()


def test_one_scan_serves_every_model_and_a_dead_stub_forces_the_next(tmp_path):
    """``serve`` watches ~10 python models every second: one /proc scan finds all their stubs, asking again costs no
    scan while they live, and a stub that exited is noticed at the next question (a fresh scan), as is its successor."""
    stubs = {m: fake_stub(tmp_path, m, f"{m}_0_0") for m in ("drafter", "kv_inject", "target_verify")}
    try:
        _wait_for(lambda: python_stubs(os.getpid()) == {m: {p.pid} for m, p in stubs.items()})  # after their exec
        watch = StubWatch(period_s=60.0, parent=os.getpid())
        for _ in range(3):
            assert {m: watch.current(m) for m in stubs} == {m: {p.pid} for m, p in stubs.items()}
        assert watch.scans == 1
        stubs["kv_inject"].kill()
        stubs["kv_inject"].wait()
        assert watch.current("drafter") == {stubs["drafter"].pid} and watch.scans == 1  # its own stub lives
        assert watch.current("kv_inject") == set() and watch.scans == 2
        stubs["kv_inject"] = fake_stub(tmp_path, "kv_inject", "kv_inject_0_0")  # reloaded
        _wait_for(lambda: watch.current("kv_inject") == {stubs["kv_inject"].pid})  # rescans at most every 1 s
    finally:
        for proc in stubs.values():
            proc.kill()


@pytest.mark.parametrize("shell", ["/bin/bash", "/bin/sh"])
def test_the_shell_watchdog_kills_the_stub_of_a_gone_server_and_costs_nothing_meanwhile(shell):
    """The watchdog a stub starts (``watch_parent``): at niceness 19, nearly no CPU while its server lives (bash: no
    ``sleep`` forked), and the stub SIGKILLed within ~1 s once the server is gone."""
    server = subprocess.Popen(["sleep", "60"])
    stub = subprocess.Popen(["sleep", "60"])
    dog = subprocess.Popen(watchdog_argv(server.pid, stub.pid, shell))
    try:
        time.sleep(3.0)
        stat = Path(f"/proc/{dog.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert stat[16] == "19"  # niceness
        ticks = sum(int(x) for x in stat[11:15])  # utime, stime and its children's (the forked sleeps)
        assert dog.poll() is None and stub.poll() is None
        if shell == "/bin/bash":
            assert ticks <= 2, ticks
        server.kill()
        server.wait()
        t0 = time.monotonic()
        assert stub.wait(timeout=5) == -9 and time.monotonic() - t0 < 2.5
        assert dog.wait(timeout=5) == 0
    finally:
        for proc in (server, stub, dog):
            if proc.poll() is None:
                proc.kill()


def test_python_model_builds_the_handler_in_initialize_and_sends_requests_straight_to_it(monkeypatch):
    """What a template's model.py hands Triton: a class Triton constructs without arguments, whose ``initialize``
    parses the model's parameters and builds the handler with them and ``pb_utils``, and whose ``execute`` and
    ``finalize`` are the handler's own (no forwarding frame between Triton and the handler)."""
    import json

    from trtllm_dflash.serve.settings import ModelSettings
    from trtllm_dflash.serve.triton import lifecycle

    watched = []
    monkeypatch.setattr(lifecycle, "watch_parent", lambda needs=(): watched.append(needs))
    monkeypatch.setattr(lifecycle, "yield_to_compute", lambda nice: watched.append(("nice", nice)))

    class Handler:
        def __init__(self, settings, pb_utils) -> None:
            self.settings, self.pb = settings, pb_utils

        def execute(self, requests) -> list:
            return [(self.pb, r) for r in requests]

        def finalize(self) -> None:
            self.finalized = True

    pb = object()
    cls = lifecycle.python_model(Handler, pb, needs=("drafter",), nice=True)
    model = cls()
    model.initialize({"model_config": json.dumps({"parameters": {"block_size": {"string_value": "8"}}})})
    assert watched == [("drafter",), ("nice", model.settings.io_nice)]
    assert isinstance(model.settings, ModelSettings) and model.settings.block_size == 8
    assert model.execute(["a", "b"]) == [(pb, "a"), (pb, "b")]
    assert cls.execute is Handler.execute and cls.finalize is Handler.finalize
    model.finalize()
    assert model.finalized
