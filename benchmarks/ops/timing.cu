#include <algorithm>

#include "common/cuda_check.h"
#include "common/device_common.cuh"
#include "harness.h"

namespace lily::bench {
namespace {

using cuda::check;

constexpr size_t kFlushBytes = size_t(256) << 20;  // > 4x the H200's L2 (50-60 MB)

// Reads the flush buffer through L2 (so L2 ends up full of clean lines, as after the
// previous kernels of a decode step; a write sweep would leave ~50 MB of dirty lines for
// the timed op to write back). The store that never happens keeps the loads alive.
__global__ void l2_flush_kernel(const uint4* buf, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcg(buf + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

}  // namespace

Timer::Timer(int reps) : reps_(reps) {
  if (reps < 1) fail("ops_bench: --reps must be at least 1");
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "ops_bench: stream");
  events_.resize(2 * reps);
  for (cudaEvent_t& e : events_) check(cudaEventCreate(&e), "ops_bench: event");
  flush_n_ = kFlushBytes / sizeof(uint4);
  flush_ = reinterpret_cast<const uint4*>(flush_arena_.words(kFlushBytes / 4));
  sink_ = flush_arena_.zeros<unsigned>(1);
  check(cudaDeviceSynchronize(), "ops_bench: flush buffer");
}

Timer::~Timer() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (stream_) cudaStreamDestroy(stream_);
}

void Timer::flush_l2() {
  l2_flush_kernel<<<4 * cuda::sm_count(), 512, 0, stream_>>>(flush_, flush_n_, sink_);
  check(cudaGetLastError(), "ops_bench: l2 flush");
}

double Timer::elapsed_us(cudaEvent_t a, cudaEvent_t b) const {
  float ms = 0;
  check(cudaEventElapsedTime(&ms, a, b), "ops_bench: event time");
  return 1000.0 * ms;
}

Timing Timer::time(const Launch& launch) {
  // Warm-up: surfaces argument and launch errors, and runs the ops' one-time setup
  // (function attributes) before any capture.
  launch(stream_);
  check(cudaStreamSynchronize(stream_), "ops_bench: warm-up launch");

  Timing t;
  for (int r = 0; r < reps_; ++r) {
    flush_l2();
    check(cudaEventRecord(events_[2 * r], stream_), "ops_bench: event record");
    launch(stream_);
    check(cudaEventRecord(events_[2 * r + 1], stream_), "ops_bench: event record");
  }
  check(cudaStreamSynchronize(stream_), "ops_bench: cold launches");
  std::vector<double> us(reps_);
  for (int r = 0; r < reps_; ++r) us[r] = elapsed_us(events_[2 * r], events_[2 * r + 1]);
  std::sort(us.begin(), us.end());
  t.us_median = us[reps_ / 2];
  t.us_min = us[0];

  cudaGraph_t graph = nullptr;
  check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), "ops_bench: begin capture");
  try {
    for (int i = 0; i < kWarmLaunches; ++i) launch(stream_);
  } catch (...) {
    cudaStreamEndCapture(stream_, &graph);  // leave the stream usable
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  check(cudaStreamEndCapture(stream_, &graph), "ops_bench: end capture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check(inst, "ops_bench: graph instantiate");
  check(cudaGraphLaunch(exec, stream_), "ops_bench: graph launch");  // warm-up
  check(cudaEventRecord(events_[0], stream_), "ops_bench: event record");
  for (int r = 0; r < kWarmReplays; ++r) check(cudaGraphLaunch(exec, stream_), "ops_bench: graph launch");
  check(cudaEventRecord(events_[1], stream_), "ops_bench: event record");
  const cudaError_t done = cudaStreamSynchronize(stream_);
  cudaGraphExecDestroy(exec);
  check(done, "ops_bench: warm launches");
  t.us_warm = elapsed_us(events_[0], events_[1]) / (kWarmLaunches * kWarmReplays);
  return t;
}

double copy_gbs(Timer& timer) {
  const size_t bytes = size_t(1) << 30;
  Arena arena;
  const void* src = arena.words(bytes / 4);
  void* dst = arena.zeros<uint8_t>(bytes);
  check(cudaDeviceSynchronize(), "copy ceiling: fill");
  cudaStream_t s = timer.stream();
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "copy ceiling: warm-up");
  constexpr int kReps = 10;
  std::vector<cudaEvent_t> ev(2 * kReps);
  for (cudaEvent_t& e : ev) check(cudaEventCreate(&e), "copy ceiling: event");
  for (int r = 0; r < kReps; ++r) {
    check(cudaEventRecord(ev[2 * r], s), "copy ceiling: event record");
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "copy ceiling: copy");
    check(cudaEventRecord(ev[2 * r + 1], s), "copy ceiling: event record");
  }
  check(cudaStreamSynchronize(s), "copy ceiling: copies");
  std::vector<double> gbs(kReps);
  for (int r = 0; r < kReps; ++r) {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, ev[2 * r], ev[2 * r + 1]), "copy ceiling: event time");
    gbs[r] = 2.0 * bytes / (ms * 1e-3) * 1e-9;
  }
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  std::sort(gbs.begin(), gbs.end());
  return gbs[kReps / 2];
}

}  // namespace lily::bench
