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
//   MoE expert slots in clusters    the one-cluster-per-slot expert kernel of perf-log 8 (gate/up,
//                                   activations through L2 inside the cluster, down into a
//                                   partial row per slot), against "moe experts: gate_up, down
//                                   (2 launches)" of the decode entries
#include <cooperative_groups.h>

#include "bench.h"
#include "device_common.cuh"
#include "grid_barrier.cuh"
#include "moe_experts.h"
#include "qmma.cuh"
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

// Slot j = blockIdx.y (the last: the shared expert) of one token's MoE block, by one
// cluster of C blocks: gate/up row blocks (8 gate + 8 up rows each) rank, rank + C, ...;
// the activations through L2, made visible to the cluster by its barrier; then one
// 16-row down block per warp, written as w_j * down_j(act_j) to partial[j]. A prototype
// for timing: the residual sum over the slots is left to the next kernel.
template <int GPW, int GD>  // gate/up groups per warp (H/64/8), down groups (I/64)
__global__ void __launch_bounds__(kThreads, 2)
    moe_slots_kernel(MoeExperts m, XSpec X, const int* ids, const float* weights, float* act, float* partial) {
  extern __shared__ uint4 smem_u4[];
  __shared__ float red[2][kWarps][16];
  const cg::cluster_group cluster = cg::this_cluster();
  const int C = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const int H = m.gate_up.cols, G = H / 64, I = m.inter, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j = blockIdx.y, k = gridDim.y - 1;
  const bool shared = j == k;
  const auto [xf, xsum, raw] = mma_stage(smem_u4, H);
  stage_x_mma(X, H, xf, xsum, raw, raw + H);  // h comes from two launches back, as for moe_gate_up
  pdl_wait();
  const int e = shared ? 0 : __ldcg(ids + j);
  const float wj = __ldcg(weights + j);  // routing weight; the shared expert's sigmoid gate last
  const QMat& GU = shared ? m.shared_gate_up : m.gate_up;
  const QMat& DN = shared ? m.shared_down : m.down;
  const int rbe = 2 * I / 16, n_down = H / 16, gu0 = e * rbe, dn0 = e * n_down;
  for (int rb = rank * kWarps + warp; rb < n_down; rb += C * kWarps)  // this warp's down tiles, into L2
    for (int g = 0; g < GD; ++g)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(DN.codes + (static_cast<size_t>(dn0 + rb) * GD + g) * 32 + lane));

  int rb = rank;
  MmaTiles<GPW> next;
  if (rb < rbe) next.load(GU, gu0 + rb, warp * GPW, G, lane);
  for (int it = 0; rb < rbe; rb += C, ++it) {
    const MmaTiles<GPW> cur = next;
    if (rb + C < rbe) next.load(GU, gu0 + rb + C, warp * GPW, G, lane);
    float y0 = 0.0f, y1 = 0.0f;
    cur.accumulate(warp * GPW, G, warp * GPW, xf, xsum, lane, y0, y1);
    put_rows16(red[it & 1], y0, y1);
    __syncthreads();
    if (threadIdx.x < 8) {
      const float g = row_total(red[it & 1], threadIdx.x), u = row_total(red[it & 1], threadIdx.x + 8);
      act[j * I + 8 * rb + threadIdx.x] = siluf_(g) * u;
    }
  }
  cluster.sync();

  XSpec A;
  A.x = act + j * I;
  const auto [af, asum, araw] = mma_stage(smem_u4, I);
  stage_x_mma(A, I, af, asum, araw, araw + I);
  for (int drb = rank * kWarps + warp; drb < n_down; drb += C * kWarps) {
    MmaTiles<GD> t;
    t.load(DN, dn0 + drb, 0, GD, lane);
    float y0 = 0.0f, y1 = 0.0f;
    t.accumulate(0, GD, 0, af, asum, lane, y0, y1);
    if ((lane & 3) == 0) {
      partial[j * H + drb * 16 + lane / 4] = wj * y0;
      partial[j * H + drb * 16 + lane / 4 + 8] = wj * y1;
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

  static_assert(kI == kIs && kH / 64 / kWarps == 4 && kI / 64 == 8, "moe_slots_kernel<4, 8> is built for these widths");
  ops.push_back({"probe: MoE expert slots in clusters (1 launch, partial rows)", "9 x 16 blocks, I 512",
                 static_cast<double>(moe_bytes) + (kTopK + 1) * (kI + kH) * 4.0, 2.0 * (kTopK + 1) * 3 * kI * kH,
                 [](Arena& A) -> Launch {
                   MoeExperts m{A.qmat(kE * 2 * kI, kH, 4, true), A.qmat(kE * kH, kI, 4, true), A.qmat(2 * kIs, kH, 4, true),
                                A.qmat(kH, kIs, 4, true), kE, kI, kIs};
                   const XSpec X = rmsnorm_of(A, A.normal(kH));
                   const int* ids = A.upload(std::vector<int>{7, 38, 71, 104, 137, 170, 203, 236});
                   const float* w = A.upload(std::vector<float>{0.24f, 0.18f, 0.14f, 0.12f, 0.10f, 0.08f, 0.08f, 0.06f, 0.4f});
                   float* act = A.normal((kTopK + 1) * kI);
                   float* partial = A.normal((kTopK + 1) * kH);
                   auto kernel = moe_slots_kernel<4, 8>;
                   const size_t smem = stage_mma_bytes(kH);
                   const int cluster = max_cluster_size(reinterpret_cast<const void*>(kernel), kThreads, smem, 16, "probe moe slots");
                   return [=](cudaStream_t s) {
                     launch_clustered("probe moe slots", cluster, kernel, dim3(cluster, kTopK + 1), dim3(kThreads), smem, s, m,
                                      X, ids, w, act, partial);
                   };
                 }});
}

}  // namespace lily::bench
