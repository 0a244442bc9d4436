"""Starting and stopping a real Triton Inference Server on a rendered repository.

Binary: a system ``tritonserver`` when one is on PATH (NVIDIA's containers), else the Triton 2.51 server bundled in
the ``nvidia-pytriton`` wheel, set up as environment.md §3.2 describes: a private copy of the bundled server with
this Python's backend stub, the interpreter's LIBDIR and the bundled libraries on LD_LIBRARY_PATH, and this
environment's ``bin`` first on PATH (the stub finds its Python through ``python3`` on PATH, and needs numpy<2 there).
Endpoints bind to 127.0.0.1 by default. ``stop`` ends the whole process group, so no stub is left behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.assets import cache_dir
from trtllm_dflash.errors import ArtifactError
from trtllm_dflash.serve.triton.lifecycle import StubWatch

OMP_SPINCOUNT = 50_000  # libgomp spin iterations (a few ms) before an idle thread sleeps (server_command)
EXIT_TIMEOUT_S = 5  # Triton's own wait for in-flight requests on SIGTERM
STOP_GRACE_S = 10.0  # then TritonServer.stop kills what is left (stubs still generating included)
STUB_RESCAN_S = 30.0  # dead_models looks for new stubs this often; a known stub's exit is seen at the next call


def _die_with_parent() -> None:
    """Runs in the child before exec: Linux kills the server if the process that started it dies, so a killed test
    run, demo or ``serve`` leaves no server behind (its stubs then exit too, serve/triton/lifecycle.py). SIGKILL, not
    SIGTERM: Triton 2.51 shutting down alone with decoupled requests in flight never finishes unloading."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "dflash"  # + "<pid of the process that started the server>_<grpc port>_": the python backend's regions


def shm_prefix(grpc_port: int) -> str:
    """Our servers' shared-memory region prefix: distinct per starting process and port, so several servers (tests,
    demo) run side by side, and ending in ``_`` so one port's prefix is never another's (5063 vs 50639)."""
    return f"{SHM_PREFIX}{os.getpid()}_{grpc_port}_"


def remove_shm_regions(prefix: str | None = None, shm_dir: Path = SHM_DIR) -> list[str]:
    """Delete the python backend's shared-memory files (RAM, not disk) that no server uses any more: those named
    ``prefix*`` (a server just stopped), or with ``prefix=None`` those of every server whose starting process has
    exited (its server died with it, ``_die_with_parent``, and a SIGKILLed server never frees its regions, so they
    pile up across restarts). Returns the names removed."""
    from trtllm_dflash.serve.triton.lifecycle import pid_alive

    removed = []
    for f in shm_dir.glob(f"{prefix or SHM_PREFIX}*"):
        if prefix is None:
            m = re.match(rf"{SHM_PREFIX}(\d+)_", f.name)
            if m is None or pid_alive(int(m.group(1))):
                continue
        try:
            f.unlink()
            removed.append(f.name)
        except FileNotFoundError:
            pass
    return removed


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: the sockets stay bound until all are picked (one at a time, the OS may hand the same
    port out twice: a server asked to listen for gRPC and metrics on one port exits at start-up)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True, slots=True)
class ServerCommand:
    argv: list[str]
    env: dict[str, str]


