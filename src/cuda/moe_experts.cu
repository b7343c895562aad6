#include "moe_experts.h"

#include "gemv_core.cuh"
#include "qmma.cuh"

#include <algorithm>

namespace lily::cuda {
namespace {

// The router's choice for moe_down's block: expert ids and weights of the k slots, and the
// shared expert's gate in s_w[k]. Read before the wait on moe_gate_up (moe_experts.h says
// why that is safe), through L2 only (an SM's L1 may hold the previous layer's choice); the
// ids are clamped to [0, E) as the weight loads before the wait index with them even when
// a halted router left them unwritten.
__device__ __forceinline__ void stage_routing(const int* ids, const float* weights, const float* shared_gate, int k,
                                              int n_experts, int* s_ids, float* s_w) {
  if (threadIdx.x < k) {
    s_ids[threadIdx.x] = min(max(__ldcg(ids + threadIdx.x), 0), n_experts - 1);
    s_w[threadIdx.x] = __ldcg(weights + threadIdx.x);
  }
  if (threadIdx.x == 0) s_w[k] = __ldcg(shared_gate);
  __syncthreads();
}

constexpr int kWarps = 8;

// One warp per (slot, row r): reads gate row r and up row r of the slot's expert. The
// first tile is loaded (once the expert ids are known) before x is staged.
template <int BITS, int U>
__global__ void __launch_bounds__(kWarps * 32)
    gate_up_kernel(MoeExperts m, XSpec X, const int* ids, int k, float* act, const int* halt) {
  extern __shared__ float4 smem[];
  const int H = m.gate_up.cols;
  float4* xs = smem;
  float* xsum = reinterpret_cast<float*>(xs + H / 4);
  float* scratch = xsum + H / cols_per_chunk<BITS>();
  __shared__ int s_ids[kMoeMaxTopK];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int I = m.inter, Is = m.shared_inter, routed = k * I;
  if (wait_halted(halt)) return;
  if (threadIdx.x < k) s_ids[threadIdx.x] = ids[threadIdx.x];
  __syncthreads();
  auto W_of = [&](int item) -> const QMat& { return item < routed ? m.gate_up : m.shared_gate_up; };
  auto rows_of = [&](int item, int (&row)[2]) {
    if (item < routed) {
      const int slot = item / I, r = item - slot * I, base = s_ids[slot] * 2 * I;
      row[0] = base + r;
      row[1] = base + I + r;
    } else {
      row[0] = item - routed;
      row[1] = Is + item - routed;
    }
  };
  RowWalk<BITS, 2, U> walk(blockIdx.x * kWarps + warp, gridDim.x * kWarps, routed + Is, m.gate_up.chunks());
  walk.prefetch(W_of, rows_of, lane);
  stage_x<BITS>(X, H, xs, xsum, scratch);
  walk.run(W_of, rows_of, xs, xsum, lane, [&](int item, const float (&acc)[2]) {
    if (lane == 0) act[item] = siluf_(acc[0]) * acc[1];
  });
  timeline_done();
}

// One warp per output row j. The k routed slots and the shared slot are laid out back
// to back in act, so chunk c of the concatenated input maps to (slot, chunk within the
// slot's row) and to the staged x directly. A lane's chunks c = lane + 32i (i < U) are
// all loaded before x is staged.
template <int BITS, int U>
__global__ void __launch_bounds__(kWarps * 32)
    down_kernel(MoeExperts m, const float* act, const int* ids, const float* weights, const float* shared_gate, int k,
                float* h, int* pos_inc, const int* halt) {
  extern __shared__ float4 smem[];
  constexpr int CPC = cols_per_chunk<BITS>();
  const int I = m.inter, Is = m.shared_inter, H = m.shared_down.rows;
  const int cols = k * I + Is, cps = I / CPC, n_chunks = cols / CPC, routed_chunks = k * cps;
  float4* xs = smem;
  float* xsum = reinterpret_cast<float*>(xs + cols / 4);
  float* scratch = xsum + n_chunks;
  __shared__ int s_ids[kMoeMaxTopK];
  __shared__ float s_w[kMoeMaxTopK + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  stage_routing(ids, weights, shared_gate, k, m.n_experts, s_ids, s_w);

  auto load = [&](int j, uint4 (&cw)[U], uint32_t (&sb)[U], float (&wgt)[U]) {
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int c = min(lane + 32 * i, n_chunks - 1);
      const bool shared = c >= routed_chunks;
      const int slot = shared ? k : c / cps, u = shared ? c - routed_chunks : c - slot * cps;
      const QMat& W = shared ? m.shared_down : m.down;
      const int r = shared ? j : s_ids[slot] * H + j;
      cw[i] = load_stream(W.codes + static_cast<size_t>(r) * W.chunks() + u);
      sb[i] = __ldg(W.sb + static_cast<size_t>(r) * W.groups() + (u >> W.gshift));
      wgt[i] = s_w[slot];
    }
  };
  uint4 cw[U];
  uint32_t sb[U];
  float wgt[U];
  int j = blockIdx.x * kWarps + warp;
  if (j < H) load(j, cw, sb, wgt);
  const float resid0 = lane == 0 && j < H ? __ldcg(h + j) : 0.0f;
  if (wait_halted(halt)) return;
  XSpec X;
  X.x = act;
  stage_x<BITS>(X, cols, xs, xsum, scratch);

  const int j0 = j;
  for (; j < H; j += gridDim.x * kWarps) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int c = lane + 32 * i;
      if (c < n_chunks) {
        float4 xv[slots_per_chunk<BITS>()];
        load_x<BITS>(xs, c, xv);
        acc = fmaf(wgt[i], chunk_term<BITS>(cw[i], sb[i], xv, xsum[c]), acc);
      }
    }
    const int jn = j + gridDim.x * kWarps;
    if (jn < H) load(jn, cw, sb, wgt);
    acc = warp_sum(acc);
    if (lane == 0) h[j] = (j == j0 ? resid0 : h[j]) + acc;
  }
  if (pos_inc && blockIdx.x == 0 && threadIdx.x == 0) *pos_inc += 1;
  timeline_done();
}

