#include "moe_router.h"

#include <algorithm>
#include <cfloat>

#include "gemv_core.cuh"
#include "moe_topk.cuh"

namespace lily::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kMaxTopK = 16;

template <int BITS, int U>
__global__ void __launch_bounds__(kWarps * 32)
    router_kernel(QMat W, XSpec X, int E, int k, int norm_topk, RouterOut out, const int* halt) {
  extern __shared__ float4 smem[];
  float4* xs = smem;
  float* xsum = reinterpret_cast<float*>(xs + W.cols / 4);
  float* scratch = xsum + W.cols / cols_per_chunk<BITS>();
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto W_of = [&](int) -> const QMat& { return W; };
  auto rows_of = [&](int g, int (&row)[1]) { row[0] = g; };
  RowWalk<BITS, 1, U> walk(blockIdx.x * kWarps + warp, gridDim.x * kWarps, W.rows, W.chunks());
  walk.prefetch(W_of, rows_of, lane);
  if (wait_halted(halt)) return;
  stage_x<BITS>(X, W.cols, xs, xsum, scratch);
  timeline_mark(0);
  walk.run(W_of, rows_of, xs, xsum, lane, [&](int g, const float (&acc)[1]) {
    if (lane == 0) out.logits[g] = acc[0];
  });
  decode_trigger();

  // The last block to finish routes (the other blocks' logits are visible after the fence).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(out.counter, 1u) == gridDim.x - 1;
  timeline_mark(1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (warp == 0)
    route_topk(out.logits, E, k, norm_topk != 0, reinterpret_cast<float*>(smem), out.ids, out.weights, out.shared_gate);
  if (threadIdx.x == 0) *out.counter = 0;
}

template <int BITS>
void launch_router(const QMat& W, const XSpec& X, int E, int k, bool norm_topk, const RouterOut& out, const int* halt,
                   cudaStream_t stream) {
  const int grid = std::min((W.rows + kWarps - 1) / kWarps, 2 * sm_count());
  const size_t smem = std::max(stage_bytes<BITS>(W.cols), static_cast<size_t>(E) * 4);
  if (smem > 48 * 1024) fail("moe_router: hidden size or expert count too large");
  const int chunks = W.chunks();
  if (chunks <= 32)
    launch("moe_router", router_kernel<BITS, 1>, dim3(grid), dim3(kWarps * 32), smem, stream, W, X, E, k, int(norm_topk), out, halt);
  else if (chunks <= 64)
    launch("moe_router", router_kernel<BITS, 2>, dim3(grid), dim3(kWarps * 32), smem, stream, W, X, E, k, int(norm_topk), out, halt);
  else
    launch("moe_router", router_kernel<BITS, 4>, dim3(grid), dim3(kWarps * 32), smem, stream, W, X, E, k, int(norm_topk), out, halt);
}

}  // namespace

void moe_router(const QMat& W, const XSpec& X, int n_experts, int top_k, bool norm_topk, const RouterOut& out,
                const int* halt, cudaStream_t stream) {
  if (W.rows != n_experts + 1) fail("moe_router: W must hold E router rows plus the shared-expert gate row");
  if (top_k < 1 || top_k > kMaxTopK || top_k > n_experts) fail("moe_router: top_k must be in [1, ", std::to_string(kMaxTopK), "]");
  if (W.cols % 32 != 0) fail("moe_router: hidden size must be a multiple of 32");
  if (W.bits == 4) launch_router<4>(W, X, n_experts, top_k, norm_topk, out, halt, stream);
  else if (W.bits == 8) launch_router<8>(W, X, n_experts, top_k, norm_topk, out, halt, stream);
  else fail("moe_router: ", std::to_string(W.bits), "-bit router weights are not supported");
}

}  // namespace lily::cuda
