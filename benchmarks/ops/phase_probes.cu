// Probes of what a decode layer in fewer phases would pay (docs/perf-log.md P5: a 4K
// decode step is ~250 dependent kernels at 5-9 µs each; 600 tok/s needs fewer). Read the
// "warm" column and take differences:
//   grid barrier, n per kernel      (t(9) - t(1)) / 8: one barrier of a persistent layer kernel
//                                   (all 2-per-SM blocks resident, generation counter)
//   cluster exchange, n per kernel  (t(9) - t(1)) / 8: 8 blocks of a thread-block cluster
//                                   publish 257 floats in shared memory and each gathers all
//                                   of them through distributed shared memory (two cluster barriers)
//   router per cluster              the router (257 x 2048, 8-bit) + top-8 computed by each
//                                   cluster of 8 blocks for itself, the logits exchanged as
//                                   above: what a gate/up kernel would add to own its routing,
//                                   against the router kernel's own phase (decode_ops.cu)
#include <cooperative_groups.h>

#include "bench.h"
#include "device_common.cuh"
#include "gemv_core.cuh"
#include "grid_barrier.cuh"
#include "moe_topk.cuh"
#include "shapes.h"

namespace lily::bench {
namespace {

using namespace lily::cuda;
namespace cg = cooperative_groups;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kCluster = 8;
constexpr int kRouterRows = kE + 1;  // the experts' logits and the shared expert's gate

// Two blocks per multiprocessor, as the decode GEMVs, in whole clusters.
int probe_grid() { return 2 * sm_count() / kCluster * kCluster; }

template <int N>
__global__ void __launch_bounds__(kThreads) barrier_kernel(unsigned* sync, float* sink) {
  GridBarrier bar{sync};
  pdl_wait();
  for (int i = 0; i < N; ++i) {
    bar.arrive();
    bar.wait();
  }
  if (threadIdx.x == 0) sink[blockIdx.x] += 1.0f;
  pdl_trigger();
}

// Row r of a 257-float vector is published by cluster rank (r / kWarps) % kCluster: the
// rank whose warp computed it in cluster_router_kernel (rows strided over 8 x 8 warps).
__device__ __forceinline__ int owner(int r) { return (r / kWarps) % kCluster; }

// Each rank's rows of v in every block: its own in place, the others' read from their
// shared memory. Two cluster barriers: all published before any read, all read before
// any block moves on (and before any exits, which would free its shared memory).
__device__ __forceinline__ void gather_rows(cg::cluster_group& cluster, float* v, int n) {
  const int rank = static_cast<int>(cluster.block_rank());
  cluster.sync();
  for (int r = threadIdx.x; r < n; r += blockDim.x)
    if (owner(r) != rank) v[r] = cluster.map_shared_rank(v, owner(r))[r];
  cluster.sync();
}

template <int N>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads) cluster_exchange_kernel(float* sink) {
  __shared__ float v[kRouterRows];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  pdl_wait();
  float acc = 0.0f;
  for (int i = 0; i < N; ++i) {
    for (int r = threadIdx.x; r < kRouterRows; r += blockDim.x)
      if (owner(r) == rank) v[r] = static_cast<float>(r + i);
    gather_rows(cluster, v, kRouterRows);
    acc += v[(threadIdx.x + i) % kRouterRows];
  }
  if (threadIdx.x == 0) sink[blockIdx.x] = acc;
  pdl_trigger();
}

// Every cluster computes the router for itself: rank b's warp w takes rows 8b + w, + 64,
// ... (8-bit GEMV on the RMS-normed x), the ranks exchange their rows, then every block
// chooses the top-8 (as a fused gate/up kernel's blocks would, before their expert rows).
template <int U>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads)
    cluster_router_kernel(QMat W, XSpec X, int k, int* ids, float* weights, float* shared_gate) {
  extern __shared__ float4 smem[];
  float4* xs = smem;
  float* xsum = reinterpret_cast<float*>(xs + W.cols / 4);
  float* scratch = xsum + W.cols / cols_per_chunk<8>();
  __shared__ float logits[kRouterRows], p[kRouterRows];
  __shared__ int s_ids[kWarps * 4];
  __shared__ float s_w[kWarps * 4 + 1];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto W_of = [&](int) -> const QMat& { return W; };
  auto rows_of = [&](int g, int (&row)[1]) { row[0] = g; };
  RowWalk<8, 1, U> walk(rank * kWarps + warp, kCluster * kWarps, W.rows, W.chunks());
  walk.prefetch(W_of, rows_of, lane);
  pdl_wait();
  stage_x<8>(X, W.cols, xs, xsum, scratch);
  walk.run(W_of, rows_of, xs, xsum, lane, [&](int g, const float (&acc)[1]) {
    if (lane == 0) logits[g] = acc[0];
  });
  gather_rows(cluster, logits, W.rows);
  if (warp == 0)
    route_topk([&](int e) { return logits[e]; }, W.rows - 1, k, true, p, s_ids, s_w, s_w + k);
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x <= k) {  // one copy out, so the work is not dead code
    if (threadIdx.x < k) {
      ids[threadIdx.x] = s_ids[threadIdx.x];
      weights[threadIdx.x] = s_w[threadIdx.x];
    } else {
      *shared_gate = s_w[k];
    }
  }
  pdl_trigger();
}

}  // namespace

