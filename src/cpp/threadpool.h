// A fixed pool of worker threads for data-parallel loops (all cores by default;
// LILY_NUM_THREADS overrides). parallel_for splits [0, n) into contiguous ranges.
#pragma once
#include <cstdint>
#include <functional>

namespace lily {

int num_threads();
void set_num_threads(int n);

// Calls fn(begin, end) on disjoint ranges covering [0, n); returns when all are done.
// Nested calls run inline on the calling thread.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk = 1);

}  // namespace lily
