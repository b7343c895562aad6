#!/usr/bin/env bash
# Builds the kernel registry (the CMake target lily_ops_bench: benchmarks/ops/*.cu against
# the package's CUDA objects) and runs it; arguments go to the binary:
#   benchmarks/ops/run.sh [--only SUBSTRING]... [--json PATH] [--reps N] [--list]
# LILY_OPS_BUILD names the build folder (default build/ops_bench).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${LILY_OPS_BUILD:-build/ops_bench}
t0=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DLILY_CUDA=ON -DPython_EXECUTABLE="$(command -v python3)" > /dev/null
cmake --build "$BUILD" --target lily_ops_bench -j "$(nproc)" > /dev/null
echo "ops_bench built in $(( $(date +%s) - t0 )) s" >&2
exec "$BUILD/lily_ops_bench" "$@"
