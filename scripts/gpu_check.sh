#!/usr/bin/env bash
# Build, test and benchmark the CUDA executor on a GPU machine in one go.
#   scripts/gpu_check.sh OUT_DIR
# Steps (LILY_GPU_STEPS, comma-separated; default all):
#   kernels      the C++ kernel suites (src/cuda/tests), one process per suite (LILY_GPU_SUITES names a
#                subset, comma-separated)
#   pytest       the GPU pytest files: every CUDA op and route against its reference (test_ops.py), the
#                CUDA executor against the CPU's on small checkpoints, verify steps and the MTP head
#   consistency  CUDA vs CPU executor at full 35B-A3B dimensions, both prefill routes, both
#                random-weight styles; then 2,304 positions at 4 layers, conditioned weights
#                (a chunk of >= 2,048 tokens: the dense GEMMs take their wgmma route)
#   decode       prefill + decode throughput at 35B-A3B dimensions (benchmarks/ops/cuda_decode.py)
#   profile      per-op times of a prefill chunk at 4K and 32K context (LILY_PREFILL_PROFILE=1)
#   ablations    prefill at 4K under each ablation switch of docs/perf-log.md
#   gdnrule      prefill at 64..4K with the sequential scan and with the chunked GDN
#                (the measured rule that picks one by length)
#   timeline     per-kernel time inside real decode steps (LILY_TIMELINE_CONTEXTS, default 4096): a second
#                build with LILY_CUDA_TIMELINE=ON, benchmarks/ops/decode_timeline.py (per kernel, then
#                the first 26 kernels of a step one by one; then a second run with every block
#                stamped: the spread of each kernel's block starts and ends); the raw records go into logs.tgz
#   splitkeys    decode at 512..4K with 64, 128 and 256 keys per attention split (LILY_CUDA_ATTN_SPLIT_KEYS)
#   longctx      prefill at 32K and 128K with the default (wgmma) attention / dense GEMMs and
#                with their mma.sync alternatives
#   variants     each alternative route (VARIANTS below): its kernel suite, the GPU pytest
#                with it switched on, prefill/decode at 4K; the fastest correct ones are
#                then switched on for the bench step (scripts/pick_variants.py)
#   ops          the kernel registry with a cold L2 (benchmarks/ops)
#   bench        `lily bench --synthetic 35b` over LILY_BENCH_LENGTHS (default 512,4K;
#                LILY_BENCH_COMPARE=hf adds the transformers peer) into OUT_DIR/bench
# The package and the kernel tests are always built. Logs go to OUT_DIR (packed into
# OUT_DIR/logs.tgz at the end, with the JSON results beside it); a short summary is
# printed last. The GPU machine gets the tree without .git: pass
# LILY_GIT_COMMIT=$(git rev-parse HEAD) so results name their commit.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
STEPS=",${LILY_GPU_STEPS:-kernels,pytest,consistency,decode,ops,bench},"
LILY_GPU_SUITES=${LILY_GPU_SUITES:-qmatmul_decode,head,qmatmul_prefill,moe_prefill,wgmma,rows}
want() { [[ $STEPS == *",$1,"* ]]; }
JOBS=$(nproc)
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS LILY_CUDA=ON PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"

t0=$(date +%s)
build_kernel_tests() {  # the CMake targets of the kernel tests and the kernel registry (CMakeLists.txt)
  cmake -S . -B /tmp/kt -G Ninja -DLILY_CUDA=ON -DPython_EXECUTABLE="$(command -v python3)" &&
  cmake --build /tmp/kt --target lily_kernel_tests lily_ops_bench -j "$JOBS" &&
  cp /tmp/kt/lily_kernel_tests /tmp/kernel_tests
}
rm -rf /tmp/lily /tmp/kt /tmp/kernel_tests  # a warm machine keeps /tmp: never test the previous call's build
( build_kernel_tests > "$OUT/build_kernel_tests.log" 2>&1; echo $? > /tmp/kernel_tests.rc ) &
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/lily . > "$OUT/build_package.log" 2>&1
pip_rc=$?
wait
kt_build_rc=$(cat /tmp/kernel_tests.rc)
echo "build: package rc=$pip_rc, kernel tests rc=$kt_build_rc ($(( $(date +%s) - t0 )) s)"
export PYTHONPATH=/tmp/lily
[ "$pip_rc" = 0 ] || tail -40 "$OUT/build_package.log"
[ "$kt_build_rc" = 0 ] || grep -m 20 error "$OUT/build_kernel_tests.log"

