#!/usr/bin/env bash
# Builds the kernel registry (benchmarks/ops/*.cu with every kernel in src/cuda/*.cu, one
# nvcc per file in parallel, then a link) and runs it; arguments go to the binary:
#   benchmarks/ops/run.sh [--only SUBSTRING]... [--json PATH] [--reps N] [--list]
# LILY_OPS_BUILD names the build folder (default build/ops_bench).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${LILY_OPS_BUILD:-build/ops_bench}
FLAGS="-std=c++20 -gencode=arch=compute_90a,code=sm_90a -O3 --use_fast_math -lineinfo -Isrc/cpp -Isrc/cuda"
mkdir -p "$BUILD"
rm -f "$BUILD"/*.o
t0=$(date +%s)
printf '%s\n' benchmarks/ops/*.cu src/cuda/*.cu |
  xargs -P "$(nproc)" -I{} sh -c 'nvcc '"$FLAGS"' -c "$1" -o "$2/$(echo "$1" | tr / _).o"' _ {} "$BUILD"
nvcc $FLAGS "$BUILD"/*.o -o "$BUILD/ops_bench"
echo "ops_bench built in $(( $(date +%s) - t0 )) s" >&2
exec "$BUILD/ops_bench" "$@"
