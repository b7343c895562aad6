// Probes of what a decode layer in fewer phases would pay (docs/perf-log.md P5: a 4K
// decode step is ~250 dependent kernels at 5-9 µs each; 600 tok/s needs fewer). Read the
// "warm" column and take differences:
//   grid barrier, n per kernel      (t(9) - t(1)) / 8: one barrier of a persistent layer kernel
//                                   (all 2-per-SM blocks resident, generation counter)
//   cluster exchange, n per kernel  (t(9) - t(1)) / 8: 8 blocks of a thread-block cluster
//                                   publish 257 floats in shared memory and each gathers all
//                                   of them through distributed shared memory (two cluster barriers)
//   stream 16 MB, ...               GB/s of one layer's expert weights (8 routed + shared,
//                                   gate/up + down) read by the whole GPU, and by 9 clusters
//                                   of 16 blocks (one per MoE slot: as many SMs as they get)
//   router hand-off, released by ...  µs / 10: a router-like kernel (16 blocks that trigger
//                                   at once, then block 0 alone works ~1 µs and writes 8 ids,
//                                   as the router's top-8 tail) and a gate/up-like consumer
//                                   (264 blocks that read the ids); the consumer waits for the
//                                   router's completion (griddepcontrol.wait) or polls a flag
//                                   block 0 sets right after the ids
#include <cooperative_groups.h>

#include "bench.h"
#include "common/device_common.cuh"
#include "common/grid_barrier.cuh"
#include "shapes.h"

