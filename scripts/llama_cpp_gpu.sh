#!/usr/bin/env bash
# lily against llama.cpp on a GPU machine (issue 26): libllama built with CUDA from the llama.cpp
# vendored in the llama-cpp-python sdist, then `lily bench --compare llama.cpp` at 35B-A3B
# dimensions (llama.cpp reads a random Q4_0 GGUF of those dimensions, written once).
#   scripts/llama_cpp_gpu.sh OUT_DIR
# LLAMA_CPP_SDIST          the sdist tarball (default ./llama_cpp_python-0.3.36.tar.gz); the build needs
#                          neither its .git nor vendor/llama.cpp/{models,docs,media,benches,tools/ui}
# LLAMA_CPP_LIB_PATH       a directory whose libllama.so loads: used instead of building one
# LLAMA_CPP_STEPS          build,bench (default both; with a 10-minute limit per command, one per call:
#                          /tmp keeps the builds and the GGUF between calls on a warm machine)
# LILY_BENCH_LENGTHS       default 512,4K
# LILY_LLAMA_CPP_GGUF_DIR  where the 19.5 GB GGUF goes (default /tmp/lily-gguf, not the results)
set -uo pipefail
OUT=${1:?usage: scripts/llama_cpp_gpu.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
STEPS=",${LLAMA_CPP_STEPS:-build,bench},"
SDIST=$(realpath "${LLAMA_CPP_SDIST:-llama_cpp_python-0.3.36.tar.gz}")
SRC=/tmp/llama-cpp-python
export PYTHONUNBUFFERED=1 LILY_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
export LILY_LLAMA_CPP_GGUF_DIR=${LILY_LLAMA_CPP_GGUF_DIR:-/tmp/lily-gguf}

[ -d "$SRC" ] || { mkdir -p "$SRC" && tar xzf "$SDIST" -C "$SRC" --strip-components=1; } || exit 1
build_llama=true
if [ -n "${LLAMA_CPP_LIB_PATH:-}" ]; then
  # a build moved from where it was made finds its ggml libraries (beside libllama) this way
  export LD_LIBRARY_PATH=$LLAMA_CPP_LIB_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if python3 -c 'import ctypes, os, sys; ctypes.CDLL(os.path.join(sys.argv[1], "libllama.so"))' "$LLAMA_CPP_LIB_PATH" 2>/dev/null; then
    echo "llama.cpp: using $LLAMA_CPP_LIB_PATH/libllama.so"
    build_llama=false
  else
    echo "llama.cpp: $LLAMA_CPP_LIB_PATH/libllama.so does not load; building one"
  fi
fi
$build_llama && export LLAMA_CPP_LIB_PATH=/tmp/llama-cpp-build/bin
# the bindings (without their high-level API's dependencies, see lily/bench/llama_cpp_runner.py),
# the gguf package for the tests, and lily
export PYTHONPATH=/tmp/lily:$SRC:$SRC/vendor/llama.cpp/gguf-py

if [[ $STEPS == *,build,* ]]; then
  t0=$(date +%s)
  llama_rc=0
  if $build_llama; then
    ( cmake -S "$SRC/vendor/llama.cpp" -B /tmp/llama-cpp-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF &&
      ninja -C /tmp/llama-cpp-build -j "$(nproc)" llama
      rc=$?; echo "llama.cpp build: rc=$rc in $SECONDS s"; exit $rc
    ) > "$OUT/build_llama_cpp.log" 2>&1 &
    llama_pid=$!
  fi
  rm -rf /tmp/lily  # never bench the previous call's build
  python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/lily . > "$OUT/build_lily.log" 2>&1
  lily_rc=$?
  if $build_llama; then wait "$llama_pid"; llama_rc=$?; fi
  echo "build: lily rc=$lily_rc, llama.cpp rc=$llama_rc ($(( $(date +%s) - t0 )) s in all)"
  $build_llama && tail -1 "$OUT/build_llama_cpp.log"
  [ "$lily_rc" = 0 ] || tail -20 "$OUT/build_lily.log"
  [ "$llama_rc" = 0 ] || tail -20 "$OUT/build_llama_cpp.log"
  [ "$lily_rc" = 0 ] && [ "$llama_rc" = 0 ] || exit 1
fi

if [[ $STEPS == *,bench,* ]]; then
  python3 -m lily bench --synthetic 35b --device cuda --compare llama.cpp --lengths "${LILY_BENCH_LENGTHS:-512,4K}" \
    --phase both --arm-timeout 300 --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
  rc=${PIPESTATUS[0]}
  # what each llama.cpp arm said it did: the GGUF written, the layers offloaded, flash attention
  grep -h -E 'gguf_writer|offloaded|flash_attn +=' "$OUT/bench/logs/"*llama.cpp* 2>/dev/null | sort | uniq -c
  exit "$rc"
fi