# switch -> kernel suites that must pass for it to compete
declare -A VARIANTS=([LILY_PREFILL_GEMM=exact]=qmatmul_prefill [LILY_PREFILL_GDN=scan]=""
                     [LILY_CUDA_ATTN_TC=0]=""
                     [LILY_PREFILL_ATTN=mma]="" [LILY_PREFILL_GEMM=bf16w]=qmatmul_prefill
                     [LILY_PREFILL_GEMM=wgmma]="wgmma qmatmul_prefill")
declare -A RC
suites_pass() {  # switches... : every kernel suite of each switch passed (always true when the kernels step is not
  local v suite  # run), and the pytest step, which runs every route's kernels through test_ops.py, when it ran
  want pytest && [ "${RC[pytest]:-1}" != 0 ] && return 1
  want kernels || return 0
  for v in $1; do
    for suite in ${VARIANTS[$v]:-}; do [ "${RC[kernels_$suite]:-1}" = 0 ] || return 1; done
  done
}
run_step() {  # name timeout log command...
  local name=$1 limit=$2 log=$3
  shift 3
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  RC[$name]=$?
  echo "$name: rc=${RC[$name]} ($(tail -1 "$OUT/$log"))"
}

if want kernels && [ "$kt_build_rc" = 0 ]; then
  : > "$OUT/kernel_tests.log"
  for suite in ${LILY_GPU_SUITES//,/ }; do
    timeout 100 /tmp/kernel_tests --suite $suite >> "$OUT/kernel_tests.log" 2>&1
    RC[kernels_$suite]=$?
    echo "kernels $suite: rc=${RC[kernels_$suite]}"
  done
fi
if [ "$pip_rc" = 0 ]; then
  want pytest && run_step pytest 480 pytest_cuda.log python3 -m pytest -q tests/test_cuda_executor.py tests/test_ops.py \
    tests/test_verify.py tests/test_mtp.py
  if want consistency; then
    run_step consistency 300 consistency.log python3 benchmarks/ops/consistency_35b.py --json "$OUT/consistency.json"
    run_step consistency_long 300 consistency_long.log python3 benchmarks/ops/consistency_35b.py --layers 4 \
      --positions 2304 --styles conditioned --json "$OUT/consistency_long.json"
  fi
  want decode && run_step decode 240 decode.log python3 benchmarks/ops/cuda_decode.py --contexts "${LILY_DECODE_CONTEXTS:-512,4096}" --json "$OUT/decode.json"
  want profile && run_step profile 200 profile.log env LILY_PREFILL_PROFILE=1 python3 benchmarks/ops/cuda_decode.py --contexts 4096,32768 --steps 4
  if want ablations; then
    : > "$OUT/ablations.log"
    for switch in "" LILY_PREFILL_MOE_TILE=16 LILY_PREFILL_MOE_TILE=32 LILY_PREFILL_MOE_TILE=128 LILY_PREFILL_HOST_ROUTING=1; do
      echo "== ${switch:-default}" >> "$OUT/ablations.log"
      timeout 120 env $switch python3 benchmarks/ops/cuda_decode.py --contexts 4096 --steps 8 >> "$OUT/ablations.log" 2>&1
    done
  fi
  if want gdnrule; then
    : > "$OUT/gdnrule.log"
    for gdn in scan chunked; do
      echo "== LILY_PREFILL_GDN=$gdn" >> "$OUT/gdnrule.log"
      timeout 150 env LILY_PREFILL_GDN=$gdn python3 benchmarks/ops/cuda_decode.py --contexts 64,128,256,512,1024,2048,4096 \
        --steps 4 2>&1 | grep '^{' >> "$OUT/gdnrule.log"
    done
  fi
  if want splitkeys; then  # decode at short contexts with each attention split size (keys per split-K block)
    : > "$OUT/splitkeys.log"
    for keys in 64 128 256; do
      echo "== LILY_CUDA_ATTN_SPLIT_KEYS=$keys" >> "$OUT/splitkeys.log"
      timeout 120 env LILY_CUDA_ATTN_SPLIT_KEYS=$keys python3 benchmarks/ops/cuda_decode.py --contexts 512,1024,2048,4096 \
        --steps 64 2>&1 | grep '^{' >> "$OUT/splitkeys.log"
    done
  fi
  if want timeline; then  # per-kernel time inside real decode steps, from a second build with the timeline on
    python3 -m pip install -q --no-build-isolation --no-deps --config-settings=cmake.define.LILY_CUDA_TIMELINE=ON \
      --config-settings=build-dir=/tmp/lily_tl_build --target /tmp/lily_tl . > "$OUT/build_timeline.log" 2>&1 &&
      for ctx in ${LILY_TIMELINE_CONTEXTS:-4096}; do
        rm -f "$OUT/timeline_$ctx.txt"
        PYTHONPATH=/tmp/lily_tl LILY_CUDA_TIMELINE_OUT="$OUT/timeline_$ctx.txt" timeout 120 \
          python3 benchmarks/ops/cuda_decode.py --contexts $ctx --steps 64 > /dev/null 2>&1
        echo "== decode timeline at $ctx"
        python3 benchmarks/ops/decode_timeline.py "$OUT/timeline_$ctx.txt" --positions 26 --json "$OUT/timeline_$ctx.json"
        # again with every block stamped (one more atomic per block: a run of its own)
        rm -f /tmp/tl_stamped.txt
        PYTHONPATH=/tmp/lily_tl LILY_CUDA_TIMELINE_OUT=/tmp/tl_stamped.txt LILY_CUDA_TIMELINE_BLOCKS=/tmp/blocks_$ctx.bin \
          timeout 120 python3 benchmarks/ops/cuda_decode.py --contexts $ctx --steps 64 > /dev/null 2>&1
        echo "== every block's stamps at $ctx (a second run)"
        python3 benchmarks/ops/decode_timeline.py /tmp/tl_stamped.txt --positions 26 --blocks /tmp/blocks_$ctx.bin |
          sed -n '/first start/,$p'
      done > "$OUT/timeline.log" 2>&1
    echo "timeline: rc=$? ($(head -2 "$OUT/timeline.log" | tail -1))"
  fi
  if want longctx; then  # prefill at 32K and 128K with each route (the attention's share grows with the context)
    : > "$OUT/longctx.log"
    for cfg in "" LILY_PREFILL_ATTN=mma LILY_PREFILL_GEMM=bf16w "LILY_PREFILL_ATTN=mma LILY_PREFILL_GEMM=bf16w"; do
      if ! suites_pass "$cfg"; then echo "longctx $cfg: a kernel suite or the pytest step failed, skipped"; continue; fi
      echo "== prefill $cfg" >> "$OUT/longctx.log"
      timeout 150 env $cfg python3 benchmarks/ops/cuda_decode.py --contexts 32768,131072 --steps 4 2>&1 | grep '^{' >> "$OUT/longctx.log"
    done
  fi
  PICKED=""
  if want variants; then
    ok=""
    for v in "${!VARIANTS[@]}"; do  # a variant competes once its kernel suite and the GPU pytest pass with it on
      if ! suites_pass "$v"; then echo "variant $v: a suite of '${VARIANTS[$v]}' or the pytest step failed, skipped"; continue; fi
      timeout 120 env $v python3 -m pytest -q -x tests/test_cuda_executor.py > "$OUT/pytest_$v.log" 2>&1
      prc=$?
      echo "variant $v: kernels rc=0, pytest rc=$prc ($(tail -1 "$OUT/pytest_$v.log"))"
      [ "$prc" = 0 ] && ok="$ok,$v"
    done
    competes() { local w; for w in $1; do [[ ,$ok, == *",$w,"* || $w == LILY_PREFILL_*_TILE=* ]] || return 1; done; }
    : > "$OUT/variants.log"
    for cfg in "" LILY_PREFILL_GEMM=exact LILY_PREFILL_GDN=scan LILY_PREFILL_DENSE_TILE=128 LILY_PREFILL_ATTN=mma \
               LILY_PREFILL_GEMM=bf16w LILY_PREFILL_GEMM=wgmma; do
      competes "$cfg" || continue
      echo "== prefill $cfg" >> "$OUT/variants.log"
      timeout 100 env $cfg python3 benchmarks/ops/cuda_decode.py --contexts 4096 --steps 8 2>&1 | grep '^{' >> "$OUT/variants.log"
    done
    for cfg in "" LILY_CUDA_ATTN_TC=0; do
      competes "$cfg" || continue
      echo "== decode $cfg" >> "$OUT/variants.log"
      timeout 100 env $cfg python3 benchmarks/ops/cuda_decode.py --contexts 4096 --steps 64 2>&1 | grep '^{' >> "$OUT/variants.log"
    done
    PICKED=$(python3 scripts/pick_variants.py "$OUT/variants.log" --ok "$ok")
    echo "variants passing: ${ok#,}; picked for the bench: ${PICKED:-none}"
  fi
  if want ops && [ -x benchmarks/ops/run.sh ]; then
    run_step ops 240 ops.log env LILY_OPS_BUILD=/tmp/kt benchmarks/ops/run.sh --json "$OUT/ops.json"
  fi
  if want bench; then
    compare=${LILY_BENCH_COMPARE:+--compare $LILY_BENCH_COMPARE}
    run_step bench 500 lily_bench.log env $PICKED python3 -m lily bench --synthetic 35b --device cuda \
      --lengths "${LILY_BENCH_LENGTHS:-512,4K}" --phase both $compare --arm-timeout 240 --out "$OUT/bench"
  fi
fi

echo
echo "================ summary ================"
cat "$OUT/device.txt"
echo "build: package rc=$pip_rc, kernel tests rc=$kt_build_rc"
grep -E '^FAIL' "$OUT/kernel_tests.log" 2>/dev/null | head -30
for k in "${!RC[@]}"; do echo "$k: rc=${RC[$k]}"; done | sort
[ -f "$OUT/pytest_cuda.log" ] && grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest_cuda.log" | tail -15
grep -h '^{' "$OUT/consistency.log" "$OUT/consistency_long.log" "$OUT/decode.log" 2>/dev/null
grep -m1 -A16 "prefill profile, chunk of 4096 tokens" "$OUT/profile.log" 2>/dev/null
grep -E '^(==|\{)' "$OUT/ablations.log" 2>/dev/null
grep -E '^(==|\{)' "$OUT/gdnrule.log" 2>/dev/null
grep -E '^(==|\{)' "$OUT/splitkeys.log" 2>/dev/null | cut -c1-110
cat "$OUT/timeline.log" 2>/dev/null | head -40
grep -E '^(==|\{)' "$OUT/longctx.log" 2>/dev/null
grep -E '^(==|\{)' "$OUT/variants.log" 2>/dev/null
want variants && want bench && echo "bench ran with: ${PICKED:-the defaults}"
grep -E '^(device|ceilings|FAIL)' "$OUT/ops.log" 2>/dev/null
grep '^|' "$OUT/ops.log" 2>/dev/null | head -70
sed -n '/^## Prefill/,/^## Peak/p' "$OUT/bench/results.md" 2>/dev/null | grep -v '^## Peak'
( cd "$OUT" && tar czf /tmp/logs.tgz --exclude '*.json' . ; mv /tmp/logs.tgz . && find . -type f ! -name logs.tgz ! -name '*.json' ! -path './bench/*' -delete && find . -mindepth 1 -type d -empty -delete )