void add_phase_probe_ops(std::vector<Op>& ops) {
  const std::string grid = std::to_string(kThreads) + " threads x 2 per SM";
  auto barriers = [&](int n, auto kernel) {
    ops.push_back({"probe: grid barrier, " + std::to_string(n) + " per kernel", grid, 0, 0, [=](Arena& A) -> Launch {
                     unsigned* sync = A.zeros<unsigned>(2);
                     float* sink = A.zeros<float>(probe_grid());
                     return [=](cudaStream_t s) {
                       launch("probe barrier", kernel, dim3(probe_grid()), dim3(kThreads), 0, s, sync, sink);
                     };
                   }});
  };
  barriers(1, barrier_kernel<1>);
  barriers(9, barrier_kernel<9>);
  auto exchanges = [&](int n, auto kernel) {
    ops.push_back({"probe: cluster exchange of 257 floats, " + std::to_string(n) + " per kernel",
                   grid + ", clusters of 8", 0, 0, [=](Arena& A) -> Launch {
                     float* sink = A.zeros<float>(probe_grid());
                     return [=](cudaStream_t s) {
                       launch("probe cluster", kernel, dim3(probe_grid()), dim3(kThreads), 0, s, sink);
                     };
                   }});
  };
  exchanges(1, cluster_exchange_kernel<1>);
  exchanges(9, cluster_exchange_kernel<9>);
  ops.push_back({"probe: router 8-bit +rmsnorm +top-8 per cluster of 8", dims(kRouterRows, kH) + ", " + grid,
                 qbytes(kRouterRows, kH, 8) + kH * 8.0, 2.0 * kRouterRows * kH, [](Arena& A) -> Launch {
                   const XSpec X = rmsnorm_of(A, A.normal(kH));
                   const QMat W = A.qmat(kRouterRows, kH, 8, false);
                   int* ids = A.zeros<int>(kTopK);
                   float* weights = A.zeros<float>(kTopK + 1);
                   const size_t smem = stage_bytes<8>(kH);
                   // 2048 8-bit columns = 128 chunks of 16 bytes: U = 4 chunks per lane.
                   return [=](cudaStream_t s) {
                     launch("probe cluster router", cluster_router_kernel<4>, dim3(probe_grid()), dim3(kThreads), smem,
                            s, W, X, kTopK, ids, weights, weights + kTopK);
                   };
                 }});
}

}  // namespace lily::bench
