"""The python stubs' life: the model class Triton instantiates, tied to its server and out of the way of its
computing models.

Triton's python stub checks that its parent still exists, but a server that exited without being reaped (a zombie,
e.g. when whatever started it was killed) still exists, so the stubs would keep computing at full CPU after the
server is gone. ``watch_parent`` ends the stub within a second of its server exiting, zombie or not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from trtllm_dflash.serve.settings import ModelSettings


def python_model(handler: type, pb_utils, needs: tuple[str, ...] = (), nice: bool = False) -> type:
    """The ``TritonPythonModel`` of a rendered model whose logic is ``handler`` (a class built from
    ``(ModelSettings, pb_utils)`` with Triton's ``execute`` and, optionally, ``finalize``).

    It is a subclass of ``handler``: Triton constructs it without arguments, its ``initialize`` starts the parent watch
    (``needs``: see ``watch_parent``), reads the model's parameters, lowers the stub's priority where ``nice``
    (``yield_to_compute``) and then builds the handler, and every request goes straight to the handler's own
    ``execute``, so a template's ``model.py`` is one assignment and no frame of a request's path."""

    class TritonPythonModel(handler):
        def __init__(self) -> None:  # Triton's constructor takes nothing: the handler is built in initialize
            pass

        def initialize(self, args: dict) -> None:
            watch_parent(needs=needs)
            settings = ModelSettings.from_args(args)
            if nice:
                yield_to_compute(settings.io_nice)
            handler.__init__(self, settings, pb_utils)

    TritonPythonModel.__qualname__ = f"TritonPythonModel[{handler.__name__}]"
    return TritonPythonModel


def parent_alive(pid: int) -> bool:
    """True while ``pid`` is this process's parent and is neither a zombie nor dead."""
    return os.getppid() == pid and pid_alive(pid)


def watch_parent(period_s: float = 0.5, needs: tuple[str, ...] = ()) -> None:
    """Exit this process (at once, no clean-up: the server that would collect its results is gone) as soon as the
    process that started it is gone. Called from every model's ``initialize``; one watcher per process.

    ``needs``: the models a loop model calls. Once they were seen alive, all of them gone at once for two checks
    means the server is shutting down (a failed model is reloaded alone): Triton 2.51 then waits for this stub's
    in-flight decoupled requests instead of finalizing it, and would hang, so the stub exits."""
    if getattr(watch_parent, "_started", False):
        return
    watch_parent._started = True
    parent = os.getppid()

    def run() -> None:
        seen, gone = False, 0
        # /proc is scanned for a model only when its known stubs died (or none is known yet) and every 30 s: scanning
        # it for every model at every check would take CPU from the step models for every loop model
        stubs = StubWatch(period_s=30.0, parent=parent)
        why = f"server {parent} gone"
        while parent_alive(parent):
            time.sleep(period_s)
            if needs:
                alive = any(stubs.current(m) for m in needs)
                seen = seen or alive
                gone = gone + 1 if seen and not alive else 0
                if gone >= 2:
                    why = f"no stub of {', '.join(needs)} left: the server is shutting down"
                    break
        # one line in the server's log (a stub writes to the server's stderr), so an exit is never a mystery there
        print(f"trtllm-dflash: stub {os.getpid()} exits: {why}", file=sys.stderr, flush=True)
        os._exit(0)

    threading.Thread(target=run, name="dflash-parent-watch", daemon=True).start()
    # A stub blocked in Triton's IPC can hold the GIL, so the thread above may never run once its server is gone
    # (seen: a target_verify stub left behind): a shell watchdog outside the interpreter kills it then as well.
    subprocess.Popen(watchdog_argv(parent, os.getpid()), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def watchdog_argv(server: int, stub: int, shell: str | None = None) -> list[str]:
    """The shell watchdog of ``stub``, at niceness 19 where ``nice`` exists: it only polls, beside step models whose
    OpenMP teams stall whenever a core is taken. Under bash (the default where /bin/bash exists) it waits with the
    ``read -t`` builtin instead of forking ``sleep`` every second (a fork a second per watchdog, one watchdog per
    stub, keeps even an idle server's cores busy)."""
    shell = shell or ("/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh")
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    return [*nice, shell, "-c", _WATCHDOG, "dflash-stub-watchdog", str(server), str(stub)]


# $1 = the server, $2 = the stub; exits with the stub, SIGKILLs it when the server is gone or a zombie
_WATCHDOG = """
pause() { sleep 1; }
if [ -n "$BASH_VERSION" ]; then eval 'exec 3<> <(:)'; pause() { read -r -t 1 -u 3 _; }; fi  # eval: sh can't parse <(
while [ -d /proc/$2 ]; do
  line=""; read -r line < /proc/$1/stat 2>/dev/null
  st=${line##*) }; st=${st%% *}
  case "$st" in ""|Z|X) kill -9 $2; exit 0;; esac
  pause
done
"""


def stub_pids(model: str, parent: int | None = None) -> set[int]:
    """Live python-stub processes serving ``model`` started by ``parent`` (default: this process's parent, i.e. from a
    stub, its sibling stubs of the same server): ``python_stubs(parent)[model]``."""
    return python_stubs(parent).get(model, set())


def python_stubs(parent: int | None = None) -> dict[str, set[int]]:
    """{model: pids} of every live python-stub process started by ``parent`` (default: this process's parent), in one
    pass over /proc. A stub's argv[1] is ``<repository>/<model>/1/model.py``.

    Only instance stubs count. While loading a model, a server with auto-complete on (tritonserver's default; ``serve``
    turns it off) first runs an auto-complete stub, which reads the config and exits; argv[8] names a stub, the
    model's name for that one and ``<model>_<group>_<n>`` for an instance (python_backend src/stub_launcher.cc,
    Launch). Counted as alive, its exit before the instance stub started would look like every step model gone at
    once, and a loop model's ``watch_parent`` would end its own stub mid-initialize ("Stub process 'dflash_0_0' is
    not healthy", server not started)."""
    parent = os.getppid() if parent is None else parent
    out: dict[str, set[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not child_alive(int(entry.name), parent):
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) < 2 or not argv[0].endswith(b"triton_python_backend_stub"):
            continue
        path = Path(argv[1].decode(errors="replace"))
        model = path.parent.parent.name
        if path.name == "model.py" and path.parent.name == "1" and not _autocomplete_stub(argv, model):
            out.setdefault(model, set()).add(int(entry.name))
    return out


def _autocomplete_stub(argv: list[bytes], model: str) -> bool:
    """Whether a python-backend stub's ``argv`` is the auto-complete stub of ``model`` (see ``python_stubs``)."""
    return len(argv) > 8 and argv[8].decode(errors="replace") == model


class StubWatch:
    """The live stubs of a server's python models (``parent``: started by that server; default this process's
    parent), as one scan of /proc for all of them (``python_stubs``), repeated when a model's known stubs are no longer
    all alive, every ``period_s``, and while a model asked for has none at most every ``EMPTY_PERIOD_S`` (a model not
    loaded yet, being reloaded, or not a python model). A BLS call remembers the stubs serving it when it starts and
    is failed when all of them have exited (``died``); ``serve`` reports a model whose stubs all exited.

    One scan serves every model because a scan per model (every process's /proc entry read once per python model
    every second) costs CPU in proportion to the python models times the machine's process count."""

    EMPTY_PERIOD_S = 1.0

    def __init__(self, period_s: float = 2.0, parent: int | None = None) -> None:
        self.period_s, self.parent = period_s, parent
        self.scans = 0  # /proc scans made (tests)
        self._scanned = -1e9
        self._pids: dict[str, set[int]] = {}

    def current(self, model: str) -> set[int]:
        age = time.monotonic() - self._scanned
        pids = self._pids.get(model, set())
        period = self.period_s if pids else min(self.period_s, self.EMPTY_PERIOD_S)
        if age > period or not all(pid_alive(p) for p in pids):
            self._pids = python_stubs(self.parent)
            self._scanned = time.monotonic()
            self.scans += 1
            pids = self._pids.get(model, set())
        return pids

    @staticmethod
    def died(pids: set[int]) -> bool:
        """True when ``pids`` (a call's stubs) were known and none is alive any more."""
        return bool(pids) and not any(pid_alive(p) for p in pids)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state, parent, ...); [] for no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def child_alive(pid: int, parent: int) -> bool:
    """Whether process ``pid`` lives (not a zombie) and was started by ``parent`` (a reused pid is not)."""
    stat = _stat(pid)
    return len(stat) > 1 and stat[0] not in ("Z", "X") and stat[1] == str(parent)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    stat = _stat(pid)
    return bool(stat) and stat[0] not in ("Z", "X")


def raise_niceness(nice: int, pid: int | None = None) -> int:
    """Give every thread of process ``pid`` (default: this one) a niceness of at least ``nice``; returns how many
    threads changed. Linux keeps a niceness per thread (a thread created later inherits its creator's), so each one
    is set; raising a niceness needs no privilege. Threads that end meanwhile are skipped."""
    pid = pid or os.getpid()
    changed = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) < nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                changed += 1
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return changed


def yield_to_compute(io_nice: int | str, pid: int | None = None) -> bool:
    """On a CPU server, run the processes that only move requests (the server's own threads, the loop, entry and
    tokenizer models) at niceness ``io_nice`` (the rendered parameter; 0 = off), so the step models' forwards, whose
    OpenMP teams stall whenever the scheduler lends one of their cores to a gRPC or IPC thread, get the cores first.
    Served throughput relative to in-process is highest at the lowest priority (``perf/throughput_c16.py --io-nice
    N``; perf/results/reliability), so the default is 19. A step model reloaded later inherits the server's niceness
    (equal priority again until the server restarts). On a GPU the forwards do not share the cores: nothing is
    changed."""
    n = int(io_nice or 0)
    if n <= 0:
        return False
    import torch

    if torch.cuda.is_available():
        return False
    raise_niceness(n, pid)
    return True