namespace lily::bench {
namespace {

using namespace lily::cuda;
namespace cg = cooperative_groups;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kCluster = 8;  // the portable cluster size
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

// Row r of the 257 floats is published by rank (r / kWarps) % kCluster: rows strided over
// the cluster's 8 x 8 warps, as a router computed per cluster would spread them.
__device__ __forceinline__ int owner(int r) { return (r / kWarps) % kCluster; }

// v[0..n) in every block of the cluster, where block owner(r) wrote v[r] into its own
// shared copy: each block fetches the rows it lacks. Two cluster barriers: every row
// published before any is read, every read done before a block moves on (or exits,
// which would release the shared memory others read).
__device__ __forceinline__ void cluster_gather(float* v, int n) {
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  cluster.sync();
  for (int r = threadIdx.x; r < n; r += blockDim.x)
    if (owner(r) != rank) v[r] = cluster.map_shared_rank(v, owner(r))[r];
  cluster.sync();
}

template <int N>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads) cluster_exchange_kernel(float* sink) {
  __shared__ float v[kRouterRows];
  const int rank = static_cast<int>(cg::this_cluster().block_rank());
  pdl_wait();
  float acc = 0.0f;
  for (int i = 0; i < N; ++i) {
    for (int r = threadIdx.x; r < kRouterRows; r += blockDim.x)
      if (owner(r) == rank) v[r] = static_cast<float>(r + i);
    cluster_gather(v, kRouterRows);
    acc += v[(threadIdx.x + i) % kRouterRows];
    __syncthreads();  // before the next round overwrites this block's rows
  }
  if (threadIdx.x == 0) sink[blockIdx.x] = acc;
  pdl_trigger();
}

// Streams bytes [blockIdx.x * per, +per) of w (16-byte loads, 8 in flight per thread).
__global__ void __launch_bounds__(kThreads) stream_kernel(const uint4* w, size_t per, float* sink) {
  pdl_wait();
  const uint4* p = w + blockIdx.x * per;
  uint32_t acc = 0;
  for (size_t i = threadIdx.x; i < per; i += 8 * kThreads) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = i + j * kThreads < per ? load_stream(p + i + j * kThreads) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = 1.0f;  // keeps the loads
  pdl_trigger();
}

// The hand-off pairs: pair j's route_kernel sets flag[j % 2] (release) after its ids and
// zeroes flag[(j + 1) % 2], which the previous pair's consumers have all polled (they
// trigger only after their poll, and this kernel starts only after they trigger); its
// take_kernel polls flag[j % 2] (acquire). kPairs is even: every launch leaves the flags
// as the next one expects them.
constexpr int kPairs = 10, kRouteBlocks = 16;

__global__ void __launch_bounds__(kThreads) route_kernel(int* ids, unsigned* flag, unsigned* stale, float* sink) {
  pdl_wait();
  pdl_trigger();  // as the router: the consumer's blocks may start during the tail below
  if (blockIdx.x != 0 || threadIdx.x >= 32) return;
  float v = static_cast<float>(threadIdx.x) + sink[0];
  for (int round = 0; round < 8; ++round) v = warp_sum(warp_max(v) - v) * 0.5f;  // a top-8's rounds of reductions
  if (threadIdx.x != 0) return;
  // v is the warp's (reductions broadcast it): one thread writes the ids, so the release
  // below orders them before the flag without a fence.
  for (int i = 0; i < 8; ++i) ids[i] = static_cast<int>(v) + i;
  if (flag) {
    st_relaxed(stale, 0u);
    st_release(flag, 1u);
  }
}

__global__ void __launch_bounds__(kThreads) take_kernel(const int* ids, const unsigned* flag, float* sink) {
  if (flag) {
    if (threadIdx.x == 0)
      while (ld_acquire(flag) == 0u) {
      }
    __syncthreads();
  } else {
    pdl_wait();
  }
  if (threadIdx.x < 8) sink[blockIdx.x * 8 + threadIdx.x] = static_cast<float>(__ldcg(ids + threadIdx.x));
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

  // One MoE layer's expert weights at 35B-A3B widths: 9 x (gate/up 2I x H + down H x I), 4-bit.
  const size_t moe_bytes = 9 * (3 * static_cast<size_t>(kI) * kH / 2 + 3 * static_cast<size_t>(kI) * kH / 64 * 4);
  auto streams = [&](const std::string& name, bool clustered) {
    ops.push_back({"probe: stream " + name, std::to_string(moe_bytes >> 20) + " MB", static_cast<double>(moe_bytes), 0,
                   [=](Arena& A) -> Launch {
                     const uint4* w = reinterpret_cast<const uint4*>(A.normal(moe_bytes / 4));
                     const int cluster = clustered ? max_cluster_size(reinterpret_cast<const void*>(stream_kernel), kThreads,
                                                                      0, 16, "probe stream")
                                                   : 1;
                     const int blocks = clustered ? 9 * cluster : probe_grid();
                     float* sink = A.zeros<float>(blocks);
                     const size_t per = moe_bytes / 16 / blocks;
                     return [=](cudaStream_t s) {
                       launch_clustered("probe stream", cluster, stream_kernel, dim3(blocks), dim3(kThreads), 0, s, w, per, sink);
                     };
                   }});
  };
  streams("by the whole GPU (2 blocks per SM)", false);
  streams("by 9 clusters of 16 blocks", true);

  for (bool polled : {false, true}) {
    ops.push_back({std::string("probe: router hand-off, released by ") + (polled ? "a flag" : "griddepcontrol.wait"),
                   std::to_string(kPairs) + " x (16 + 2 per SM blocks)", 0, 0,
                   [=](Arena& A) -> Launch {
                     int* ids = A.zeros<int>(8);
                     unsigned* flags = A.zeros<unsigned>(2);
                     const int grid = 2 * sm_count();
                     float* sink = A.zeros<float>(grid * 8);
                     return [=](cudaStream_t s) {
                       for (int j = 0; j < kPairs; ++j) {
                         unsigned* flag = polled ? flags + j % 2 : nullptr;
                         launch("probe route", route_kernel, dim3(kRouteBlocks), dim3(kThreads), 0, s, ids, flag,
                                flags + (j + 1) % 2, sink);
                         launch("probe take", take_kernel, dim3(grid), dim3(kThreads), 0, s, ids,
                                static_cast<const unsigned*>(flag), sink);
                       }
                     };
                   }});
  }
}

}  // namespace lily::bench
