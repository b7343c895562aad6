// Timing of one registry entry and the card's ceilings, measured in the same run.
#pragma once
#include <cuda_runtime.h>

#include <vector>

#include "bench.h"

namespace lily::bench {

struct Timing {
  double us_median = 0, us_min = 0;  // one launch after an L2 flush, events around it
  double us_warm = 0;                // per launch in a graph of back-to-back launches
};

class Timer {
 public:
  explicit Timer(int reps);
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  cudaStream_t stream() const { return stream_; }
  size_t flush_bytes() const { return flush_n_ * sizeof(uint4); }

  // Cold: `reps` times (read 256 MB so L2 holds none of the op's data; event; launch;
  // event), median and min, nothing subtracted. Warm: a graph of kWarmLaunches launches
  // replayed kWarmReplays times (PDL overlap; inputs under 50 MB stay in L2).
  Timing time(const Launch& launch);

  static constexpr int kWarmLaunches = 20, kWarmReplays = 5;

 private:
  int reps_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;  // 2 * reps: before / after each cold launch
  Arena flush_arena_;
  const uint4* flush_ = nullptr;
  size_t flush_n_ = 0;
  unsigned* sink_ = nullptr;

  void flush_l2();
  double elapsed_us(cudaEvent_t a, cudaEvent_t b) const;
};

// cudaMemcpy device to device of 1 GiB: (bytes read + written) / time, median of 10, GB/s.
double copy_gbs(Timer& timer);

// A bf16 GEMM on mma.sync m16n8k16 (8192^3, fp32 accumulate), spot-checked against
// fp64: median of 10, TFLOP/s. cuBLAS (wgmma) is faster on Hopper, so this is a lower
// bound of the card's bf16 rate, and the ceiling of lily's mma.sync kernels.
double matmul_probe_tflops(Timer& timer);

}  // namespace lily::bench
