// Top-k routing and the counting sort of the prefill MoE block (after the router GEMM).
//
// topk_kernel: one warp per token, lane l holding experts l + 32i. The S partial logits
//   are added in slice order; p_e = exp(l_e - max) (fp32, softmax numerator); the k
//   largest logits are picked one per round by a warp argmax on (logit, -id), i.e. equal
//   logits give the lower id first (exp is monotone, so this is the top-k of p). Weights:
//   p / sum of the k chosen p (norm_topk) or p / sum of all p. Expert counts go to a
//   shared histogram, then one atomic per expert and block. The last block to finish
//   scans the counts into row offsets and writes the tile list.
// scatter_kernel: one thread per slot s = t * k + j; a warp reserves the rows of each
//   expert it holds with one atomic on that expert's cursor.
#include <algorithm>
#include <cfloat>
#include <climits>

#include "common/device_common.cuh"
#include "moe/moe_route_prefill.h"
#include "moe/moe_topk.cuh"

namespace lily::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTokensPerBlock = 4 * kWarps;
static_assert(kMoeMaxExperts <= 2 * kThreads, "the scan gives each thread two experts");

// Routes token t (one warp). EPL: experts per lane, E <= 32 * EPL.
template <int EPL>
__device__ __forceinline__ void route_token(const MoeRouteArgs& a, int S, int t, int* hist) {
  const int lane = threadIdx.x & 31, E = a.E;
  const float* part = a.partials + static_cast<size_t>(t) * E;
  const size_t slice = static_cast<size_t>(a.T) * E;
  float l[EPL];
  float mx = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    float v = 0.0f;
    if (e < E) {
      for (int s = 0; s < S; ++s) v += __ldcg(part + s * slice + e);
      if (a.logits) a.logits[static_cast<size_t>(t) * E + e] = v;
      mx = fmaxf(mx, v);
    }
    l[i] = v;
  }
  mx = warp_max(mx);
  float z = 0.0f;
#pragma unroll
  for (int i = 0; i < EPL; ++i)
    if (lane + 32 * i < E) z += __expf(l[i] - mx);
  z = warp_sum(z);

  // k rounds of argmax over the untaken experts. NaN logits compare as -inf so every
  // lane agrees on the winner and the id stays a valid expert.
  unsigned taken = 0u;
  int my_id = 0;
  float my_l = 0.0f, top_sum = 0.0f;
  for (int j = 0; j < a.k; ++j) {
    float v = -INFINITY;
    int id = INT_MAX;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int e = lane + 32 * i;
      const float li = fmaxf(l[i], -INFINITY);
      if (e < E && !((taken >> i) & 1u) && (id == INT_MAX || li > v)) {
        v = li;
        id = e;
      }
    }
    warp_argmax(v, id);
    if (lane == (id & 31)) taken |= 1u << (id >> 5);
    if (lane == j) {
      my_id = id;
      my_l = v;
    }
    top_sum += __expf(v - mx);
  }
  if (lane < a.k) {
    const size_t s = static_cast<size_t>(t) * a.k + lane;
    a.expert_ids[s] = my_id;
    a.route_w[s] = __expf(my_l - mx) / (a.norm_topk ? top_sum : z);
    atomicAdd(hist + my_id, 1);
  }
  if (lane == 0) {
    const float* gpart = a.partials + static_cast<size_t>(S) * slice;
    float g = 0.0f;
    for (int s = 0; s < S; ++s) g += __ldcg(gpart + static_cast<size_t>(s) * a.T + t);
    a.shared_logit[t] = g;
  }
}

