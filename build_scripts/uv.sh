# shellcheck shell=bash
# Sourced by the lock scripts (lock.sh, peer_*.sh --lock), from the repository root: sets UV to the pinned uv
# resolver, installed into .cache/uv (never into .venv) the first time or when another version is there.
UV_VERSION=0.13.9
UV=.cache/uv/bin/uv
if ! { [ -x "$UV" ] && "$UV" --version | grep -q " $UV_VERSION"; }; then
  "${PYTHON:-python3}" -m venv .cache/uv
  .cache/uv/bin/python -m pip --disable-pip-version-check -q install "uv==$UV_VERSION"
fi
