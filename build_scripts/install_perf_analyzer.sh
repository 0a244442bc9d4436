#!/usr/bin/env bash
# Make the real perf_analyzer (2.60) available as .cache/perf_analyzer/bin/perf_analyzer. Idempotent.
#
# 1. If a perf_analyzer is already on PATH (NGC *-py3-sdk containers, Ubuntu 24.04+), the wrapper just execs it.
# 2. Otherwise the perf-analyzer 2.60.0 wheel (manylinux_2_38) is downloaded and its binary is run through the
#    loader of Debian trixie's libc6/libstdc++6/libgcc-s1, unpacked into .cache/perf_analyzer/glibc-root with a
#    private apt state (environment.md §3.4). Nothing system-wide is changed.
# The empty 0.1.0 "placeholder" wheel is never accepted: the binary must exist inside the wheel and answer --version.
#
# Exit status: 0 ready; 1 failed; 3 the Debian archive could not be reached (tests skip on this one only).
set -euo pipefail
cd "$(dirname "$0")/.."

PA_VERSION=2.60.0
# sha256 of perf_analyzer-2.60.0-py3-none-manylinux_2_38_x86_64.whl: the wheel is pinned like everything in the locks.
PA_SHA256=23ef56b107ae9233e5cf09fbdf508dd9b936a52f1bae2f63f53c8117087b3f25
ROOT=$PWD
PA=$ROOT/.cache/perf_analyzer
WRAPPER=$PA/bin/perf_analyzer
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi

say() { echo "install_perf_analyzer: $*" >&2; }

check_wrapper() {
  [ -x "$WRAPPER" ] || return 1
  local out
  out=$("$WRAPPER" --version 2>&1) || return 1
  case $out in
    *"Perf Analyzer Version"*) say "ok: $out ($WRAPPER)"; return 0 ;;
    *) return 1 ;;
  esac
}

mkdir -p "$PA/bin"

# The wrapper resolves its own directory at run time, so the checkout can move.
write_private_wrapper() {
  cat > "$WRAPPER" <<'EOF'
#!/usr/bin/env bash
# Runs perf_analyzer 2.60 through Debian trixie's loader (written by build_scripts/install_perf_analyzer.sh).
set -euo pipefail
PA=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
L=$PA/glibc-root/usr/lib/x86_64-linux-gnu
SYS=/usr/lib/x86_64-linux-gnu
exec "$L/ld-linux-x86-64.so.2" --library-path "$L:$SYS" "$PA/wheel/perf_analyzer/bin/perf_analyzer" "$@"
EOF
  chmod +x "$WRAPPER"
}

write_path_wrapper() {
  cat > "$WRAPPER" <<EOF
#!/usr/bin/env bash
# Uses the perf_analyzer found on PATH (written by build_scripts/install_perf_analyzer.sh).
exec "$1" "\$@"
EOF
  chmod +x "$WRAPPER"
}

if check_wrapper; then exit 0; fi

# 1. Already on PATH (but not our own wrapper, nor a shim from the placeholder/unusable wheel).
if SYS_PA=$(command -v perf_analyzer 2>/dev/null) && [ "$SYS_PA" != "$WRAPPER" ]; then
  if "$SYS_PA" --version 2>&1 | grep -q "Perf Analyzer Version"; then
    write_path_wrapper "$SYS_PA"
    check_wrapper && exit 0
  fi
  say "perf_analyzer on PATH ($SYS_PA) does not run; installing the private copy"
fi

if [ "$(uname -m)" != x86_64 ]; then
  say "the private-libc recipe is for x86_64 only; use an NGC *-py3-sdk container"; exit 1
fi

# 2a. The wheel, and the binary inside it (rejects the 0.1.0 placeholder).
BIN=$PA/wheel/perf_analyzer/bin/perf_analyzer
if [ ! -f "$BIN" ]; then
  mkdir -p "$PA/dl"
  shopt -s nullglob
  WHLS=("$PA"/dl/perf_analyzer-"$PA_VERSION"-*.whl)
  if [ ${#WHLS[@]} -eq 0 ]; then
    "$PYTHON" -m pip --disable-pip-version-check -q download --no-deps -d "$PA/dl" \
      "perf-analyzer==$PA_VERSION" --platform manylinux_2_38_x86_64 --only-binary=:all: \
      || { say "pip download perf-analyzer==$PA_VERSION failed"; exit 1; }
    WHLS=("$PA"/dl/perf_analyzer-"$PA_VERSION"-*.whl)
  fi
  shopt -u nullglob
  [ ${#WHLS[@]} -gt 0 ] || { say "no perf_analyzer-$PA_VERSION wheel downloaded"; exit 1; }
  WHL=${WHLS[0]}
  if ! echo "$PA_SHA256  $WHL" | sha256sum -c --quiet - >/dev/null 2>&1; then
    say "$WHL does not have the pinned sha256 $PA_SHA256"; rm -f "$WHL"; exit 1
  fi
  rm -rf "$PA/wheel"
  "$PYTHON" -m zipfile -e "$WHL" "$PA/wheel"
  if [ ! -f "$BIN" ]; then
    say "$WHL has no perf_analyzer/bin/perf_analyzer (placeholder wheel?)"; exit 1
  fi
  chmod +x "$BIN"
fi

# 2b. Debian trixie's C/C++ runtime, through a private apt state.
L=$PA/glibc-root/usr/lib/x86_64-linux-gnu
if [ ! -e "$L/ld-linux-x86-64.so.2" ] || [ ! -e "$L/libstdc++.so.6" ] || [ ! -e "$L/libgcc_s.so.1" ]; then
  mkdir -p "$PA/apt/lists/partial" "$PA/apt/cache/archives/partial" "$PA/debs"
  ARCHIVE=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    ARCHIVE=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  ARCHIVE=${ARCHIVE:-http://deb.debian.org/debian}
  echo "deb $ARCHIVE trixie main" > "$PA/apt/sources.list"
  O=(-o "Dir::Etc::SourceList=$PA/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o "Dir::State::Lists=$PA/apt/lists" -o "Dir::Cache=$PA/apt/cache"
     -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
  if ! apt-get "${O[@]}" -q update >"$PA/apt/update.log" 2>&1 \
     || grep -qE "^(Err|W: Failed)" "$PA/apt/update.log"; then
    cat "$PA/apt/update.log" >&2
    say "DEBIAN ARCHIVE UNREACHABLE ($ARCHIVE trixie): cannot fetch the private libc"; exit 3
  fi
  rm -f "$PA"/debs/*.deb
  (cd "$PA/debs" && apt-get "${O[@]}" -q download libc6 libstdc++6 libgcc-s1) >&2 \
    || { say "DEBIAN ARCHIVE UNREACHABLE: apt-get download failed"; exit 3; }
  rm -rf "$PA/glibc-root"
  for d in "$PA"/debs/*.deb; do dpkg-deb -x "$d" "$PA/glibc-root"; done
fi

write_private_wrapper
if check_wrapper; then exit 0; fi
say "the wrapper does not run:"; "$WRAPPER" --version >&2 || true
exit 1