// Tensor-core gate/up (tiled weights, each 16-row block = 8 gate rows + their 8 up
// rows): task = (slot, row block) -> 8 outputs SiLU(gate) * up; warps split the groups.
// x = RMSNorm(h) is staged before the wait: h was last written by the out-projection, the
// kernel launched two before this one (the router comes between). The shared expert needs
// no routing, so its row blocks are computed before the wait too (block b takes b, b +
// grid, ...): only the routed row blocks (512 at 35B-A3B, under two per block on 264
// blocks) are left after it.
template <int GPW>
__global__ void __launch_bounds__(kWarps * 32, 2)
    gate_up_mma_kernel(MoeExperts m, XSpec X, const int* ids, int k, float* act, const int* halt) {
  extern __shared__ uint4 smem_u4[];
  __shared__ float red[2][kWarps][16];
  const int H = m.gate_up.cols, G = H / 64, lane = threadIdx.x & 31, g0 = (threadIdx.x >> 5) * GPW;
  const int I = m.inter, rbe = 2 * I / 16, routed = k * rbe, n_shared = 2 * m.shared_inter / 16;
  const int grid = static_cast<int>(gridDim.x);
  const auto [xf, xsum, raw] = mma_stage(smem_u4, H);
  int it = 0;  // row blocks done: red[it & 1] alternates between them
  // SiLU(gate) * up of one row block into act[out, out + 8); mark: the first routed one.
  auto finish = [&](const MmaTiles<GPW>& tiles, int out, bool mark) {
    float y0 = 0.0f, y1 = 0.0f;
    tiles.accumulate(g0, G, g0, xf, xsum, lane, y0, y1);
    if (mark) timeline_mark(1);
    put_rows16(red[it & 1], y0, y1);
    __syncthreads();
    if (threadIdx.x < 8) {
      const float g = row_total(red[it & 1], threadIdx.x), u = row_total(red[it & 1], threadIdx.x + 8);
      act[out + threadIdx.x] = siluf_(g) * u;
    }
    ++it;
  };

  // A halted step writes nothing (decode_ctl.h); the flag may be read before the wait.
  const bool halted = halt && __ldcg(halt);
  MmaTiles<GPW> next;
  int rb = blockIdx.x;
  if (rb < n_shared) next.load(m.shared_gate_up, rb, g0, G, lane);
  stage_x_mma(X, H, xf, xsum, raw, raw + H);
  for (; !halted && rb < n_shared; rb += grid) {
    const MmaTiles<GPW> cur = next;
    if (rb + grid < n_shared) next.load(m.shared_gate_up, rb + grid, g0, G, lane);
    finish(cur, k * I + 8 * rb, false);
  }

  if (wait_halted(halt)) return;
  timeline_mark(0);
  // Lane i holds slot i's expert (k <= kMoeMaxTopK <= 32), read through L2 (the router wrote
  // it); tasks are block-uniform, so every warp shuffles the one it needs without a block barrier.
  static_assert(kMoeMaxTopK <= 32, "a lane per slot");
  const int lane_expert = __ldcg(ids + min(lane, k - 1));
  auto row_block = [&](int task) { return __shfl_sync(0xffffffffu, lane_expert, task / rbe) * rbe + task % rbe; };
  int task = blockIdx.x;
  if (task < routed) next.load(m.gate_up, row_block(task), g0, G, lane);
  for (; task < routed; task += grid) {
    const MmaTiles<GPW> cur = next;
    if (task + grid < routed) next.load(m.gate_up, row_block(task + grid), g0, G, lane);
    finish(cur, (task / rbe) * I + 8 * (task % rbe), task == static_cast<int>(blockIdx.x));
  }
  timeline_done();
}

