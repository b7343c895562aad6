#include "moe/moe_experts_decode.h"

#include "common/fast_div.h"
#include "qmatmul/qmatmul_decode_fma.cuh"
#include "qmatmul/qmatmul_decode_mma.cuh"

#include <algorithm>

namespace lily::cuda {
namespace {

// The router's choice for moe_down_decode's block: expert ids and weights of the k slots, and the
// shared expert's gate in s_w[k]. Read before the wait on moe_gate_up_decode (moe_experts_decode.h says
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

// Slots of gate/up's tile ring for one token (MmaTileRing): the next task's loads start before
// the wait for this one's.
constexpr int kGateUpRing = 2;

// One warp per (slot, row r): reads gate row r and up row r of the slot's expert. The
// first tile is loaded (once the expert ids are known) before x is staged.
template <int BITS, int U>
__global__ void __launch_bounds__(kWarps * 32)
    gate_up_kernel(MoeExperts m, XSpec X, const int* ids, int k, float* act, const int* halt) {
  extern __shared__ float4 smem[];
  const int H = m.gate_up.cols;
  const FmaStage st = fma_stage<BITS>(smem, H);
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
  stage_x<BITS>(X, H, st);
  walk.run(W_of, rows_of, st.xs, st.xsum, lane, [&](int item, const float (&acc)[1][2]) {
    if (lane == 0) act[item] = siluf_(acc[0][0]) * acc[0][1];
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
  const FmaStage st = fma_stage<BITS>(smem, cols);
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
  stage_x<BITS>(X, cols, st);

  const int j0 = j;
  for (; j < H; j += gridDim.x * kWarps) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int c = lane + 32 * i;
      if (c < n_chunks) {
        float4 xv[slots_per_chunk<BITS>()];
        load_x<BITS>(st.xs, c, xv);
        acc = fmaf(wgt[i], chunk_term<BITS>(cw[i], sb[i], xv, st.xsum[c]), acc);
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

// The routed experts of T tokens as the tensor-core kernels walk them: the union of the
// tokens' choices in first-seen order (token 0's slots, then what token 1 adds, ...; for
// one token its slots in order), and each (token, slot)'s place in it. Computed by every
// warp alike from the ids (lane j < T k holds token j / k's slot j % k), so no barrier.
template <int T>
struct ExpertUnion {
  int lane_id;     // the expert of this lane's (token, slot); -1 - lane past T k
  unsigned first;  // lanes holding the first occurrence of an expert: the u-th set bit = union expert u
  int n;           // experts in the union
  int lane_u;      // the union index of lane_id (lanes < T k)

  // ids: [T][k] on the device (clamped to [0, E): loads index with them even when a halted
  // router left them unwritten), read through L2.
  __device__ __forceinline__ ExpertUnion(const int* ids, int k, int n_experts) {
    const int lane = threadIdx.x & 31;
    lane_id = lane < T * k ? min(max(__ldcg(ids + lane), 0), n_experts - 1) : -1 - lane;
    const int leader = __ffs(__match_any_sync(0xffffffffu, lane_id)) - 1;
    first = __ballot_sync(0xffffffffu, lane < T * k && leader == lane);
    n = __popc(first);
    lane_u = __popc(first & ((1u << leader) - 1u));
  }
  // Union expert u's id (u < n).
  __device__ __forceinline__ int expert(int u) const {
    return __shfl_sync(0xffffffffu, lane_id, static_cast<int>(__fns(first, 0, u + 1)));
  }
};

// Tensor-core gate/up (tiled weights, each 16-row block = 8 gate rows + their 8 up
// rows): task = (expert, row block) -> 8 outputs SiLU(gate) * up; warps split the groups.
// x = RMSNorm(h) is staged before the wait: h was last written by the out-projection, the
// kernel launched two before this one (the router comes between). The shared expert needs
// no routing, so its row blocks are computed before the wait too (block b takes b, b +
// grid, ...): only the routed row blocks (512 at 35B-A3B, under two per block on 264
// blocks) are left after it. T tokens: every tile of the union of their experts is read
// once and computed for all (qmatmul_decode_mma.cuh: MmaRows); token t keeps the experts it chose, each
// summed exactly as for t alone. act: [T][k * I + Is].
template <int GPW, int T>
__global__ void __launch_bounds__(kWarps * 32, 2)
    gate_up_mma_kernel(MoeExperts m, XSpec X, const int* ids, int k, float* act, const int* halt, FastDiv by_rbe) {
  extern __shared__ uint4 smem_u4[];
  __shared__ float red[2][T * kWarps][16];
  const int H = m.gate_up.cols, G = H / 64, lane = threadIdx.x & 31, g0 = (threadIdx.x >> 5) * GPW;
  const int I = m.inter, rbe = 2 * I / 16, n_shared = 2 * m.shared_inter / 16, act_stride = k * I + m.shared_inter;
  const int grid = static_cast<int>(gridDim.x);
  const int t_out = T == 1 ? 0 : threadIdx.x >> 3, r_out = threadIdx.x & 7;  // threads < 8 T: token, output row
  const MmaStage st = mma_stage(smem_u4, H, T);
  int it = 0;  // row blocks done: red[it & 1] alternates between them
  // SiLU(gate) * up of one row block for every token: token t's 8 outputs go to act row t
  // at out(t) (< 0: t does not use this row block); mark: the first routed one.
  auto finish = [&](const MmaTiles<GPW>& tiles, const MmaRows& xr, auto out, bool mark) {
    float y0 = 0.0f, y1 = 0.0f;
    tiles.accumulate(g0, G, g0, xr.xf, xr.xsum, lane, y0, y1);
    if (mark) timeline_mark(1);
    put_rows16<T>(red[it & 1], y0, y1);
    __syncthreads();
    if (threadIdx.x < 8 * T) {
      const int o = out(t_out);
      const float (*rt)[16] = red[it & 1] + t_out * kWarps;
      const float g = row_total(rt, r_out), u = row_total(rt, r_out + 8);
      if (T == 1 || o >= 0) act[t_out * act_stride + o + r_out] = siluf_(g) * u;
    }
    ++it;
  };

  // A halted step writes nothing (decode_ctl.h); the flag may be read before the wait.
  const bool halted = halt && __ldcg(halt);
  MmaTiles<GPW> next;
  int rb = blockIdx.x;
  if (rb < n_shared) next.load(m.shared_gate_up, rb, g0, G, lane);
  stage_x_mma<T>(X, H, st);
  const MmaRows xr = mma_rows<T>(st, H, lane);
  for (; !halted && rb < n_shared; rb += grid) {
    const MmaTiles<GPW> cur = next;
    if (rb + grid < n_shared) next.load(m.shared_gate_up, rb + grid, g0, G, lane);
    finish(cur, xr, [&](int) { return k * I + 8 * rb; }, false);
  }

  if (wait_halted(halt)) return;
  timeline_mark(0);
  static_assert(kMoeMaxTopK <= 32, "a lane per (token, slot)");
  // The routed tasks, (expert u, row block): expert(u) is u's id, slots(u, slot) where each
  // token has it (-1: not chosen).
  // Their tiles: one token's through the warp's ring (over the raw x, free once x is staged),
  // so the next task's loads start before this one's arrive; several tokens' in registers,
  // one task ahead (the ring measured slower there: perf-log §17).
  using Ring = MmaTileRing<GPW, kGateUpRing>;
  Ring ring(st.raw + (threadIdx.x >> 5) * Ring::kBytes / 4);
  auto walk = [&](int routed, auto expert, auto slots) {
    auto row_block = [&](int task) {
      const int u = by_rbe.div(task);
      return expert(u) * rbe + by_rbe.mod(task, u);
    };
    auto load = [&](int i) {  // the block's i-th task (into slot i % S)
      const int task = blockIdx.x + i * grid;
      if constexpr (T == 1) ring.load(i % kGateUpRing, task < routed, m.gate_up, task < routed ? row_block(task) : 0, g0, G, lane);
      else if (task < routed) next.load(m.gate_up, row_block(task), g0, G, lane);
    };
    for (int i = 0; i < (T == 1 ? kGateUpRing - 1 : 1); ++i) load(i);
    int task = blockIdx.x;
    for (int i = 0; task < routed; task += grid, ++i) {
      MmaTiles<GPW> cur;
      if constexpr (T == 1) {  // slot (i - 1) % S was read before the previous task's barrier (finish)
        load(i + kGateUpRing - 1);
        cp_async_wait<kGateUpRing - 1>();
        __syncwarp();
        cur = ring.tiles(i % kGateUpRing, g0, G, lane);
      } else {
        cur = next;
        load(i + 1);
      }
      int slot[T];
      const int u = by_rbe.div(task);
      slots(u, slot);
      const int r8 = 8 * by_rbe.mod(task, u);
      finish(cur, xr, [&](int t) {
        int s = -1;
#pragma unroll
        for (int i = 0; i < T; ++i)
          if (i == t) s = slot[i];
        return s < 0 ? -1 : s * I + r8;
      }, task == static_cast<int>(blockIdx.x));
    }
  };
  if constexpr (T == 1) {
    // Lane i holds slot i's expert (k <= kMoeMaxTopK <= 32), read through L2 (the router wrote
    // it); tasks are block-uniform, so every warp shuffles the one it needs without a block barrier.
    const int lane_expert = __ldcg(ids + min(lane, k - 1));
    walk(k * rbe, [&](int u) { return __shfl_sync(0xffffffffu, lane_expert, u); }, [](int u, int (&slot)[T]) { slot[0] = u; });
  } else {
    // Lane u < n: union expert u's id, and the slot where each token has it (8 bits a token,
    // 0xFF: none), so a task's lookups are two shuffles. The XOR sets a byte once: top-k gives
    // a token each expert at most once.
    const ExpertUnion<T> un(ids, k, m.n_experts);
    const int lane_expert = un.expert(min(lane, un.n - 1));
    uint32_t lane_slots = 0xFFFFFFFFu;
#pragma unroll
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j)
        if (__shfl_sync(0xffffffffu, un.lane_u, t * k + j) == lane) lane_slots ^= (0xFFu ^ j) << (8 * t);
    walk(un.n * rbe, [&](int u) { return __shfl_sync(0xffffffffu, lane_expert, u); }, [&](int u, int (&slot)[T]) {
      const uint32_t slots = __shfl_sync(0xffffffffu, lane_slots, u);
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const int j = (slots >> (8 * t)) & 0xFF;
        slot[t] = j == 0xFF ? -1 : j;
      }
    });
  }
  timeline_done();
}

// gate_up_mma_kernel's dynamic shared memory: the staged x rows, for one token their raw part
// (from mma_stage's raw on) overlaid by the warps' tile rings.
template <int GPW, int T>
size_t gate_up_mma_smem_bytes(int H) {
  const size_t raw = static_cast<size_t>(T) * (H * 4 + mma_sum_stride(H) * 4);
  if (T > 1) return stage_mma_bytes(H, T);
  return std::max(stage_mma_bytes(H, T), raw + kWarps * MmaTileRing<GPW, kGateUpRing>::kBytes);
}

// Tensor-core down + combine: block task = 16 output rows. Pairs are (expert, group of 64
// inputs): the groups of the union's routed experts (above), then the shared expert's;
// warp w takes pairs w, w + WARPS, ..., U at a time, one tile each (the first U before the
// wait), every token's B columns from its own activations. A pair's partial [T][16] goes to
// shared memory; then a warp per output row sums weight x partial over its token's pairs
// q (slot-major: q = slot * I/64 + group, the shared expert's after the k slots), lane L
// the q = L mod 32 in order, then the warp's butterfly: a token's sum depends neither on
// the warps nor on which tokens share the step. act: [T][k I + Is]; h: [T][H]. One token
// takes all its pairs in one go (U * WARPS >= k I / 64 + Is / 64).
template <int U>
struct PairTiles {
  uint4 c[U];
  uint32_t s0[U], s1[U];
};

template <int WARPS, int U, int T>
__global__ void __launch_bounds__(WARPS * 32, 1)
    down_mma_kernel(MoeExperts m, const float* act, const int* ids, const float* weights, const float* shared_gate,
                    int k, float* h, int* pos_inc, const int* halt, FastDiv by_gI) {
  extern __shared__ uint4 smem_u4[];
  const int I = m.inter, Is = m.shared_inter, H = m.shared_down.rows, n_rb = H / 16;
  const int gI = I / 64, gS = Is / 64, cols = k * I + Is;
  const MmaStage st = mma_stage(smem_u4, cols, T);
  float* part = st.scratch + 32 * T;  // [pairs][T][16]
  __shared__ int s_ids[kMoeMaxTopK];                     // one token: its experts
  __shared__ int s_union[kMoeMaxTopK * kMaxStepRows];  // token t's slot j -> union index (t k + j)
  __shared__ float s_w[kMaxStepRows][kMoeMaxTopK + 1];  // routing weights, the shared gate last
  // Several tokens: union expert u's id, and each token's slot holding it (-1: none), so a
  // pair's lookups are shared loads, not the union's shuffles and ballots (perf-log §15).
  __shared__ int s_expert[kMoeMaxTopK * kMaxStepRows];
  __shared__ int s_slot[kMoeMaxTopK * kMaxStepRows][kMaxStepRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int kOuts = (16 * T + WARPS - 1) / WARPS;  // output rows a warp sums: 16 T in all

  // The routing (written by the router, two launches back) before the wait, through L2.
  const ExpertUnion<T> un(ids, k, m.n_experts);
  if (threadIdx.x < T * k) {
    s_union[threadIdx.x] = un.lane_u;
    s_w[threadIdx.x / k][threadIdx.x % k] = __ldcg(weights + threadIdx.x);
    if (T == 1) s_ids[threadIdx.x] = un.lane_id;
  }
  if (threadIdx.x < T) s_w[threadIdx.x][k] = __ldcg(shared_gate + threadIdx.x);
  if (T > 1 && warp == 0) {
    for (int i = lane; i < kMoeMaxTopK * kMaxStepRows * kMaxStepRows; i += 32) (&s_slot[0][0])[i] = -1;
    __syncwarp();
    if (lane < T * k) {  // lane = token t's slot j (t k + j); token t takes each expert once
      s_slot[un.lane_u][lane / k] = lane % k;
      if ((un.first >> lane) & 1u) s_expert[un.lane_u] = un.lane_id;
    }
  }
  __syncthreads();
  const int routed = un.n * gI, n_pairs = routed + gS;
  // Pair p's expert index x (un.n: the shared expert) and group.
  auto pair_of = [&](int p, int& x, int& g) {
    x = p < routed ? by_gI.div(p) : un.n;
    g = p < routed ? p - x * gI : p - routed;
  };
  auto expert = [&](int x) { return T == 1 ? s_ids[x] : s_expert[x]; };
  // Chunk j of this warp's pairs for row block rb.
  auto load = [&](PairTiles<U>& tl, int j, int rb) {
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int p = warp + WARPS * (U * j + i);
      if (p < n_pairs) {
        int x, g;
        pair_of(p, x, g);
        const bool shared = x == un.n;
        const QMat& W = shared ? m.shared_down : m.down;
        const size_t t = static_cast<size_t>(shared ? rb : expert(x) * n_rb + rb) * (shared ? gS : gI) + g;
        tl.c[i] = load_stream(W.codes + t * 32 + lane);
        tl.s0[i] = __ldg(W.sb + t * 16 + (lane >> 2));
        tl.s1[i] = __ldg(W.sb + t * 16 + (lane >> 2) + 8);
      }
    }
  };
  PairTiles<U> cur;
  int rb = blockIdx.x;
  if (rb < n_rb) load(cur, 0, rb);
  // The residual rows of the first row block this warp sums, read before the wait (h was
  // last written by the out-projection, three launches back): their round trip leaves the tail.
  float resid0[kOuts];
#pragma unroll
  for (int i = 0; i < kOuts; ++i) {
    const int o = warp + WARPS * i;
    resid0[i] = o < 16 * T && rb < n_rb && lane == 0 ? __ldcg(h + static_cast<size_t>(o >> 4) * H + rb * 16 + (o & 15)) : 0.0f;
  }
  if (wait_halted(halt)) return;
  XSpec X;
  X.x = act;
  stage_x_mma<T>(X, cols, st);
  timeline_mark(0);
  const int tb = min(lane >> 3, T - 1), tc = lane & 3;  // the lane's B row (token) and C row
  const uint4* xf = st.xf + static_cast<size_t>(tb) * cols / 4;
  const float* xsum = st.xsum + min(tc, T - 1) * mma_sum_stride(cols);
  // One token: pair p is group p of its concatenated activations (slot-major), so the
  // lane's terms q = lane + 32 i of the combine are pairs q with weights known already.
  constexpr int kTerms = T == 1 ? 10 * kMoeDownMaxWarps / 32 : 1;  // pairs <= 10 a warp (moe_down_decode)
  float q_w[kTerms];
  if constexpr (T == 1)
#pragma unroll
    for (int i = 0; i < kTerms; ++i) {
      const int q = lane + 32 * i;
      q_w[i] = q < routed ? s_w[0][by_gI.div(q)] : q < n_pairs ? s_w[0][k] : 0.0f;
    }
  for (int iter = 0; rb < n_rb; rb += gridDim.x, ++iter) {
    for (int j = 0; warp + WARPS * U * j < n_pairs; ++j) {
      PairTiles<U> nxt;
      const bool more = T > 1 && warp + WARPS * U * (j + 1) < n_pairs;
      if constexpr (T > 1)
        if (more) load(nxt, j + 1, rb);
#pragma unroll
      for (int i = 0; i < U; ++i) {
        const int p = warp + WARPS * (U * j + i);
        if (p < n_pairs) {
          // The group each token's B / C row takes: its slot's (any slot where it has none:
          // its column is then not kept), or the shared expert's after the k slots.
          int gb = p, gc = p, sc = 0;
          if constexpr (T > 1) {
            int x, g;
            pair_of(p, x, g);
            int sb = k;
            sc = k;
            if (x < un.n) {
              sb = max(s_slot[x][tb], 0);
              sc = s_slot[x][min(tc, T - 1)];
            }
            gb = sb * gI + g;
            gc = max(sc, 0) * gI + g;
          }
          const float2 v = group_mma(cur.c[i], xf, gb, lane);
          const float xs = xsum[gc];
          if (tc < T && sc >= 0) {
            float* dst = part + (static_cast<size_t>(p) * T + tc) * 16;
            dst[lane >> 2] = group_term(cur.s0[i], v.x, xs);
            dst[(lane >> 2) + 8] = group_term(cur.s1[i], v.y, xs);
          }
        }
      }
      if (iter == 0 && j == 0) timeline_mark(1);
      if constexpr (T > 1) {
        if (!more) break;
        cur = nxt;
      }
    }
    __syncthreads();
    const int n_q = k * gI + gS;
#pragma unroll
    for (int i = 0; i < kOuts; ++i) {
      const int o = warp + WARPS * i, t = o >> 4, r = o & 15;
      if (o < 16 * T) {
        float y = 0.0f;
        if constexpr (T == 1) {
#pragma unroll
          for (int j = 0; j < kTerms; ++j)
            if (lane + 32 * j < n_q) y = fmaf(q_w[j], part[(lane + 32 * j) * 16 + r], y);
        } else {
          for (int q = lane; q < n_q; q += 32) {
            const int j = q < k * gI ? by_gI.div(q) : k, g = q < k * gI ? q - j * gI : q - k * gI;
            const int p = j < k ? s_union[t * k + j] * gI + g : routed + g;
            y = fmaf(s_w[t][j], part[(p * T + t) * 16 + r], y);
          }
        }
        y = warp_sum(y);
        if (lane == 0) {
          float* dst = h + static_cast<size_t>(t) * H + rb * 16 + r;
          *dst = (iter == 0 ? resid0[i] : *dst) + y;
        }
      }
    }
    if (rb + static_cast<int>(gridDim.x) < n_rb) {
      __syncthreads();  // the partials are rewritten by the next row block
      load(cur, 0, rb + gridDim.x);
    }
  }
  if (pos_inc && blockIdx.x == 0 && threadIdx.x == 0) *pos_inc += T;
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
  if (chunks <= 32) launch("moe_gate_up_decode", gate_up_kernel<BITS, 1>, dim3(grid), dim3(kWarps * 32), smem, stream, m, X, ids, k, act, halt);
  else if (chunks <= 64) launch("moe_gate_up_decode", gate_up_kernel<BITS, 2>, dim3(grid), dim3(kWarps * 32), smem, stream, m, X, ids, k, act, halt);
  else launch("moe_gate_up_decode", gate_up_kernel<BITS, 4>, dim3(grid), dim3(kWarps * 32), smem, stream, m, X, ids, k, act, halt);
}

template <int BITS>
void launch_down(const MoeExperts& m, const float* act, const int* ids, const float* weights, const float* shared_gate,
                 int k, float* h, int* pos_inc, const int* halt, cudaStream_t stream) {
  const int H = m.shared_down.rows, cols = k * m.inter + m.shared_inter;
  const int n_chunks = cols / cols_per_chunk<BITS>();
  const size_t smem = stage_bytes<BITS>(cols);
  if (smem > 48 * 1024) fail("moe_down_decode: expert width too large for the staged activations");
  const int grid = std::min((H + kWarps - 1) / kWarps, 2 * sm_count());
#define LILY_DOWN(U)                                                                                                  \
  launch("moe_down_decode", down_kernel<BITS, U>, dim3(grid), dim3(kWarps * 32), smem, stream, m, act, ids, weights, shared_gate, \
         k, h, pos_inc, halt)
  if (n_chunks <= 64) LILY_DOWN(2);
  else if (n_chunks <= 160) LILY_DOWN(5);
  else if (n_chunks <= 320) LILY_DOWN(10);
  else fail("moe_down_decode: ", std::to_string(n_chunks), " chunks per row are more than supported (320)");
#undef LILY_DOWN
}

}  // namespace

int moe_down_decode_warps(int hidden) { return hidden / 16 <= sm_count() ? kMoeDownMaxWarps : kWarps; }

bool tiled(const MoeExperts& m) {
  return m.gate_up.tiled && m.down.tiled && m.shared_gate_up.tiled && m.shared_down.tiled;
}

// Several rows (tokens) need the tensor-core kernels, and every (token, slot) a lane of the
// expert union (k * rows <= 32).
static void check_rows(const MoeExperts& m, int k, int rows, const char* op) {
  if (rows < 1 || rows > kMaxStepRows)
    fail(op, ": ", std::to_string(rows), " rows; a step takes 1 to ", std::to_string(kMaxStepRows));
  if (rows > 1 && !tiled(m)) fail(op, ": ", std::to_string(rows), " rows need tiled (tensor-core) expert weights");
  if (k * rows > 32) fail(op, ": top_k ", std::to_string(k), " x ", std::to_string(rows), " rows is more than 32 (token, slot) pairs");
}

void moe_gate_up_decode(const MoeExperts& m, const XSpec& X, const int* ids, int top_k, float* act, const int* halt,
                 cudaStream_t stream, int rows) {
  check_shapes(m, top_k);
  check_rows(m, top_k, rows, "moe_gate_up_decode");
  if (tiled(m)) {
    // Routed and shared row blocks come on either side of the wait: a block per row block
    // of the larger set (the routed ones of up to rows * k experts), at most two per SM.
    const int H = m.gate_up.cols, routed = rows * top_k * 2 * m.inter / 16, shared = 2 * m.shared_inter / 16;
    const int grid = std::min(std::max(routed, shared), 2 * sm_count());
    with_step_rows("moe_gate_up_decode", rows, [&](auto t) {
      with_groups_per_warp(H, kWarps, "moe_gate_up_decode", [&](auto gpw) {
        auto kernel = gate_up_mma_kernel<gpw, t>;
        const size_t smem = gate_up_mma_smem_bytes<gpw, t>(H);
        allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, "moe_gate_up_decode: set smem");
        launch("moe_gate_up_decode (tensor cores)", kernel, dim3(grid), dim3(kWarps * 32), smem, stream, m, X, ids, top_k, act, halt,
               FastDiv(2 * m.inter / 16));
      });
    });
    return;
  }
  if (m.gate_up.bits == 4) launch_gate_up<4>(m, X, ids, top_k, act, halt, stream);
  else if (m.gate_up.bits == 8) launch_gate_up<8>(m, X, ids, top_k, act, halt, stream);
  else fail("moe_gate_up_decode: unsupported bit width ", std::to_string(m.gate_up.bits));
}

size_t moe_gate_up_decode_smem_bytes(const MoeExperts& m, int rows) {
  const int H = m.gate_up.cols;
  if (!tiled(m)) return m.gate_up.bits == 8 ? stage_bytes<8>(H) : stage_bytes<4>(H);
  size_t bytes = 0;
  with_step_rows("moe_gate_up_decode", rows, [&](auto t) {
    with_groups_per_warp(H, kWarps, "moe_gate_up_decode", [&](auto gpw) { bytes = gate_up_mma_smem_bytes<gpw, t>(H); });
  });
  return bytes;
}

size_t moe_down_decode_smem_bytes(const MoeExperts& m, int top_k, int rows) {
  const size_t pairs = static_cast<size_t>(rows) * top_k * (m.inter / 64) + m.shared_inter / 64;
  return stage_mma_bytes(top_k * m.inter + m.shared_inter, rows) + pairs * rows * 16 * 4;
}

void moe_down_decode(const MoeExperts& m, const float* act, const int* ids, const float* weights, const float* shared_gate,
              int top_k, float* h, int* pos_inc, const int* halt, cudaStream_t stream, int rows) {
  check_shapes(m, top_k);
  check_rows(m, top_k, rows, "moe_down_decode");
  if (tiled(m)) {
    const int H = m.shared_down.rows, n_rb = H / 16;
    const int warps = moe_down_decode_warps(H), grid = std::min(n_rb, 2 * sm_count());
    const size_t smem = moe_down_decode_smem_bytes(m, top_k, rows);
    // One row takes its (slot, group) pairs in one go, U a warp (registers: a kernel of the
    // next layer fits beside it); several rows walk theirs 5 a warp at a time.
    const int pairs = top_k * (m.inter / 64) + m.shared_inter / 64, u = (pairs + warps - 1) / warps;
    if (rows == 1 && u > 10)
      fail("moe_down_decode: more than ", std::to_string(10 * warps), " (slot, group) pairs are not supported with tiled weights");
    auto run = [&](auto kernel, int threads) {
      allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, "moe_down_decode: set smem");
      launch("moe_down_decode (tensor cores)", kernel, dim3(grid), dim3(threads), smem, stream, m, act, ids, weights, shared_gate,
             top_k, h, pos_inc, halt, FastDiv(m.inter / 64));
    };
    auto with_warps = [&](auto w) {
      constexpr int W = decltype(w)::value;
      if (rows > 1) {
        with_step_rows("moe_down_decode", rows, [&](auto t) {
          if constexpr (decltype(t)::value > 1) run(down_mma_kernel<W, 5, decltype(t)::value>, W * 32);
        });
      } else if (u <= 2) run(down_mma_kernel<W, 2, 1>, W * 32);
      else if (u <= 5) run(down_mma_kernel<W, 5, 1>, W * 32);
      else run(down_mma_kernel<W, 10, 1>, W * 32);
    };
    if (warps == kMoeDownMaxWarps) with_warps(std::integral_constant<int, kMoeDownMaxWarps>{});
    else with_warps(std::integral_constant<int, kWarps>{});
    return;
  }
  if (m.down.bits == 4) launch_down<4>(m, act, ids, weights, shared_gate, top_k, h, pos_inc, halt, stream);
  else if (m.down.bits == 8) launch_down<8>(m, act, ids, weights, shared_gate, top_k, h, pos_inc, halt, stream);
  else fail("moe_down_decode: unsupported bit width ", std::to_string(m.down.bits));
}

}  // namespace lily::cuda
