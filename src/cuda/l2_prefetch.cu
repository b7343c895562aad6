#include "l2_prefetch.h"

#include <algorithm>

#include "device_common.cuh"
#include "env.h"

namespace lily::cuda {
namespace {

constexpr size_t kPiece = 64 * 1024;  // bytes per prefetch instruction
constexpr int kThreads = 64;

// [p, p + bytes) shrunk to 16-byte boundaries (the instruction's rule; edges are skipped).
__device__ __forceinline__ void prefetch_pieces(const void* p, size_t bytes, int& piece, int tid, int n_threads) {
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~uintptr_t(15);
  for (uintptr_t q = a; q < e; q += kPiece, ++piece) {
    if (piece % n_threads != tid) continue;
    const uint32_t n = static_cast<uint32_t>(e - q < kPiece ? e - q : kPiece);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(q), "r"(n) : "memory");
  }
}

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(L2Prefetch L) {
  const int tid = blockIdx.x * blockDim.x + threadIdx.x, n = gridDim.x * blockDim.x;
  int piece = 0;  // pieces are dealt round-robin over the threads, in list order
  for (int s = 0; s < L.n_span; ++s) prefetch_pieces(L.span[s].p, L.span[s].bytes, piece, tid, n);
  for (int i = 0; i < L.k; ++i) {
    const int id = __ldcg(L.ids + i);
    for (int j = 0; j < L.n_expert; ++j)
      prefetch_pieces(static_cast<const char*>(L.expert[j].p) + id * L.expert_stride[j], L.expert[j].bytes, piece, tid, n);
  }
  if (L.n_cache) {
    const size_t len = static_cast<size_t>(max(__ldcg(L.pos), 0));
    for (int j = 0; j < L.n_cache; ++j) {
      const size_t bytes = len * L.cache[j].bytes;
      prefetch_pieces(L.cache[j].p, bytes < L.cache_cap ? bytes : L.cache_cap, piece, tid, n);
    }
  }
}

// Bytes of codes and of scales|biases of rows [0, rows) of W (rows a multiple of 16 when tiled).
std::pair<size_t, size_t> qmat_bytes(const QMat& W, int rows) {
  if (W.tiled) {
    const size_t tiles = static_cast<size_t>(rows / 16) * (W.cols / 64);
    return {tiles * 512, tiles * 64};
  }
  return {static_cast<size_t>(rows) * W.chunks() * 16, static_cast<size_t>(rows) * W.groups() * 4};
}

}  // namespace

void L2Prefetch::add(const void* p, size_t bytes) {
  if (!p || !bytes) return;
  if (n_span == kMaxSpans) fail("l2_prefetch: more than ", std::to_string(kMaxSpans), " spans");
  span[n_span++] = {p, bytes};
}

void L2Prefetch::add(const QMat& W) {
  const auto [codes, sb] = qmat_bytes(W, W.tiled ? (W.rows + 15) / 16 * 16 : W.rows);
  add(W.codes, codes);
  add(W.sb, sb);
}

void L2Prefetch::add_experts(const QMat& W, int rows_per_expert, const int* ids_, int k_) {
  if (W.tiled && rows_per_expert % 16) fail("l2_prefetch: tiled expert rows must be a multiple of 16");
  if (n_expert + 2 > 4) fail("l2_prefetch: more than 2 expert matrices");
  if (ids && ids != ids_) fail("l2_prefetch: expert matrices must share their ids");
  ids = ids_;
  k = k_;
  const auto [codes, sb] = qmat_bytes(W, rows_per_expert);
  expert[n_expert] = {W.codes, codes};
  expert_stride[n_expert++] = codes;
  expert[n_expert] = {W.sb, sb};
  expert_stride[n_expert++] = sb;
}

void L2Prefetch::add_cache(const void* p, size_t bytes_per_pos, const int* pos_, size_t cap) {
  if (n_cache == 2) fail("l2_prefetch: more than 2 caches");
  pos = pos_;
  cache_cap = cap;
  cache[n_cache++] = {p, bytes_per_pos};
}

void l2_prefetch(const L2Prefetch& list, cudaStream_t stream) {
  if (list.empty()) return;
  static const int blocks = env_int("LILY_CUDA_L2_PREFETCH_BLOCKS", 8, 1, 1024);
  l2_prefetch_kernel<<<blocks, kThreads, 0, stream>>>(list);
  check(cudaGetLastError(), "l2_prefetch");
}

PrefetchBranch::PrefetchBranch() : enabled_(env_flag("LILY_CUDA_L2_PREFETCH", true)) {
  if (!enabled_) return;
  check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "l2_prefetch: cudaStreamCreate");
  check(cudaEventCreateWithFlags(&joined_, cudaEventDisableTiming), "l2_prefetch: cudaEventCreate");
}

PrefetchBranch::~PrefetchBranch() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (joined_) cudaEventDestroy(joined_);
  if (side_) cudaStreamDestroy(side_);
}

cudaEvent_t PrefetchBranch::next_event() {
  if (used_ == events_.size()) {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "l2_prefetch: cudaEventCreate");
    events_.push_back(e);
  }
  return events_[used_++];
}

void PrefetchBranch::fork(cudaStream_t main, const L2Prefetch& list) {
  if (!enabled_ || list.empty()) return;
  cudaEvent_t e = next_event();
  check(cudaEventRecord(e, main), "l2_prefetch: fork (record)");
  check(cudaStreamWaitEvent(side_, e, 0), "l2_prefetch: fork (wait)");
  l2_prefetch(list, side_);
  open_ = true;
}

void PrefetchBranch::join(cudaStream_t main) {
  used_ = 0;
  if (!open_) return;
  check(cudaEventRecord(joined_, side_), "l2_prefetch: join (record)");
  check(cudaStreamWaitEvent(main, joined_, 0), "l2_prefetch: join (wait)");
  open_ = false;
}

}  // namespace lily::cuda