// Tensor-core down + combine: task = 16 output rows; the WARPS warps take (slot, group)
// pairs p (the concatenated activations' groups), U each, loaded before the activations
// are staged (moe_down_warps picks WARPS).
template <int WARPS, int U>
__global__ void __launch_bounds__(WARPS * 32)
    down_mma_kernel(MoeExperts m, const float* act, const int* ids, const float* weights, const float* shared_gate,
                    int k, float* h, int* pos_inc, const int* halt) {
  extern __shared__ uint4 smem_u4[];
  const int I = m.inter, Is = m.shared_inter, H = m.shared_down.rows;
  const int gI = I / 64, gS = Is / 64, P = k * gI + gS, cols = k * I + Is, n_rb = H / 16;
  uint4* xf = smem_u4;
  float* xsum = reinterpret_cast<float*>(xf + cols / 4);
  float* raw = xsum + (P + 3) / 4 * 4;
  __shared__ float red[2][WARPS][16];
  __shared__ int s_ids[kMoeMaxTopK];
  __shared__ float s_w[kMoeMaxTopK + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  stage_routing(ids, weights, shared_gate, k, m.n_experts, s_ids, s_w);

  uint4 c[U];
  uint32_t s0[U], s1[U];
  auto load = [&](int rb) {
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int p = warp + WARPS * i;
      if (p < P) {
        const bool shared = p >= k * gI;
        const int slot = shared ? k : p / gI, gi = shared ? p - k * gI : p - slot * gI;
        const QMat& W = shared ? m.shared_down : m.down;
        const size_t t = static_cast<size_t>(shared ? rb : s_ids[slot] * n_rb + rb) * (shared ? gS : gI) + gi;
        c[i] = load_stream(W.codes + t * 32 + lane);
        s0[i] = __ldg(W.sb + t * 16 + (lane >> 2));
        s1[i] = __ldg(W.sb + t * 16 + (lane >> 2) + 8);
      }
    }
  };
  int rb = blockIdx.x;
  if (rb < n_rb) load(rb);
  const float resid0 = threadIdx.x < 16 && rb < n_rb ? __ldcg(h + rb * 16 + threadIdx.x) : 0.0f;
  if (wait_halted(halt)) return;
  XSpec X;
  X.x = act;
  stage_x_mma(X, cols, xf, xsum, raw, raw + cols);
  timeline_mark(0);
  for (int it = 0; rb < n_rb; rb += gridDim.x, ++it) {
    float y0 = 0.0f, y1 = 0.0f;
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int p = warp + WARPS * i;
      if (p < P) {
        const float2 v = group_mma(c[i], xf, p, lane);
        const float wgt = s_w[p >= k * gI ? k : p / gI], xs = xsum[p];
        y0 = fmaf(wgt, group_term(s0[i], v.x, xs), y0);
        y1 = fmaf(wgt, group_term(s1[i], v.y, xs), y1);
      }
    }
    if (it == 0) timeline_mark(1);
    if (rb + static_cast<int>(gridDim.x) < n_rb) load(rb + gridDim.x);
    const float y = reduce_rows16(red[it & 1], y0, y1);
    if (threadIdx.x < 16) h[rb * 16 + threadIdx.x] = (it == 0 ? resid0 : h[rb * 16 + threadIdx.x]) + y;
  }
  if (pos_inc && blockIdx.x == 0 && threadIdx.x == 0) *pos_inc += 1;
  timeline_done();
}

