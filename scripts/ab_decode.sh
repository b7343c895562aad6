#!/usr/bin/env bash
# A/B of decode speed in one GPU call: a base tree against this one, runs alternating.
#   git archive -o ab_base.tar.gz REF        # here (git-ignored: name it in the device call's carry)
#   scripts/ab_decode.sh OUT_DIR [ARM...]     # on the GPU machine
# An arm is NAME or NAME=VAR=VALUE[,VAR=VALUE...]: the arm named "base" runs the base tree's
# build (made from ab_base.tar.gz beside this tree's), every other arm this tree's, with its
# variables set (an A/B switch, or a route's LILY_* variable). Default arms: base this.
# Each round runs every arm once (benchmarks/ops/cuda_decode.py at AB_CONTEXT, default 4096,
# AB_STEPS steps, default 128) and prints "arm tok/s token-digest same-tokens-as-warm-up";
# AB_ROUNDS rounds (default 2). This tree is built, and tested, by scripts/gpu_check.sh with
# LILY_GPU_STEPS (default: none) and LILY_GPU_SUITES; its summary is printed first.
set -uo pipefail
OUT=${1:?usage: scripts/ab_decode.sh OUT_DIR [ARM...]}
shift
ARMS=("$@")
[ ${#ARMS[@]} -gt 0 ] || ARMS=(base this)
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
if [[ " ${ARMS[*]} " == *" base "* || " ${ARMS[*]} " == *" base="* ]]; then
  [ -f ab_base.tar.gz ] || { echo "ab_decode: arm 'base' needs ab_base.tar.gz at the repo root" >&2; exit 2; }
  rm -rf /tmp/ab_base_src /tmp/ab_base && mkdir -p /tmp/ab_base_src && tar -xzf ab_base.tar.gz -C /tmp/ab_base_src
  ( cd /tmp/ab_base_src && CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 3 + 1 )) LILY_CUDA=ON python3 -m pip install -q \
      --no-build-isolation --no-deps --target /tmp/ab_base . > "$OUT/build_base.log" 2>&1
    echo "base build: rc=$?" ) &
fi
LILY_GPU_STEPS=${LILY_GPU_STEPS:-none} bash scripts/gpu_check.sh "$OUT/check" > "$OUT/gpu_check.txt" 2>&1
sed -n '/== summary ==/,$p' "$OUT/gpu_check.txt"
wait
for round in $(seq "${AB_ROUNDS:-2}"); do
  for arm in "${ARMS[@]}"; do
    name=${arm%%=*}
    vars=()
    [[ $arm == *=* ]] && IFS=, read -ra vars <<< "${arm#*=}"
    path=/tmp/lily
    [ "$name" = base ] && path=/tmp/ab_base
    row=$(env PYTHONPATH=$path "${vars[@]}" timeout 150 python3 benchmarks/ops/cuda_decode.py \
            --contexts "${AB_CONTEXT:-4096}" --steps "${AB_STEPS:-128}" 2>> "$OUT/ab_$name.log" | grep '^{')
    echo "$row" >> "$OUT/ab_rows.jsonl"
    echo "$name $(python3 -c 'import json, sys; r = json.loads(sys.argv[1]); print(round(r["decode_tok_s"], 1), r["token_digest"], r["same_tokens_as_warmup"])' "$row" 2>/dev/null || echo failed)"
  done
done
