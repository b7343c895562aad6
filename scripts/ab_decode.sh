#!/usr/bin/env bash
# A/B of decode speed in one GPU call: a base tree against this one, runs alternating.
#   git archive -o ab_base.tar.gz REF        # here (git-ignored: name it in the device call's carry)
#   scripts/ab_decode.sh OUT_DIR [ARM...]     # on the GPU machine
# An arm is NAME or NAME=VAR=VALUE[,VAR=VALUE...]: the arm named "base" runs the base tree's
# build (made from ab_base.tar.gz beside this tree's), every other arm this tree's, with its
# variables set (an A/B switch, or a route's LILY_* variable). Default arms: base this.
# Each round runs every arm once, in reverse order every other round (benchmarks/ops/
# cuda_decode.py at AB_CONTEXT, default 4096, AB_STEPS steps, default 128: ~35 s a run at
# 35B-A3B), and prints "arm tok/s token-digest same-tokens-as-warm-up"; AB_ROUNDS rounds
# (default 2); the JSON rows, with arm and round, go to OUT_DIR/ab_rows.jsonl. AB_BENCH=verify
# runs benchmarks/ops/cuda_verify.py --steps-only instead (AB_STEPS steps of each T = 1..4)
# and prints "arm plain-tok/s verify-ms-T1..T4". This tree is
# built by scripts/gpu_check.sh, which also runs LILY_GPU_STEPS (default: none) with
# LILY_GPU_SUITES; its summary is printed first.
set -uo pipefail
OUT=$(realpath -m "${1:?usage: scripts/ab_decode.sh OUT_DIR [ARM...]}")
shift
ARMS=("$@")
[ ${#ARMS[@]} -gt 0 ] || ARMS=(base this)
[[ ${AB_BENCH:-decode} =~ ^(decode|verify)$ ]] || { echo "ab_decode: AB_BENCH is 'decode' or 'verify', not '$AB_BENCH'" >&2; exit 2; }
for arm in "${ARMS[@]}"; do  # NAME[=VAR=VALUE[,VAR=VALUE...]]
  [[ $arm =~ ^[A-Za-z0-9_.-]+(=[A-Za-z_][A-Za-z0-9_]*=[^,]*(,[A-Za-z_][A-Za-z0-9_]*=[^,]*)*)?$ ]] ||
    { echo "ab_decode: arm '$arm' is not NAME or NAME=VAR=VALUE[,VAR=VALUE...]" >&2; exit 2; }
done
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
if [[ " ${ARMS[*]} " == *" base "* || " ${ARMS[*]} " == *" base="* ]]; then
  [ -f ab_base.tar.gz ] || { echo "ab_decode: arm 'base' needs ab_base.tar.gz at the repo root" >&2; exit 2; }
  rm -rf /tmp/ab_base_src /tmp/ab_base && mkdir -p /tmp/ab_base_src && tar -xzf ab_base.tar.gz -C /tmp/ab_base_src
  ( cd /tmp/ab_base_src && CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 3 + 1 )) LILY_CUDA=ON python3 -m pip install -q \
      --no-build-isolation --no-deps --target /tmp/ab_base . > "$OUT/build_base.log" 2>&1
    rc=$?; echo "base build: rc=$rc"; [ $rc = 0 ] || tail -20 "$OUT/build_base.log" ) &
fi
LILY_GPU_STEPS=${LILY_GPU_STEPS:-none} bash scripts/gpu_check.sh "$OUT/check" > "$OUT/gpu_check.txt" 2>&1
sed -n '/== summary ==/,$p' "$OUT/gpu_check.txt"
wait
for round in $(seq "${AB_ROUNDS:-2}"); do
  order=("${ARMS[@]}")
  (( round % 2 == 0 )) && for (( i = 0; i < ${#ARMS[@]}; ++i )); do order[i]=${ARMS[${#ARMS[@]} - 1 - i]}; done
  for arm in "${order[@]}"; do
    name=${arm%%=*}
    vars=()
    [[ $arm == *=* ]] && IFS=, read -ra vars <<< "${arm#*=}"
    path=/tmp/lily
    [ "$name" = base ] && path=/tmp/ab_base
    bench=(benchmarks/ops/cuda_decode.py --contexts "${AB_CONTEXT:-4096}" --steps "${AB_STEPS:-128}")
    [ "${AB_BENCH:-decode}" = verify ] &&
      bench=(benchmarks/ops/cuda_verify.py --steps-only --context "${AB_CONTEXT:-4096}" --tokens "${AB_STEPS:-128}")
    row=$(env PYTHONPATH=$path "${vars[@]}" timeout 150 python3 "${bench[@]}" 2>> "$OUT/ab_$name.log" | grep '^{')
    echo "$name $(python3 - "$row" "$name" "$round" "$OUT/ab_rows.jsonl" <<'PY' 2>/dev/null || echo failed
import json, sys
r = dict(json.loads(sys.argv[1]), arm=sys.argv[2], round=int(sys.argv[3]))
with open(sys.argv[4], "a") as f:
    f.write(json.dumps(r) + "\n")
if "verify_ms" in r:
    print(round(r["plain_decode_tok_s"], 1), " ".join(f"{v:.3f}" for v in r["verify_ms"].values()))
else:
    print(round(r["decode_tok_s"], 1), r["token_digest"], r["same_tokens_as_warmup"])
PY
)"
  done
done
