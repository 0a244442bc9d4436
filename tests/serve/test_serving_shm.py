"""Shared-memory hygiene of our Triton servers (serve/triton/server.py): the python backend's regions live in /dev/shm (RAM),
and a server that is SIGKILLed, or dies with the process that started it, never frees them."""

import os
import subprocess
import sys

from trtllm_dflash.serve.triton.server import remove_shm_regions, shm_prefix


def test_sweep_removes_only_regions_of_exited_processes(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # exited: its server (if any) died with it
    names = [f"dflash{dead_pid}_8001_a1", f"dflash{dead_pid}_8001_b2", f"dflash{os.getpid()}_8001_c3",
             f"dflash{os.getpid()}_80011_d4", "dflashx_8001_e5", "triton_python_backend_shm_f6"]
    for n in names:
        (tmp_path / n).write_bytes(b"\0" * 16)
    assert sorted(remove_shm_regions(shm_dir=tmp_path)) == names[:2]
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(names[2:])
    # a stopped server's own prefix: exactly its port's regions (8001, not 80011)
    assert shm_prefix(8001) == f"dflash{os.getpid()}_8001_"
    assert remove_shm_regions(shm_prefix(8001), shm_dir=tmp_path) == [names[2]]
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(names[3:])
