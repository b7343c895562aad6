#include "moe/moe_router_decode.h"

#include <cooperative_groups.h>

#include <algorithm>

#include "qmatmul/qmatmul_decode_fma.cuh"
#include "moe/moe_topk.cuh"

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
// T tokens share every weight tile (RowWalk), each summed exactly as alone; warp t of
// block 0 routes token t. Shared memory: logits [T][E + 1] (block 0's routing), then the
// staged x rows.
template <int BITS, int U, int T>
__global__ void __launch_bounds__(kMaxWarps * 32)
    router_kernel(QMat W, XSpec X, int E, int k, int norm_topk, RouterOut out, const int* halt) {
  extern __shared__ float4 smem[];
  float* logits = reinterpret_cast<float*>(smem);
  const int ls = route_smem_bytes(E) / 4;  // floats per token's logits
  const FmaStage st = fma_stage<BITS>(smem + T * ls / 4, W.cols, T);
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto W_of = [&](int) -> const QMat& { return W; };
  auto rows_of = [&](int g, int (&row)[1]) { row[0] = g; };
  RowWalk<BITS, 1, U> walk(rank * warps + warp, static_cast<int>(cluster.num_blocks()) * warps, W.rows, W.chunks());
  walk.prefetch(W_of, rows_of, lane);
  if (wait_halted(halt)) return;  // uniform: no block is left waiting at a barrier
  cluster_arrive();
  stage_x<BITS, T>(X, W.cols, st);
  timeline_mark(0);
  cluster_wait();  // block 0 has started: its shared memory may be written
  float* logits0 = cluster.map_shared_rank(logits, 0);
  walk.template run<T>(W_of, rows_of, st.xs, st.xsum, lane, [&](int g, const float (&acc)[T][1]) {
    if (lane == 0)
#pragma unroll
      for (int t = 0; t < T; ++t) logits0[t * ls + g] = acc[t][0];
  });
  timeline_done();
  cluster.sync();  // release/acquire: block 0 sees every logit
  if (rank != 0) return;
  if (warp < T)
    moe_topk(logits + warp * ls, E, k, norm_topk != 0, out.ids + warp * k, out.weights + warp * k, out.shared_gate + warp);
  timeline_mark(1);  // block 0 has routed (thread 0 is in warp 0)
  if (out.logits)  // moe_topk only reads them
    for (int i = threadIdx.x; i < T * (E + 1); i += blockDim.x) out.logits[i] = logits[(i / (E + 1)) * ls + i % (E + 1)];
}

template <int BITS, int T>
void launch_router(const QMat& W, const XSpec& X, int E, int k, bool norm_topk, const RouterOut& out, const int* halt,
                   cudaStream_t stream, int max_cluster) {
  const size_t smem = moe_router_decode_smem_bytes(W, E, T);
  if (smem > kRouterMaxSmem)
    fail("moe_router_decode: ", std::to_string(T), " rows of hidden size ", std::to_string(W.cols), " and ", std::to_string(E),
         " experts need ", std::to_string(smem), " bytes of shared memory, more than ", std::to_string(kRouterMaxSmem));
  const int chunks = W.chunks();
  auto kernel = chunks <= 32 ? router_kernel<BITS, 1, T> : chunks <= 64 ? router_kernel<BITS, 2, T> : router_kernel<BITS, 4, T>;
  const int threads = kMaxWarps * 32;  // sized below; the cluster size is queried at the largest block
  const int cluster = max_cluster_size(reinterpret_cast<const void*>(kernel), threads, smem, max_cluster, "moe_router_decode");
  const int warps = std::max(T, std::min(kMaxWarps, (W.rows + cluster - 1) / cluster));
  launch_clustered("moe_router_decode", cluster, kernel, dim3(cluster), dim3(warps * 32), smem, stream, W, X, E, k,
                   int(norm_topk), out, halt);
}

}  // namespace

size_t moe_router_decode_smem_bytes(const QMat& W, int n_experts, int rows) {
  const size_t stage = W.bits == 4 ? stage_bytes<4>(W.cols, rows) : stage_bytes<8>(W.cols, rows);
  return rows * route_smem_bytes(n_experts) + stage;
}

void moe_router_decode(const QMat& W, const XSpec& X, int n_experts, int top_k, bool norm_topk, const RouterOut& out,
                const int* halt, cudaStream_t stream, int max_cluster, int rows) {
  if (W.rows != n_experts + 1) fail("moe_router_decode: W must hold E router rows plus the shared-expert gate row");
  if (max_cluster < 1 || max_cluster > kRouterMaxCluster)
    fail("moe_router_decode: max_cluster must be in [1, ", std::to_string(kRouterMaxCluster), "]");
  if (n_experts > kMoeMaxExperts) fail("moe_router_decode: more than ", std::to_string(kMoeMaxExperts), " experts");
  if (top_k < 1 || top_k > kMoeMaxTopK || top_k > n_experts) fail("moe_router_decode: top_k must be in [1, ", std::to_string(kMoeMaxTopK), "]");
  if (W.cols % 32 != 0) fail("moe_router_decode: hidden size must be a multiple of 32");
  if (W.bits != 4 && W.bits != 8) fail("moe_router_decode: ", std::to_string(W.bits), "-bit router weights are not supported");
  with_step_rows("moe_router_decode", rows, [&](auto t) {
    if (W.bits == 4) launch_router<4, t>(W, X, n_experts, top_k, norm_topk, out, halt, stream, max_cluster);
    else launch_router<8, t>(W, X, n_experts, top_k, norm_topk, out, halt, stream, max_cluster);
  });
}

}  // namespace lily::cuda
