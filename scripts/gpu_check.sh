#!/usr/bin/env bash
# Build, test and benchmark the CUDA executor on a GPU machine in one go.
#   scripts/gpu_check.sh OUT_DIR
# 1. builds the kernel tests (nvcc, src/cuda/tests) and the package (pip, LILY_CUDA=ON);
# 2. runs the kernel tests (fp64 references) and the kernel timings at 35B-A3B shapes;
# 3. runs the GPU pytest files (CUDA vs CPU executor on small checkpoints);
# 4. runs the decode benchmark at full 35B-A3B dimensions (random weights), with and
#    without the tensor-core GEMV (LILY_CUDA_TENSOR_CORES=0);
# 5. runs `lily bench --synthetic 35b` over LILY_BENCH_LENGTHS (default 512,4K; add
#    LILY_BENCH_COMPARE=hf for the transformers peer) into OUT_DIR/bench;
# and prints a short summary last. Logs go to OUT_DIR. The GPU machine gets the tree
# without .git: pass LILY_GIT_COMMIT=$(git rev-parse HEAD) so results name their commit.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
JOBS=$(nproc)
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS LILY_CUDA=ON PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"

NVCC_FLAGS="-std=c++20 -gencode=arch=compute_90a,code=sm_90a -O3 --use_fast_math -lineinfo -Isrc/cpp -Isrc/cuda -Isrc/cuda/tests"
KERNELS="src/cuda/qmma_pack.cu src/cuda/gemv.cu src/cuda/moe_router.cu src/cuda/moe_experts.cu src/cuda/gdn_decode.cu src/cuda/attention_decode.cu src/cuda/lm_head.cu src/cuda/sampler.cu src/cuda/device_common.cu"
t0=$(date +%s)
( nvcc $NVCC_FLAGS --threads 4 src/cuda/tests/*.cu $KERNELS src/cpp/sampling.cpp -o /tmp/kernel_tests \
    > "$OUT/build_kernel_tests.log" 2>&1; echo $? > /tmp/kernel_tests.rc ) &
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/lily . > "$OUT/build_package.log" 2>&1
pip_rc=$?
wait
kt_build_rc=$(cat /tmp/kernel_tests.rc)
echo "build: package rc=$pip_rc, kernel tests rc=$kt_build_rc ($(( $(date +%s) - t0 )) s)"
export PYTHONPATH=/tmp/lily

kt_rc=1
if [ "$kt_build_rc" = 0 ]; then
  timeout 150 /tmp/kernel_tests --long --bench 2>&1 | tee "$OUT/kernel_tests.log"
  kt_rc=${PIPESTATUS[0]}
fi

py_rc=1
bench_rc=1
if [ "$pip_rc" = 0 ]; then
  timeout 150 python3 -m pytest -q tests/test_cuda_executor.py 2>&1 | tee "$OUT/pytest_cuda.log"
  py_rc=${PIPESTATUS[0]}
  timeout 200 python3 benchmarks/ops/cuda_decode.py --contexts 512,4096 --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log"
  bench_rc=${PIPESTATUS[0]}
  LILY_CUDA_TENSOR_CORES=0 timeout 120 python3 benchmarks/ops/cuda_decode.py --contexts 4096 --json "$OUT/decode_fp32dot.json" 2>&1 \
    | tee "$OUT/decode_fp32dot.log"
  compare=${LILY_BENCH_COMPARE:+--compare $LILY_BENCH_COMPARE}
  timeout 400 python3 -m lily bench --synthetic 35b --device cuda --lengths "${LILY_BENCH_LENGTHS:-512,4K}" \
    --phase both $compare --arm-timeout 200 --out "$OUT/bench" > "$OUT/lily_bench.log" 2>&1
  echo "lily bench: rc=$?"
else
  tail -40 "$OUT/build_package.log"
fi

echo
echo "================ summary ================"
cat "$OUT/device.txt"
echo "kernel tests: build rc=$kt_build_rc, run rc=$kt_rc ($(grep -c '^FAIL' "$OUT/kernel_tests.log" 2>/dev/null) FAIL lines)"
grep '^FAIL' "$OUT/kernel_tests.log" 2>/dev/null | head -20
grep '^|' "$OUT/kernel_tests.log" 2>/dev/null
grep 'device-to-device' "$OUT/kernel_tests.log" 2>/dev/null
echo "pytest (cuda): rc=$py_rc: $(tail -1 "$OUT/pytest_cuda.log" 2>/dev/null)"
echo "decode bench: rc=$bench_rc"
grep "^{" "$OUT/decode.log" "$OUT/decode_fp32dot.log" 2>/dev/null
sed -n '/^## Prefill/,/^## Peak/p' "$OUT/bench/results.md" 2>/dev/null | grep -v '^## Peak'
