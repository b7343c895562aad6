// Probes of what a decode layer in fewer phases would pay (docs/perf-log.md P5: a 4K
// decode step is ~250 dependent kernels at 5-9 µs each; 600 tok/s needs fewer). Read the
// "warm" column and take differences:
//   grid barrier, n per kernel      (t(9) - t(1)) / 8: one barrier of a persistent layer kernel
//                                   (all 2-per-SM blocks resident, generation counter)
//   cluster exchange, n per kernel  (t(9) - t(1)) / 8: 8 blocks of a thread-block cluster
//                                   publish 257 floats in shared memory and each gathers all
//                                   of them through distributed shared memory (two cluster barriers)
//   router per cluster              the router (257 x 2048, 8-bit) + top-8 computed by each
//                                   cluster of 8 blocks for itself (ClusterRoute, the routing
//                                   half of moe_routed_gate_up): what the gate/up kernel adds
//                                   to own its routing, against the router's own phase (decode_ops.cu)
#include <cooperative_groups.h>

#include "bench.h"
#include "device_common.cuh"
#include "grid_barrier.cuh"
#include "moe_cluster_route.cuh"
#include "shapes.h"

namespace lily::bench {
namespace {

using namespace lily::cuda;
namespace cg = cooperative_groups;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kCluster = kClusterBlocks;
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

// Row r of the 257 floats is published by rank (r / kWarps) % kCluster, as ClusterRoute
// spreads the router rows.
__device__ __forceinline__ int owner(int r) { return (r / kWarps) % kCluster; }

template <int N>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads) cluster_exchange_kernel(float* sink) {
  __shared__ float v[kRouterRows];
  const int rank = static_cast<int>(cg::this_cluster().block_rank());
  pdl_wait();
  float acc = 0.0f;
  for (int i = 0; i < N; ++i) {
    for (int r = threadIdx.x; r < kRouterRows; r += blockDim.x)
      if (owner(r) == rank) v[r] = static_cast<float>(r + i);
    cluster_gather(v, kRouterRows, owner);
    acc += v[(threadIdx.x + i) % kRouterRows];
    __syncthreads();  // before the next round overwrites this block's rows
  }
  if (threadIdx.x == 0) sink[blockIdx.x] = acc;
  pdl_trigger();
}

// The routing half of moe_routed_gate_up alone: every cluster computes the router and the
// top-8 for itself (ClusterRoute), block 0 writes the choice out.
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads)
    cluster_router_kernel(QMat R, XSpec X, int k, int* ids, float* weights) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_ids[16];
  __shared__ float s_w[17];
  ClusterRoute<4> route(R);
  route.prefetch(R, threadIdx.x & 31);
  pdl_wait();
  route.run(R, X, k, true, smem, s_ids, s_w);
  if (blockIdx.x == 0 && threadIdx.x <= k) {
    if (threadIdx.x < k) ids[threadIdx.x] = s_ids[threadIdx.x];
    weights[threadIdx.x] = s_w[threadIdx.x];  // [k]: the shared expert's gate
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
                   const size_t smem = cluster_route_bytes(kH, kE);
                   const int grid = cluster_grid(reinterpret_cast<const void*>(cluster_router_kernel), probe_grid(),
                                                 kThreads, smem, "probe cluster router: occupancy");
                   return [=](cudaStream_t s) {
                     launch("probe cluster router", cluster_router_kernel, dim3(grid), dim3(kThreads), smem, s, W, X,
                            kTopK, ids, weights);
                   };
                 }});
}

}  // namespace lily::bench
