#!/usr/bin/env bash
# Per-kernel decode timelines of a base tree and this one in one GPU call (docs/cuda.md):
#   git archive -o ab_base.tar.gz REF        # here (git-ignored: name it in the device call's carry)
#   scripts/timeline_ab.sh OUT_DIR [ROWS...]  # on the GPU machine
# Builds both trees with LILY_CUDA_TIMELINE=ON side by side, runs cuda_decode.py at
# AB_CONTEXT (default 4096) through each and prints decode_timeline.py's per-kernel table;
# then, for each ROWS (several-token verify steps, e.g. 2 4), cuda_verify.py --timeline-rows
# through this tree's build and the table of its verify steps.
set -uo pipefail
OUT=$(realpath -m "${1:?usage: scripts/timeline_ab.sh OUT_DIR [ROWS...]}")
shift
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export LILY_CUDA=ON PYTHONUNBUFFERED=1
CTX=${AB_CONTEXT:-4096}
build() {  # src target log
  ( cd "$1" && CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 2 )) python3 -m pip install -q --no-build-isolation --no-deps \
      --config-settings=cmake.define.LILY_CUDA_TIMELINE=ON --config-settings=build-dir=/tmp/build_$(basename "$2") \
      --target "$2" . > "$3" 2>&1 ); echo "build $(basename "$2"): rc=$?"
}
rm -rf /tmp/tl_base_src /tmp/tl_base /tmp/tl_this && mkdir -p /tmp/tl_base_src && tar -xzf ab_base.tar.gz -C /tmp/tl_base_src
build /tmp/tl_base_src /tmp/tl_base "$OUT/build_base.log" &
build . /tmp/tl_this "$OUT/build_this.log"
wait
for arm in base this; do
  rm -f "$OUT/tl_$arm.txt"
  PYTHONPATH=/tmp/tl_$arm LILY_CUDA_TIMELINE_OUT="$OUT/tl_$arm.txt" timeout 120 \
    python3 benchmarks/ops/cuda_decode.py --contexts "$CTX" --steps 64 > "$OUT/decode_$arm.log" 2>&1
  echo "== $arm: decode timeline at $CTX"
  PYTHONPATH=/tmp/tl_this python3 benchmarks/ops/decode_timeline.py "$OUT/tl_$arm.txt" --json "$OUT/tl_$arm.json"
done
for rows in "$@"; do
  rm -f "$OUT/tl_verify$rows.txt"
  PYTHONPATH=/tmp/tl_this LILY_CUDA_TIMELINE_OUT="$OUT/tl_verify$rows.txt" timeout 120 \
    python3 benchmarks/ops/cuda_verify.py --context "$CTX" --tokens 32 --timeline-rows "$rows" > "$OUT/verify$rows.log" 2>&1
  echo "== this: verify steps of $rows rows at $CTX"
  PYTHONPATH=/tmp/tl_this python3 benchmarks/ops/decode_timeline.py "$OUT/tl_verify$rows.txt" --call 1 \
    --json "$OUT/tl_verify$rows.json"
done