void check_shapes(const MoeExperts& m, int k) {
  const int cpc = 128 / m.down.bits;
  if (k < 1 || k > kMoeMaxTopK) fail("moe: top_k must be in [1, ", std::to_string(kMoeMaxTopK), "]");
  if (m.gate_up.bits != m.down.bits || m.shared_gate_up.bits != m.gate_up.bits || m.shared_down.bits != m.gate_up.bits)
    fail("moe: routed and shared expert weights must have the same bit width");
  if (m.inter % cpc != 0 || m.shared_inter % cpc != 0)
    fail("moe: expert widths must be multiples of ", std::to_string(cpc));
}

template <int BITS>
void launch_gate_up(const MoeExperts& m, const XSpec& X, const int* ids, int k, float* act, const int* halt,
                    cudaStream_t stream) {
  const int H = m.gate_up.cols, n_items = k * m.inter + m.shared_inter, chunks = m.gate_up.chunks();
  const int grid = std::min((n_items + kWarps - 1) / kWarps, 2 * sm_count());
  const size_t smem = stage_bytes<BITS>(H);
  if (chunks <= 32) launch("moe_gate_up", gate_up_kernel<BITS, 1>, dim3(grid), dim3(kWarps * 32), smem, stream, m, X, ids, k, act, halt);
  else if (chunks <= 64) launch("moe_gate_up", gate_up_kernel<BITS, 2>, dim3(grid), dim3(kWarps * 32), smem, stream, m, X, ids, k, act, halt);
  else launch("moe_gate_up", gate_up_kernel<BITS, 4>, dim3(grid), dim3(kWarps * 32), smem, stream, m, X, ids, k, act, halt);
}

template <int BITS>
void launch_down(const MoeExperts& m, const float* act, const int* ids, const float* weights, const float* shared_gate,
                 int k, float* h, int* pos_inc, const int* halt, cudaStream_t stream) {
  const int H = m.shared_down.rows, cols = k * m.inter + m.shared_inter;
  const int n_chunks = cols / cols_per_chunk<BITS>();
  const size_t smem = stage_bytes<BITS>(cols);
  if (smem > 48 * 1024) fail("moe_down: expert width too large for the staged activations");
  const int grid = std::min((H + kWarps - 1) / kWarps, 2 * sm_count());
#define LILY_DOWN(U)                                                                                                  \
  launch("moe_down", down_kernel<BITS, U>, dim3(grid), dim3(kWarps * 32), smem, stream, m, act, ids, weights, shared_gate, \
         k, h, pos_inc, halt)
  if (n_chunks <= 64) LILY_DOWN(2);
  else if (n_chunks <= 160) LILY_DOWN(5);
  else if (n_chunks <= 320) LILY_DOWN(10);
  else fail("moe_down: ", std::to_string(n_chunks), " chunks per row are more than supported (320)");
#undef LILY_DOWN
}

}  // namespace