def _bundled_server() -> tuple[Path, Path, Path]:
    """(server root with this Python's stub, library dir, python LIBDIR) from the nvidia-pytriton wheel."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ArtifactError("tritonserver", "not on PATH and nvidia-pytriton is not installed",
                            "pip install nvidia-pytriton==0.7.0 (or run inside an NVIDIA Triton container)")
    pkg = Path(spec.submodule_search_locations[0])
    libs = pkg.parent / "nvidia_pytriton.libs"
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = pkg / "tritonserver" / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    if not stub.is_file():
        raise ArtifactError(stub, f"no Triton python-backend stub for Python {pyver}", "use Python 3.8-3.13")
    root = cache_dir() / f"tritonserver-py{pyver}"
    if not (root / "backends" / "python" / "triton_python_backend_stub").is_file():
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(pkg / "tritonserver", tmp, ignore=shutil.ignore_patterns("python_backend_stubs"))
        shutil.copy2(stub, tmp / "backends" / "python" / "triton_python_backend_stub")
        shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp, root)
    return root, libs, Path(sysconfig.get_config_var("LIBDIR"))


def server_command(repo: Path, http_port: int, grpc_port: int, metrics_port: int, host: str = "127.0.0.1",
                   log_verbose: int = 0) -> ServerCommand:
    common = [
        f"--model-repository={repo}", f"--http-address={host}", f"--http-port={http_port}",
        f"--grpc-address={host}", f"--grpc-port={grpc_port}", f"--metrics-address={host}",
        f"--metrics-port={metrics_port}", f"--exit-timeout-secs={EXIT_TIMEOUT_S}", f"--log-verbose={log_verbose}",
        # every model loaded at start, and reloadable one by one (TritonServer.reload: a step model whose stub died)
        "--model-control-mode=explicit", "--load-model=*",
        # the configs are complete (make-repo writes every field): no auto-complete stub per python model, which would
        # import the package (and torch) once more per model before its instance loads
        "--disable-auto-complete-config",
        # distinct shared-memory names, so several servers (tests, demo) can run side by side
        f"--backend-config=python,shm-region-prefix-name={shm_prefix(grpc_port)}",
    ]
    env = dict(os.environ)
    # The step models are torch processes sharing the cores. How their idle OpenMP threads wait sets the CPU speed:
    # a futex sleep after every op (OMP_WAIT_POLICY=PASSIVE) or a short spin (5k iterations) costs a wake-up on many
    # of a forward's ops; libgomp's default (300k) keeps one process's threads spinning while the next stage
    # computes. 50k spans the gaps inside a forward and sleeps between stages (measured against in-process in
    # perf/results/bench-serving-cpu/README.md). Concurrency is handled by the step models' thread count instead
    # (handlers.CpuThreads: one thread each once DFlash sequences overlap).
    # A user-set OMP_WAIT_POLICY or GOMP_SPINCOUNT is left alone.
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = str(OMP_SPINCOUNT)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONUTF8", "1")  # the stubs' files read as UTF-8 under a C locale (TorchInductor's templates)
    system = shutil.which("tritonserver")
    if system:
        return ServerCommand([system, *common], env)
    root, libs, libdir = _bundled_server()
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), str(libdir), env.get("LD_LIBRARY_PATH")]))
    argv = [str(root / "bin" / "tritonserver"), *common, f"--backend-directory={root / 'backends'}",
            f"--cache-directory={root / 'caches'}"]
    return ServerCommand(argv, env)


def read_manifest(repo: str | Path) -> dict:
    """The repository's ``manifest.json`` (written by make-repo), or {} for a repository without one."""
    manifest = Path(repo) / "manifest.json"
    return json.loads(manifest.read_text()) if manifest.is_file() else {}


def check_backend_available(repo: str | Path) -> None:
    """A repository rendered for a TensorRT-LLM backend needs tensorrt_llm (NVIDIA's containers): say so up front
    instead of letting Triton fail to load the models."""
    backend = read_manifest(repo).get("backend", "torch")
    if backend != "torch" and importlib.util.find_spec("tensorrt_llm") is None:
        raise ArtifactError(repo, f"was rendered for --backend {backend}, which needs TensorRT-LLM "
                            "(not installed here; it runs only inside NVIDIA's containers, see docker/)",
                            "serve it inside the container, or render a --backend torch repository here")


def startup_failure(log_path: Path | None, tail_chars: int = 1500) -> str:
    """Why a server that exited while loading did: the log's error lines and its failed-load lines (Triton prints
    the reason a model failed, e.g. "Stub process 'dflash_0_0' is not healthy.", well before the model table and
    the shutdown that end the log; a stub that ended itself says why, ``lifecycle.watch_parent``), then the tail."""
    if log_path is None or not Path(log_path).is_file():
        return "(no log; pass log_path)"
    text = Path(log_path).read_text(errors="replace")
    errors = [line for line in text.splitlines()
              if (line.startswith("E") and line[1:5].isdigit()) or "failed to load" in line or "UNAVAILABLE" in line
              or line.startswith("trtllm-dflash: stub")]
    return "\n".join(errors[-20:]) + "\n...\n" + text[-tail_chars:]


