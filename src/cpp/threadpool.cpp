#include "threadpool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "error.h"
#include "options.h"

namespace lily {
namespace {

// Chunks per thread when a loop is large: enough that a thread slowed by another
// process leaves only a small share to the others.
constexpr int64_t kChunksPerThread = 4;

// How a loop is cut: count chunks of `items` items each (the last one shorter).
struct Split {
  int64_t items, count;
};

// As many chunks as the work fills, at most kChunksPerThread per thread.
Split split(int64_t n, int64_t item_work, int threads) {
  const int64_t work = std::max<int64_t>(1, item_work);
  const int64_t items_per_min_chunk = (kMinChunkWork + work - 1) / work;
  const int64_t wanted = std::min<int64_t>(n / items_per_min_chunk, threads * kChunksPerThread);
  if (threads <= 1 || wanted <= 1) return {n, 1};
  const int64_t items = (n + wanted - 1) / wanted;
  return {items, (n + items - 1) / items};
}

// One loop at a time is shared with the workers (run_mu_). The caller publishes it
// under mu_, wakes as many sleeping workers as there are chunks beyond its own, then
// claims chunks itself; a worker joins a loop at most once and is counted in active_
// while it may touch the loop, so the caller returns only once active_ is back to 0.
class Pool {
 public:
  explicit Pool(int n) { start_workers(n); }
  ~Pool() { stop_workers(); }

  int size() const { return size_.load(); }

  void resize(int n) {
    std::lock_guard<std::mutex> run_lock(run_mu_);  // not while a loop is running
    stop_workers();
    start_workers(n);
  }

  void run(int64_t n, int64_t item_work, const std::function<void(int64_t, int64_t)>& fn) {
    if (tls_inside_) return fn(0, n);
    std::unique_lock<std::mutex> run_lock(run_mu_, std::try_to_lock);
    const Split cut = run_lock ? split(n, item_work, size()) : Split{n, 1};
    if (cut.count <= 1) return fn(0, n);

    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_ = n;
      chunk_ = cut.items;
      chunks_ = cut.count;
      next_.store(0, std::memory_order_relaxed);
      error_ = nullptr;
      open_ = true;
      ++epoch_;
    }
    ++jobs_;
    const int64_t helpers = std::min<int64_t>(cut.count, size()) - 1;
    for (int64_t i = 0; i < helpers; ++i) work_cv_.notify_one();
    claim_chunks();

    std::unique_lock<std::mutex> lk(mu_);
    open_ = false;  // late wakers leave it alone
    done_cv_.wait(lk, [&] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  int64_t jobs() const { return jobs_.load(); }

 private:
  void claim_chunks() {
    tls_inside_ = true;
    for (int64_t c; (c = next_.fetch_add(1, std::memory_order_relaxed)) < chunks_;) {
      const int64_t begin = c * chunk_, end = std::min(n_, begin + chunk_);
      try {
        (*fn_)(begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(chunks_, std::memory_order_relaxed);  // the loop has failed: stop claiming
      }
    }
    tls_inside_ = false;
  }

  void worker_loop(uint64_t seen) {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] { return stopping_ || (open_ && epoch_ != seen); });
      if (stopping_) return;
      seen = epoch_;
      ++active_;
      lk.unlock();
      claim_chunks();
      lk.lock();
      if (--active_ == 0) done_cv_.notify_one();
    }
  }

  void start_workers(int n) {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = false;
    // A new worker has seen every loop so far: it must not join a finished one.
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, seen = epoch_] { worker_loop(seen); });
    size_ = n;
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::atomic<int> size_{1};  // workers + the caller; read without run_mu_
  std::mutex run_mu_, mu_;
  std::condition_variable work_cv_, done_cv_;
  // The current loop; written under mu_ while no worker is active.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 0, chunks_ = 0;
  std::atomic<int64_t> next_{0};  // the next unclaimed chunk
  bool open_ = false, stopping_ = false;
  uint64_t epoch_ = 0;  // loops published so far
  int active_ = 0;      // workers inside the current loop
  std::exception_ptr error_;
  std::atomic<int64_t> jobs_{0};
  static thread_local bool tls_inside_;
};

thread_local bool Pool::tls_inside_ = false;

// LILY_NUM_THREADS (options.h), else one thread per core.
int default_threads() {
  const int n = ExecutorOptions::from_env("LILY_NUM_THREADS").num_threads;
  return n > 0 ? n : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

Pool& pool() {
  static Pool p(default_threads());
  return p;
}

}  // namespace

int num_threads() { return pool().size(); }
void set_num_threads(int n) {
  if (n < 1 || n > kMaxThreads)
    fail("set_num_threads: the thread count must be from 1 to ", std::to_string(kMaxThreads), ", got ",
         std::to_string(n));
  pool().resize(n);
}

int64_t parallel_chunks(int64_t n, int64_t item_work) { return split(n, item_work, num_threads()).count; }

void parallel_for(int64_t n, int64_t item_work, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  pool().run(n, item_work, fn);
}

int64_t parallel_jobs() { return pool().jobs(); }

}  // namespace lily
