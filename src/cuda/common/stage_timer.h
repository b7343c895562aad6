// Per-op time of a prefill chunk (LILY_PREFILL_PROFILE=1): an event after each op's
// launches, summed by op name and printed to stderr once the chunk has finished. The
// events serialise programmatic dependent launches, so totals run a little high.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_check.h"

namespace lily::cuda {

class StageTimer {
 public:
  explicit StageTimer(cudaStream_t stream) : stream_(stream) { marks_.push_back({"start", record()}); }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;
  ~StageTimer() {
    for (auto& [name, e] : marks_) cudaEventDestroy(e);
  }

  void mark(const char* op) { marks_.push_back({op, record()}); }

  // Waits for the chunk and prints ms per op, largest first.
  void report(int T) {
    check(cudaEventSynchronize(marks_.back().second), "prefill profile");
    std::map<std::string, double> ms;
    for (size_t i = 1; i < marks_.size(); ++i) {
      float t = 0;
      check(cudaEventElapsedTime(&t, marks_[i - 1].second, marks_[i].second), "prefill profile");
      ms[marks_[i].first] += t;
    }
    std::vector<std::pair<double, std::string>> rows;
    double total = 0;
    for (auto& [name, t] : ms) {
      rows.push_back({t, name});
      total += t;
    }
    std::sort(rows.rbegin(), rows.rend());
    std::fprintf(stderr, "prefill profile, chunk of %d tokens: %.2f ms (%.0f tok/s)\n", T, total, T / total * 1e3);
    for (auto& [t, name] : rows) std::fprintf(stderr, "  %-28s %9.3f ms %5.1f%%\n", name.c_str(), t, 100 * t / total);
  }

 private:
  cudaEvent_t record() {
    cudaEvent_t e;
    check(cudaEventCreate(&e), "cudaEventCreate (prefill profile)");
    check(cudaEventRecord(e, stream_), "cudaEventRecord (prefill profile)");
    return e;
  }
  cudaStream_t stream_;
  std::vector<std::pair<std::string, cudaEvent_t>> marks_;
};

}  // namespace lily::cuda
