#include "head/lm_head.h"

#include <algorithm>

#include "qmatmul/qmatmul_decode_fma.cuh"
#include "qmatmul/qmatmul_decode_mma.cuh"
#include "head/token_select.cuh"

namespace lily::cuda {
namespace {

constexpr int kWarps = 8;

__device__ __forceinline__ float select_key(float l, int r, HeadSelect sel, const DecodeCtl& c, int limit,
                                            const TokenSink& s) {
  if (r >= limit) return -FLT_MAX;
  const float p = penalized(l, r, c, s.counts, s.seen);
  if (sel == HeadSelect::Greedy) return p;
  return p / c.temperature - __logf(-__logf(uniform01(c.seed, c.n_generated, r)));
}

// A block's running token choice: the sampling rules (read once), the rows that may be
// chosen (below vocab_limit), and the best key so far.
struct BlockChoice {
  bool on;
  DecodeCtl c;
  int limit;
  float best = -FLT_MAX;
  int best_i = 0x7fffffff;

  __device__ __forceinline__ explicit BlockChoice(const HeadArgs& a) : on(a.select != HeadSelect::None) {
    if (on) c = *a.ctl;
    limit = on && c.vocab_limit > 0 ? min(c.vocab_limit, a.W.rows) : a.W.rows;
  }
  __device__ __forceinline__ void offer(const HeadArgs& a, float logit, int r) {
    const float k = select_key(logit, r, a.select, c, limit, a.sink);
    if (better(k, r, best, best_i)) { best = k; best_i = r; }
  }
};

// Once every block has written its partials: true in the last block to get here, which
// may then read them all (through L2); it resets the counter.
__device__ bool last_block_done(unsigned* counter) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence();
  if (threadIdx.x == 0) *counter = 0;
  return true;
}

// Block winner -> partial[block]; the last block to finish reduces them and emits.
__device__ void finish_selection(const HeadArgs& a, float best, int best_i) {
  __shared__ float red_v[32];
  __shared__ int red_i[32];
  block_best(best, best_i, red_v, red_i);
  if (threadIdx.x == 0) a.partial[blockIdx.x] = make_float2(best, __int_as_float(best_i));
  if (!last_block_done(a.counter)) return;
  best = -FLT_MAX;
  best_i = 0x7fffffff;
  for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
    const float2 p = __ldcg(a.partial + b);
    if (better(p.x, __float_as_int(p.y), best, best_i)) { best = p.x; best_i = __float_as_int(p.y); }
  }
  block_best(best, best_i, red_v, red_i);
  if (threadIdx.x == 0) emit_token(best_i, a.sink);
}

template <int BITS>
__global__ void __launch_bounds__(kWarps * 32, 2) lm_head_kernel(HeadArgs a, const int* halt) {
  constexpr int R = BITS == 4 ? 4 : 2, U = BITS == 4 ? 2 : 4;  // rows per warp, chunks per lane
  extern __shared__ float4 smem[];
  const QMat& W = a.W;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto W_of = [&](int) -> const QMat& { return W; };
  auto rows_of = [&](int g, int (&row)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) row[r] = min(g * R + r, W.rows - 1);
  };
  RowWalk<BITS, R, U> walk(blockIdx.x * kWarps + warp, gridDim.x * kWarps, (W.rows + R - 1) / R, W.chunks());
  if (a.compute) walk.prefetch(W_of, rows_of, lane);
  if (wait_halted(halt)) return;
  BlockChoice ch(a);

  if (a.compute) {
    const FmaStage st = fma_stage<BITS>(smem, W.cols);
    stage_x<BITS>(a.X, W.cols, st);
    walk.run(W_of, rows_of, st.xs, st.xsum, lane, [&](int g, const float (&acc)[1][R]) {
      float mine = 0.0f;
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (lane == r) mine = acc[0][r];
      const int r = g * R + lane;
      if (lane < R && r < W.rows) {
        a.logits[r] = mine;
        if (ch.on) ch.offer(a, mine, r);
      }
    });
  } else if (ch.on) {
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < ch.limit; r += gridDim.x * blockDim.x) ch.offer(a, a.logits[r], r);
  }
  timeline_done();
  if (ch.on) finish_selection(a, ch.best, ch.best_i);
}

// argmax of each of T logit rows (the T-row head: plain greedy, rows below a.argmax_limit):
// thread i < 16 T holds row i / 16's best of its rows; the 16 threads of a row meet by
// shuffles, block winners go to partial[t * kLmHeadMaxBlocks + block], and the last
// block to finish writes argmax[t].
template <int T>
__device__ void finish_argmax_rows(const HeadArgs& a, float best, int best_i) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (better(ov, oi, best, best_i)) { best = ov; best_i = oi; }
  }
  if (threadIdx.x < 16 * T && (threadIdx.x & 15) == 0)
    a.partial[(threadIdx.x >> 4) * kLmHeadMaxBlocks + blockIdx.x] = make_float2(best, __int_as_float(best_i));
  if (!last_block_done(a.counter)) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp < T) {  // warp t reduces row t
    best = -FLT_MAX;
    best_i = 0x7fffffff;
    for (int b = lane; b < gridDim.x; b += 32) {
      const float2 p = __ldcg(a.partial + warp * kLmHeadMaxBlocks + b);
      if (better(p.x, __float_as_int(p.y), best, best_i)) { best = p.x; best_i = __float_as_int(p.y); }
    }
    warp_best(best, best_i);
    if (lane == 0) a.argmax[warp] = best_i;
  }
}