int moe_down_warps(int hidden) { return hidden / 16 <= sm_count() ? kMoeDownMaxWarps : kWarps; }

bool tiled(const MoeExperts& m) {
  return m.gate_up.tiled && m.down.tiled && m.shared_gate_up.tiled && m.shared_down.tiled;
}

void moe_gate_up(const MoeExperts& m, const XSpec& X, const int* ids, int top_k, float* act, const int* halt,
                 cudaStream_t stream) {
  check_shapes(m, top_k);
  if (tiled(m)) {
    // Routed and shared row blocks come on either side of the wait: a block per row block
    // of the larger set, at most two per SM.
    const int H = m.gate_up.cols, routed = top_k * 2 * m.inter / 16, shared = 2 * m.shared_inter / 16;
    const int grid = std::min(std::max(routed, shared), 2 * sm_count());
    with_groups_per_warp(H, kWarps, "moe_gate_up", [&](auto gpw) {
      launch("moe_gate_up (tensor cores)", gate_up_mma_kernel<gpw>, dim3(grid), dim3(kWarps * 32), stage_mma_bytes(H),
             stream, m, X, ids, top_k, act, halt);
    });
    return;
  }
  if (m.gate_up.bits == 4) launch_gate_up<4>(m, X, ids, top_k, act, halt, stream);
  else if (m.gate_up.bits == 8) launch_gate_up<8>(m, X, ids, top_k, act, halt, stream);
  else fail("moe_gate_up: unsupported bit width ", std::to_string(m.gate_up.bits));
}

void moe_down(const MoeExperts& m, const float* act, const int* ids, const float* weights, const float* shared_gate,
              int top_k, float* h, int* pos_inc, const int* halt, cudaStream_t stream) {
  check_shapes(m, top_k);
  if (tiled(m)) {
    const int H = m.shared_down.rows, cols = top_k * m.inter + m.shared_inter;
    const int pairs = top_k * (m.inter / 64) + m.shared_inter / 64, n_rb = H / 16;
    const int warps = moe_down_warps(H), u = (pairs + warps - 1) / warps;
    const int grid = std::min(n_rb, 2 * sm_count());
    const size_t smem = stage_mma_bytes(cols);
    if (smem > 48 * 1024) fail("moe_down: expert width too large for the staged activations");
    if (u > 10)
      fail("moe_down: more than ", std::to_string(10 * warps), " (slot, group) pairs are not supported with tiled weights");
#define LILY_DN(W, N)                                                                                                  \
  launch("moe_down (tensor cores)", down_mma_kernel<W, N>, dim3(grid), dim3(W * 32), smem, stream, m, act, ids, \
         weights, shared_gate, top_k, h, pos_inc, halt)
#define LILY_DN_U(W)             \
  if (u <= 2) LILY_DN(W, 2);     \
  else if (u <= 5) LILY_DN(W, 5); \
  else LILY_DN(W, 10)
    if (warps == kMoeDownMaxWarps) {
      LILY_DN_U(kMoeDownMaxWarps);
    } else {
      LILY_DN_U(kWarps);
    }
#undef LILY_DN_U
#undef LILY_DN
    return;
  }
  if (m.down.bits == 4) launch_down<4>(m, act, ids, weights, shared_gate, top_k, h, pos_inc, halt, stream);
  else if (m.down.bits == 8) launch_down<8>(m, act, ids, weights, shared_gate, top_k, h, pos_inc, halt, stream);
  else fail("moe_down: unsupported bit width ", std::to_string(m.down.bits));
}

}  // namespace lily::cuda
