// A fixed pool of worker threads for the data-parallel loops of the CPU ops (one thread
// per core by default; LILY_NUM_THREADS or set_num_threads overrides).
//
// Waking a sleeping thread costs tens of microseconds, as much as a whole decode-sized
// op, so a loop is split only when its work pays for that: each caller says how much
// work one item is, and loops of less than two parts' worth run inline. Split loops are
// cut into chunks that threads claim as they come; the caller claims too, so a worker
// that wakes late leaves its chunks to the caller instead of making it wait. Idle
// workers sleep; nothing spins.
#pragma once
#include <cstdint>
#include <functional>

namespace lily {

// Work is counted in units of about one fp32 multiply-add (a dequantized weight, one
// term of a dot product). A chunk holds at least this much: about 50 us on one core.
constexpr int64_t kMinChunkWork = int64_t(1) << 19;

constexpr int kMaxThreads = 1024;  // more is a typo, not a machine

int num_threads();
void set_num_threads(int n);  // 1 .. kMaxThreads, else lily::Error

// How many chunks parallel_for cuts n items of item_work units each into with the
// current thread count; 1 means the loop runs inline on the calling thread.
int64_t parallel_chunks(int64_t n, int64_t item_work);

// Calls fn(begin, end) on disjoint ranges covering [0, n) and returns when all are
// done; the first exception thrown by fn is rethrown here. Nested calls, and calls
// while another thread's loop holds the pool, run inline.
void parallel_for(int64_t n, int64_t item_work, const std::function<void(int64_t, int64_t)>& fn);

// Loops handed to the workers since the process started (for tests of the splitting).
int64_t parallel_jobs();

}  // namespace lily
