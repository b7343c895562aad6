// L2 prefetch of what a later kernel of the decode step will read.
//
// Decode kernels are latency-bound: each one waits on its predecessor, then starts
// reading its weights, so HBM idles between kernels (~20 % of the copy rate over a step).
// Weights are known before the step runs, so a small kernel on a side branch of the
// step's graph, forked after kernel j, asks L2 (60 MB on an H200) for the weights of
// kernels j+2, j+3, ... (kernel j+1 is already starting: PDL); they then read at L2
// latency. Routed experts are known once the router has run (their ids are read on the
// device), the KV cache's length once the step starts (*pos). Prefetches are hints
// (cp.async.bulk.prefetch.L2): no result depends on them.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "kernel_types.h"

namespace lily::cuda {

struct L2Span {
  const void* p = nullptr;
  size_t bytes = 0;
};

struct L2Prefetch {
  static constexpr int kMaxSpans = 8;
  L2Span span[kMaxSpans];  // fixed ranges (weights, recurrent state)
  int n_span = 0;
  // Routed experts: expert[j] shifted by ids[i] * expert_stride[j] for each of the k ids.
  const int* ids = nullptr;
  int k = 0;
  L2Span expert[4];
  size_t expert_stride[4] = {};
  int n_expert = 0;
  // A cache's first *pos positions: cache[j].bytes per position, at most cache_cap bytes.
  const int* pos = nullptr;
  L2Span cache[2];
  int n_cache = 0;
  size_t cache_cap = 0;

  void add(const void* p, size_t bytes);
  void add(const QMat& W);  // codes and scales|biases
  // Rows [r * rows_per_expert, (r + 1) * rows_per_expert) of W for each routed expert r.
  void add_experts(const QMat& W, int rows_per_expert, const int* ids_, int k_);
  void add_cache(const void* p, size_t bytes_per_pos, const int* pos_, size_t cap);
  bool empty() const { return n_span == 0 && n_expert == 0 && n_cache == 0; }
};

// Enqueues the prefetch kernel (a few blocks; returns at once on the device).
void l2_prefetch(const L2Prefetch& list, cudaStream_t stream);

// The side branch of a step: fork() runs a prefetch after everything queued so far on
// `main` without delaying `main`; join() makes `main` wait for the branch (a captured
// graph must end joined). Off (fork does nothing) with LILY_CUDA_L2_PREFETCH=0.
class PrefetchBranch {
 public:
  PrefetchBranch();
  ~PrefetchBranch();
  PrefetchBranch(const PrefetchBranch&) = delete;
  PrefetchBranch& operator=(const PrefetchBranch&) = delete;

  bool enabled() const { return enabled_; }
  void fork(cudaStream_t main, const L2Prefetch& list);
  void join(cudaStream_t main);

 private:
  bool enabled_ = true;
  bool open_ = false;  // forked since the last join
  cudaStream_t side_ = nullptr;
  std::vector<cudaEvent_t> events_;  // one per fork of a step, reused step after step
  size_t used_ = 0;
  cudaEvent_t joined_ = nullptr;
  cudaEvent_t next_event();
};

}  // namespace lily::cuda
