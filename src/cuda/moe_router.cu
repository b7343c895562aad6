#include "moe_router.h"

#include <cooperative_groups.h>

#include <algorithm>

#include "gemv_core.cuh"
#include "moe_topk.cuh"

namespace lily::cuda {
namespace {

namespace cg = cooperative_groups;

// One row per warp at E = 256 in a cluster of 16 ((E + 1) / 16 rounded up); 544 threads
// leave the row walk its ~120 registers.
constexpr int kMaxWarps = 17;

// One cluster of C blocks computes every logit: warp w of block r takes rows r*warps + w,
// then every C*warps rows after. Lane 0 stores each logit straight into block 0's shared
// memory; after one cluster barrier block 0 routes from there. (A grid of blocks would
// need a fence, a counter and an L2 re-read of the logits by the last block instead.)
// Shared memory: logits [E + 1] (block 0's routing), then the staged x.
template <int BITS, int U>
__global__ void __launch_bounds__(kMaxWarps * 32)
    router_kernel(QMat W, XSpec X, int E, int k, int norm_topk, RouterOut out, const int* halt) {
  extern __shared__ float4 smem[];
  float* logits = reinterpret_cast<float*>(smem);
  float4* xs = smem + route_smem_bytes(E) / 16;
  float* xsum = reinterpret_cast<float*>(xs + W.cols / 4);
  float* scratch = xsum + W.cols / cols_per_chunk<BITS>();
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto W_of = [&](int) -> const QMat& { return W; };
  auto rows_of = [&](int g, int (&row)[1]) { row[0] = g; };
  RowWalk<BITS, 1, U> walk(rank * warps + warp, static_cast<int>(cluster.num_blocks()) * warps, W.rows, W.chunks());
  walk.prefetch(W_of, rows_of, lane);
  if (wait_halted(halt)) return;  // uniform: no block is left waiting at a barrier
  cluster_arrive();
  stage_x<BITS>(X, W.cols, xs, xsum, scratch);
  timeline_mark(0);
  cluster_wait();  // block 0 has started: its shared memory may be written
  float* logits0 = cluster.map_shared_rank(logits, 0);
  walk.run(W_of, rows_of, xs, xsum, lane, [&](int g, const float (&acc)[1]) {
    if (lane == 0) logits0[g] = acc[0];
  });
  timeline_done();
  cluster.sync();  // release/acquire: block 0 sees every logit
  if (rank != 0) return;
  if (warp == 0) route_topk(logits, E, k, norm_topk != 0, out.ids, out.weights, out.shared_gate);
  timeline_mark(1);  // block 0 has routed (thread 0 is in warp 0)
  if (out.logits)
    for (int e = threadIdx.x; e <= E; e += blockDim.x) out.logits[e] = logits[e];  // route_topk only reads them
}

template <int BITS>
void launch_router(const QMat& W, const XSpec& X, int E, int k, bool norm_topk, const RouterOut& out, const int* halt,
                   cudaStream_t stream, int max_cluster) {
  const size_t smem = route_smem_bytes(E) + stage_bytes<BITS>(W.cols);
  if (smem > 48 * 1024) fail("moe_router: hidden size or expert count too large");
  const int chunks = W.chunks();
  auto kernel = chunks <= 32 ? router_kernel<BITS, 1> : chunks <= 64 ? router_kernel<BITS, 2> : router_kernel<BITS, 4>;
  const int threads = kMaxWarps * 32;  // sized below; the cluster size is queried at the largest block
  const int cluster = max_cluster_size(reinterpret_cast<const void*>(kernel), threads, smem, max_cluster, "moe_router");
  const int warps = std::min(kMaxWarps, (W.rows + cluster - 1) / cluster);
  launch_clustered("moe_router", cluster, kernel, dim3(cluster), dim3(warps * 32), smem, stream, W, X, E, k,
                   int(norm_topk), out, halt);
}

}  // namespace

void moe_router(const QMat& W, const XSpec& X, int n_experts, int top_k, bool norm_topk, const RouterOut& out,
                const int* halt, cudaStream_t stream, int max_cluster) {
  if (W.rows != n_experts + 1) fail("moe_router: W must hold E router rows plus the shared-expert gate row");
  if (max_cluster < 1 || max_cluster > kRouterMaxCluster)
    fail("moe_router: max_cluster must be in [1, ", std::to_string(kRouterMaxCluster), "]");
  if (n_experts > kMoeMaxExperts) fail("moe_router: more than ", std::to_string(kMoeMaxExperts), " experts");
  if (top_k < 1 || top_k > kMoeMaxTopK || top_k > n_experts) fail("moe_router: top_k must be in [1, ", std::to_string(kMoeMaxTopK), "]");
  if (W.cols % 32 != 0) fail("moe_router: hidden size must be a multiple of 32");
  if (W.bits == 4) launch_router<4>(W, X, n_experts, top_k, norm_topk, out, halt, stream, max_cluster);
  else if (W.bits == 8) launch_router<8>(W, X, n_experts, top_k, norm_topk, out, halt, stream, max_cluster);
  else fail("moe_router: ", std::to_string(W.bits), "-bit router weights are not supported");
}

}  // namespace lily::cuda
