#!/usr/bin/env bash
# Nsight Compute over one verify step of each T (benchmarks/ops/ncu_verify.py) at 35B-A3B
# dimensions, on a GPU machine whose runtime lets ncu read the counters (Firecracker).
#   scripts/ncu_verify.sh OUT_DIR [ROWS=4] [KERNELS=regex] [LAUNCHES=6]
# Writes OUT_DIR/verify.ncu-rep, summary.txt (every section, per kernel), metrics.csv (one row a
# launch) and source_<kernel>.csv (per-SASS stall samples of its last profiled launch). A launch
# costs ~1.6 s of 23 replay passes over the engine's 19 GB: profile a few, not a step's 280.
# LILY_NCU_KEEP_BUILD=1 skips the build (a second run in the same call).
set -uo pipefail
OUT=${1:?usage: scripts/ncu_verify.sh OUT_DIR [ROWS] [KERNELS]}
ROWS=${2:-4}
KERNELS=${3:-down_mma_kernel|gate_up_mma_kernel}
LAUNCHES=${4:-6}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
t0=$(date +%s)
if [ -z "${LILY_NCU_KEEP_BUILD:-}" ]; then  # set: profile the package a previous run built
  rm -rf /tmp/lily
  python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/lily . > "$OUT/build_package.log" 2>&1 ||
    { tail -30 "$OUT/build_package.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH=/tmp/lily
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
  --section WarpStateStats --section Occupancy --section LaunchStats --section SourceCounters"
ncu --clock-control none --profile-from-start off --kernel-name "regex:^($KERNELS)" --launch-count "$LAUNCHES" $SECTIONS \
  --import-source no -f -o "$OUT/verify" python3 benchmarks/ops/ncu_verify.py --rows "$ROWS" > "$OUT/ncu.log" 2>&1
echo "ncu rc=$? ($(( $(date +%s) - t0 )) s)"; tail -5 "$OUT/ncu.log"
ncu -i "$OUT/verify.ncu-rep" --page details --print-summary per-kernel > "$OUT/summary.txt" 2>&1
ncu -i "$OUT/verify.ncu-rep" --page raw --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,launch__registers_per_thread,launch__grid_size,launch__block_size,smsp__inst_executed.sum \
  > "$OUT/metrics.csv" 2>&1
for k in ${KERNELS//|/ }; do  # the last profiled launch of k
  n=$(grep -c "$k" "$OUT/metrics.csv" || true)
  [ "${n:-0}" -gt 0 ] && ncu -i "$OUT/verify.ncu-rep" --kernel-name "regex:^$k" --launch-skip $(( n - 1 )) --launch-count 1 \
    --page source --csv --print-source sass > "$OUT/source_$k.csv" 2>&1
done
ls -la "$OUT"