// Tensor-core path (tiled weights): 16-row blocks in turn, warps split the groups. T x
// rows share every tile (qmatmul_decode_mma.cuh), each summed exactly as alone; one row chooses a token
// (BlockChoice), several take each row's argmax.
template <int GPW, int T>
__global__ void __launch_bounds__(kWarps * 32, 2) lm_head_mma_kernel(HeadArgs a, const int* halt) {
  extern __shared__ uint4 smem_u4[];
  const QMat& W = a.W;
  const int G = W.cols / 64, n_rb = (W.rows + 15) / 16;
  const MmaStage st = mma_stage(smem_u4, W.cols, T);
  __shared__ float red[2][T * kWarps][16];
  const int lane = threadIdx.x & 31, g0 = (threadIdx.x >> 5) * GPW;
  const int t_out = T == 1 ? 0 : threadIdx.x >> 4, r_out = threadIdx.x & 15;
  int rb = blockIdx.x;
  MmaTiles<GPW> next;
  if (rb < n_rb) next.load(W, rb, g0, G, lane);
  if (wait_halted(halt)) return;
  BlockChoice ch(a);  // one row choosing a token (decode); otherwise each row's argmax (verify)
  const bool rows_argmax = !ch.on && a.argmax;
  const int limit = ch.on ? ch.limit : a.argmax_limit > 0 ? min(a.argmax_limit, W.rows) : W.rows;
  float best = -FLT_MAX;  // rows_argmax: this thread's row's best so far
  int best_i = 0x7fffffff;
  stage_x_mma<T>(a.X, W.cols, st);
  const MmaRows xr = mma_rows<T>(st, W.cols, lane);
  for (int it = 0; rb < n_rb; rb += gridDim.x, ++it) {
    const MmaTiles<GPW> cur = next;
    if (rb + static_cast<int>(gridDim.x) < n_rb) next.load(W, rb + gridDim.x, g0, G, lane);
    float y0 = 0.0f, y1 = 0.0f;
    cur.accumulate(g0, G, g0, xr.xf, xr.xsum, lane, y0, y1);
    const float y = reduce_rows16<T>(red[it & 1], y0, y1);
    const int r = rb * 16 + r_out;
    if (threadIdx.x < 16 * T && r < W.rows) {
      a.logits[static_cast<size_t>(t_out) * W.rows + r] = y;
      if (ch.on) {
        ch.offer(a, y, r);
      } else if (rows_argmax && r < limit && better(y, r, best, best_i)) {
        best = y;
        best_i = r;
      }
    }
  }
  timeline_done();
  if (ch.on) finish_selection(a, ch.best, ch.best_i);
  else if (rows_argmax) finish_argmax_rows<T>(a, best, best_i);
}

template <int BITS>
void launch_head(const HeadArgs& a, const int* halt, cudaStream_t stream) {
  auto kernel = lm_head_kernel<BITS>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), 64 * 1024, "lm_head: set smem");
  static int blocks_per_sm = [&] {
    int n = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kWarps * 32, 16 * 1024), "lm_head: occupancy");
    return std::max(n, 1);
  }();
  const int grid = std::min(blocks_per_sm * sm_count(), kLmHeadMaxBlocks);
  launch("lm_head", kernel, dim3(grid), dim3(kWarps * 32), a.compute ? stage_bytes<BITS>(a.W.cols) : 0, stream, a, halt);
}


template <int GPW, int T>
void launch_head_mma(const HeadArgs& a, const int* halt, cudaStream_t stream) {
  auto kernel = lm_head_mma_kernel<GPW, T>;
  const size_t smem = stage_mma_bytes(a.W.cols, T);
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), std::max<size_t>(smem, 64 * 1024), "lm_head: set smem");
  static const int blocks_per_sm = [&] {
    int n = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kWarps * 32, std::max<size_t>(smem, 24 * 1024)),
          "lm_head: occupancy");
    return std::max(n, 1);
  }();
  const int grid = std::min({blocks_per_sm * sm_count(), kLmHeadMaxBlocks, (a.W.rows + 15) / 16});
  launch("lm_head (tensor cores)", kernel, dim3(grid), dim3(kWarps * 32), smem, stream, a, halt);
}

}  // namespace

void lm_head(const HeadArgs& a, const int* halt, cudaStream_t stream) {
  if (a.W.cols % 32 != 0) fail("lm_head: hidden size must be a multiple of 32");
  if (a.rows > 1 && (!a.compute || !a.W.tiled || a.select != HeadSelect::None))
    fail("lm_head: several rows need tiled weights, computed logits and no token choice (argmax per row instead)");
  if (a.argmax && (!a.compute || !a.W.tiled || a.select != HeadSelect::None))
    fail("lm_head: argmax per row needs tiled weights, computed logits and no token choice");
  if (a.compute && a.W.tiled) {
    with_step_rows("lm_head", a.rows, [&](auto t) {
      with_groups_per_warp(a.W.cols, kWarps, "lm_head", [&](auto gpw) { launch_head_mma<gpw, t>(a, halt, stream); });
    });
  } else if (a.W.bits == 4 || !a.compute) launch_head<4>(a, halt, stream);
  else if (a.W.bits == 8) launch_head<8>(a, halt, stream);
  else fail("lm_head: ", std::to_string(a.W.bits), "-bit weights are not supported");
}

}  // namespace lily::cuda
