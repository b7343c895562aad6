// Expert choice of one token by every block of a thread-block cluster, inside a kernel
// that needs it (moe_routed_gate_up) instead of a phase of its own (moe_router.cu):
// the kClusterBlocks blocks of a cluster split the router rows, publish their logits in
// shared memory, gather each other's through distributed shared memory, and every block
// takes the top-k. Each row is dotted by one warp in the lane order of moe_router.cu and
// route_topk is the same, so the choice is bit for bit the router kernel's.
//
//   ClusterRoute<U> route(R);      rows of this block's warps: (warps b + w) + 8 warps j
//   route.prefetch(R, lane);       first weight tile (weights are constant: before the PDL wait)
//   pdl_wait(); ...
//   route.run(R, X, k, norm_topk, smem, ids, w);   ids[k], w[k] and w[k] = shared gate, in
//                                                  shared memory, for every block
#pragma once
#include <cooperative_groups.h>

#include <algorithm>

#include "cuda_check.h"
#include "gemv_core.cuh"
#include "moe_topk.cuh"

namespace lily::cuda {

constexpr int kClusterBlocks = 8;  // the portable cluster size

// Shared memory of ClusterRoute::run for a router [E + 1, H]: x staged for the 8-bit
// rows, then the E + 1 logits and E floats of top-k scratch.
__host__ __device__ constexpr size_t cluster_route_bytes(int H, int E) {
  return stage_bytes<8>(H) + static_cast<size_t>(2 * E + 1) * 4;
}

// Blocks for a grid of `wanted` blocks of `kernel` (compiled with kClusterBlocks-block
// clusters): whole clusters, no more than can run at once. A cluster runs inside one GPC,
// so e.g. 264 blocks at 2 per SM need not all fit as 33 clusters of 8; a 33rd cluster
// would run alone after the others.
inline int cluster_grid(const void* kernel, int wanted, int threads, size_t smem, const char* op) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kClusterBlocks);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  int clusters = 0;
  check(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg), op);
  return kClusterBlocks * std::max(1, std::min(wanted / kClusterBlocks, clusters));
}

// v[0..n) in every block of the cluster, where block owner(r) wrote v[r] into its own
// shared copy: each block fetches the rows it lacks. Two cluster barriers: every row
// published before any is read, every read done before a block moves on (or exits,
// which would release the shared memory others read).
template <class Owner>
__device__ __forceinline__ void cluster_gather(float* v, int n, Owner owner) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  cluster.sync();
  for (int r = threadIdx.x; r < n; r += blockDim.x)
    if (owner(r) != rank) v[r] = cluster.map_shared_rank(v, owner(r))[r];
  cluster.sync();
}

template <int U>
struct ClusterRoute {
  int warps, rank;
  RowWalk<8, 1, U> walk;

  __device__ explicit ClusterRoute(const QMat& R)
      : warps(blockDim.x / 32),
        rank(static_cast<int>(cooperative_groups::this_cluster().block_rank())),
        walk(rank * warps + (threadIdx.x >> 5), kClusterBlocks * warps, R.rows, R.chunks()) {}

  __device__ __forceinline__ void prefetch(const QMat& R, int lane) {
    walk.prefetch([&](int) -> const QMat& { return R; }, [](int g, int (&row)[1]) { row[0] = g; }, lane);
  }

  // smem: cluster_route_bytes(R.cols, R.rows - 1) bytes, 16-byte aligned.
  __device__ void run(const QMat& R, const XSpec& X, int k, bool norm_topk, unsigned char* smem, int* ids, float* w) {
    const int lane = threadIdx.x & 31, E = R.rows - 1;
    float4* xs = reinterpret_cast<float4*>(smem);
    float* xsum = reinterpret_cast<float*>(xs + R.cols / 4);
    float* logits = reinterpret_cast<float*>(smem + stage_bytes<8>(R.cols));
    stage_x<8>(X, R.cols, xs, xsum, xsum + R.cols / cols_per_chunk<8>());
    walk.run([&](int) -> const QMat& { return R; }, [](int g, int (&row)[1]) { row[0] = g; }, xs, xsum, lane,
             [&](int g, const float (&acc)[1]) {
               if (lane == 0) logits[g] = acc[0];
             });
    const int per_rank = warps;
    cluster_gather(logits, R.rows, [per_rank](int r) { return (r / per_rank) % kClusterBlocks; });
    if (threadIdx.x < 32)
      route_topk([&](int e) { return logits[e]; }, E, k, norm_topk, logits + R.rows, ids, w, w + k);
    __syncthreads();
  }
};

}  // namespace lily::cuda