// Last block: offsets and cursors from the counts, then the tile list. Expert e has
// ceil(count / tile_m) tiles; tile i belongs to the expert whose tile range holds i.
__device__ void scan_and_tile(const MoeRouteArgs& a) {
  __shared__ int row_base[kMoeMaxExperts + 1], tile_base[kMoeMaxExperts + 1];
  __shared__ int warp_rows[kWarps], warp_tiles[kWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, E = a.E, bm = a.tile_m;
  const int e0 = 2 * tid, e1 = e0 + 1;
  const int c0 = e0 < E ? __ldcg(a.counts + e0) : 0, c1 = e1 < E ? __ldcg(a.counts + e1) : 0;
  const int n0 = (c0 + bm - 1) / bm, n1 = (c1 + bm - 1) / bm;
  int rows = c0 + c1, tiles = n0 + n1;  // inclusive scan over the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int r = __shfl_up_sync(0xffffffffu, rows, o), n = __shfl_up_sync(0xffffffffu, tiles, o);
    if (lane >= o) {
      rows += r;
      tiles += n;
    }
  }
  if (lane == 31) {
    warp_rows[warp] = rows;
    warp_tiles[warp] = tiles;
  }
  __syncthreads();
  for (int w = 0; w < warp; ++w) {
    rows += warp_rows[w];
    tiles += warp_tiles[w];
  }
  // rows / tiles: inclusive through expert e1 (the last thread: the totals).
  if (e0 < E) {
    row_base[e0] = rows - c0 - c1;
    tile_base[e0] = tiles - n0 - n1;
  }
  if (e1 < E) {
    row_base[e1] = rows - c1;
    tile_base[e1] = tiles - n1;
  }
  if (tid == kThreads - 1) {
    row_base[E] = rows;
    tile_base[E] = tiles;
  }
  __syncthreads();
  for (int e = tid; e <= E; e += kThreads) {
    a.offsets[e] = row_base[e];
    if (e < E) a.cursor[e] = row_base[e];
  }
  const int n_tiles = tile_base[E];
  if (tid == 0) *a.n_tiles = n_tiles;
  for (int i = tid; i < n_tiles; i += kThreads) {
    int lo = 0, hi = E;  // tile_base[lo] <= i < tile_base[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (tile_base[mid] <= i) lo = mid;
      else hi = mid;
    }
    const int row0 = row_base[lo] + (i - tile_base[lo]) * bm;
    a.tiles[i] = make_int4(lo, row0, min(bm, row_base[lo + 1] - row0), 0);
  }
}

// grid ceil(T / kTokensPerBlock); counts and counter were zeroed by the router GEMM.
template <int EPL>
__global__ void __launch_bounds__(kThreads, 2) topk_kernel(MoeRouteArgs a, int S) {
  __shared__ int hist[kMoeMaxExperts];
  __shared__ bool last;
  const int tid = threadIdx.x;
  for (int e = tid; e < a.E; e += kThreads) hist[e] = 0;
  __syncthreads();
  pdl_wait();
  const int t_end = min(a.T, (blockIdx.x + 1) * kTokensPerBlock);
  for (int t = blockIdx.x * kTokensPerBlock + (tid >> 5); t < t_end; t += kWarps) route_token<EPL>(a, S, t, hist);
  __syncthreads();
  for (int e = tid; e < a.E; e += kThreads)
    if (hist[e]) atomicAdd(a.counts + e, hist[e]);
  pdl_trigger();

  // The last block to finish scans (the other blocks' counts are visible after the fence).
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  scan_and_tile(a);
}

__global__ void __launch_bounds__(kThreads) scatter_kernel(const int* expert_ids, int n_slots, int k, int* cursor,
                                                           int* x_rows, int* y_rows) {
  pdl_wait();
  pdl_trigger();
  const int s = blockIdx.x * kThreads + threadIdx.x, lane = threadIdx.x & 31;
  const bool ok = s < n_slots;
  const int e = ok ? expert_ids[s] : -1;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int leader = __ffs(peers) - 1;
  int base = 0;
  if (ok && lane == leader) base = atomicAdd(cursor + e, __popc(peers));
  base = __shfl_sync(0xffffffffu, base, leader);
  if (ok) {
    const int r = base + __popc(peers & ((1u << lane) - 1u));
    x_rows[r] = s / k;
    y_rows[r] = s;
  }
}

}  // namespace

int moe_max_tiles(int rows, int tile_m, int n_experts) {
  if (rows < 0 || tile_m < 1 || n_experts < 1) fail("moe_max_tiles: need rows >= 0, tile_m >= 1, n_experts >= 1");
  return (rows + tile_m - 1) / tile_m + std::min(n_experts, rows);
}

namespace moe_route_detail {

void launch_route_sort(const MoeRouteArgs& a, int splits, cudaStream_t stream) {
  const dim3 grid((a.T + kTokensPerBlock - 1) / kTokensPerBlock);
  if (a.E <= 256) launch("moe_topk_prefill", topk_kernel<8>, grid, dim3(kThreads), 0, stream, a, splits);
  else launch("moe_topk_prefill", topk_kernel<16>, grid, dim3(kThreads), 0, stream, a, splits);
  const int n_slots = a.T * a.k;
  launch("moe_route_scatter", scatter_kernel, dim3((n_slots + kThreads - 1) / kThreads), dim3(kThreads), 0, stream,
         a.expert_ids, n_slots, a.k, a.cursor, a.x_rows, a.y_rows);
}

}  // namespace moe_route_detail

}  // namespace lily::cuda
