"""Where the toolkit writes, and how: the cache root (``cache_dir``) for generated assets and per-machine measurements,
and all-or-nothing outputs (a directory built in a temporary directory next to OUT and renamed into place at the end;
a file written to a temporary file and renamed)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from pathlib import Path

from trtllm_dflash.errors import ArtifactError


def cache_dir() -> Path:
    """Root for generated assets and per-machine measurements: $TRTLLM_DFLASH_CACHE, else ~/.cache/trtllm_dflash
    (made once per value of the variables that name it: a model's step asks for it several times)."""
    return _cache_dir(os.environ.get("TRTLLM_DFLASH_CACHE"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=16)
def _cache_dir(root: str | None, home: str | None) -> Path:
    return Path(root or Path.home() / ".cache" / "trtllm_dflash")


def refuse_existing(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise ArtifactError(out, "already exists", "pass --force to replace it, or choose another --out")


def _umask_permissions(root: Path) -> None:
    """mkdtemp/mkstemp create 0700/0600 entries; give the published tree the usual umask-derived modes."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for p in root.rglob("*"):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def staged_output(out: Path, force: bool):
    """Yields a temporary directory in ``out.parent``; on normal exit it replaces ``out`` (moving an old ``out`` aside
    first when ``force``, so a failure leaves one complete tree); on error it is removed and ``out`` is untouched."""
    refuse_existing(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        yield tmp
        _umask_permissions(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file of its own beside it, renamed over it: a reader sees the old
    file or the new one, never a part, and two processes writing at once cannot mix their files. The file gets the
    mode a plain write would give (the umask's)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