class TritonServer:
    """``with TritonServer(repo) as server:`` starts the server, waits until ready, and stops it cleanly."""

    def __init__(self, repo: str | Path, http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, host: str = "127.0.0.1", log_path: str | Path | None = None):
        self.repo = Path(repo).resolve()
        if not (self.repo / "manifest.json").is_file() and not any(self.repo.glob("*/config.pbtxt")):
            raise ArtifactError(self.repo, "is not a model repository", "render one with trtllm-dflash make-repo")
        self.host = host
        picked = iter(free_ports(3))
        self.http_port = http_port or next(picked)
        self.grpc_port = grpc_port or next(picked)
        self.metrics_port = metrics_port or next(picked)
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._stubs: dict[str, set[int]] = {}  # python model -> its stub pids last seen alive (dead_models)
        self._watch: StubWatch | None = None  # this server's stubs (dead_models), from start()

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.http_port}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def start(self, timeout_s: float = 600.0) -> "TritonServer":
        remove_shm_regions()  # what servers of exited processes left behind
        cmd = server_command(self.repo, self.http_port, self.grpc_port, self.metrics_port, self.host)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd.argv, env=cmd.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        self._watch = StubWatch(period_s=STUB_RESCAN_S, parent=self.proc.pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ArtifactError(self.repo, f"tritonserver exited with code {self.proc.returncode}:\n"
                                    + startup_failure(self.log_path),
                                    f"the whole log: {self.log_path}" if self.log_path else "pass log_path")
            if self._ready():
                self.dead_models()  # remember every model's stubs, so one that dies later is noticed
                self._yield_to_compute()
                return self
            time.sleep(0.5)
        self.stop()
        raise ArtifactError(self.repo, f"tritonserver not ready after {timeout_s:.0f} s", "see the server log")

    def _yield_to_compute(self) -> None:
        """The server's own threads at the repository's ``io_nice`` (lifecycle.yield_to_compute). Done once every
        model is loaded, so the step models' stubs, which the server's threads start, keep the default priority."""
        from trtllm_dflash.serve.triton.lifecycle import yield_to_compute

        yield_to_compute(read_manifest(self.repo).get("repo_config", {}).get("io_nice", 0), self.proc.pid)

    def python_models(self) -> list[str]:
        return sorted(p.parent.parent.name for p in self.repo.glob("*/1/model.py"))

    def dead_models(self) -> dict[str, set[int]]:
        """{model: exited stub pids} for python models whose every stub seen alive so far has exited while the
        server runs (a killed or crashed step model: Triton 2.51 neither restarts it nor reports it not ready)."""
        if self.proc is None or self.proc.poll() is not None:
            return {}
        dead = {}
        for model in self.python_models():
            now = self._watch.current(model)
            seen = self._stubs.get(model, set())
            if seen and not now:
                dead[model] = seen
            elif now:
                self._stubs[model] = now
        return dead

    def _repository_call(self, model: str, action: str) -> None:
        req = urllib.request.Request(f"http://{self.host}:{self.http_port}/v2/repository/models/{model}/{action}",
                                     data=b"{}", method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()

    def unload(self, model: str) -> None:
        """Take ``model`` out of service: its readiness (and the server's) turns false until it is loaded again."""
        self._repository_call(model, "unload")
        self._stubs.pop(model, None)

    def reload(self, model: str) -> None:
        """Unload ``model`` and load it again (fresh stubs, empty sequence state; Triton ignores a load of a model it
        considers loaded and unchanged); returns when it is ready again."""
        self.unload(model)
        self._repository_call(model, "load")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM (Triton waits EXIT_TIMEOUT_S for in-flight requests, then unloads), then after ``grace_s`` SIGKILL
        to the whole process group: generations still running in a stub end with it, nothing outlives ``stop``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the process group (stubs included)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        remove_shm_regions(shm_prefix(self.grpc_port))  # the server and its stubs are gone: nobody maps them now

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
