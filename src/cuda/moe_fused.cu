#include "moe_fused.h"

#include <algorithm>
#include <cfloat>

#include "gemv_core.cuh"
#include "grid_barrier.cuh"
#include "moe_experts.h"
#include "moe_topk.cuh"
#include "qmma.cuh"

namespace lily::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kBlocksPerSm = 2;          // more blocks: more loads in flight per phase
constexpr size_t kMaxSmem = 64 * 1024;   // occupancy is queried at this size (a lower bound)

// Shared memory: one staging region reused by the phases (router x, then the gate/up x
// fragments, then the activation fragments), then the routing scratch.
struct Fixed {
  float red[2][kMoeDownMaxWarps][16];
  int ids[kMoeMaxTopK];
  float w[kMoeMaxTopK + 1];
};

__host__ __device__ constexpr size_t align16(size_t n) { return (n + 15) / 16 * 16; }

__host__ __device__ constexpr size_t stage_region_bytes(int H, int cols3) {
  const size_t a = stage_bytes<8>(H), b = stage_mma_bytes(H), c = stage_mma_bytes(cols3);
  return align16(a > b ? (a > c ? a : c) : (b > c ? b : c));
}

__host__ __device__ constexpr size_t fused_smem_bytes(int H, int cols3, int E) {
  return stage_region_bytes(H, cols3) + route_smem_bytes(E) + align16(sizeof(Fixed));
}

// Router rows: one warp per row (U chunks per lane per step, as moe_router). Gate/up:
// task = 16-row block (8 gate + 8 up rows), warps split the groups GPW each, as
// moe_gate_up; shared-expert tasks first so that their tiles can be loaded before the
// routing is known. Down: task = 16 output rows, warps take (slot, group) pairs, DU
// each; warp w keeps V sums (pairs w + 8v, w + 8v + 8V, ...), so that the row totals over
// the 8V sums add the pairs in moe_down's order with its 8V warps (moe_down_warps).
template <int GPW, int DU, int V>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm)
    moe_fused_kernel(QMat R, MoeExperts m, XSpec X, int E, int k, int norm_topk, MoeFusedScratch s, float* h,
                     int* pos_inc, const int* halt) {
  constexpr int RU = 4;
  extern __shared__ uint4 smem_u4[];
  const int H = m.gate_up.cols, G = H / 64, I = m.inter, Is = m.shared_inter;
  const int cols3 = k * I + Is, P = cols3 / 64, n_rb = H / 16;
  unsigned char* base = reinterpret_cast<unsigned char*>(smem_u4);
  float* logits = reinterpret_cast<float*>(base + stage_region_bytes(H, cols3));  // [E + 1]
  Fixed& f = *reinterpret_cast<Fixed*>(base + stage_region_bytes(H, cols3) + route_smem_bytes(E));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g0 = warp * GPW;
  GridBarrier bar{s.sync};

  // Weights are constant: load the first router tile, and the first gate/up tile when it
  // belongs to the shared expert, before waiting on the previous kernel.
  auto R_of = [&](int) -> const QMat& { return R; };
  auto row_of = [&](int g, int (&row)[1]) { row[0] = g; };
  RowWalk<8, 1, RU> walk(blockIdx.x + gridDim.x * warp, gridDim.x * kWarps, R.rows, R.chunks());
  walk.prefetch(R_of, row_of, lane);
  const int n_shared = 2 * Is / 16, rbe = 2 * I / 16, n_tasks = n_shared + k * rbe;
  int task = blockIdx.x;
  MmaTiles<GPW> next;
  if (task < n_shared) next.load(m.shared_gate_up, task, g0, G, lane);
  if (wait_halted(halt)) return;  // uniform over the grid: every block leaves before any barrier

  // Phase 1: router logits.
  {
    float4* xs = reinterpret_cast<float4*>(base);
    float* xsum = reinterpret_cast<float*>(xs + H / 4);
    stage_x<8>(X, H, xs, xsum, xsum + H / cols_per_chunk<8>());
    walk.run(R_of, row_of, xs, xsum, lane, [&](int g, const float (&acc)[1]) {
      if (lane == 0) s.logits[g] = acc[0];
    });
  }
  bar.arrive();
  // x again, in the tensor-core fragment layout, while the other blocks finish phase 1.
  uint4* xf = smem_u4;
  float* xsum = reinterpret_cast<float*>(xf + H / 4);
  {
    float* raw = xsum + (G + 3) / 4 * 4;
    stage_x_mma(X, H, xf, xsum, raw, raw + H);
  }
  bar.wait();

  // Phase 2: routing (every block), then gate/up.
  if (warp == 0) {  // the logits come from every block: through L2
    for (int e = lane; e <= E; e += 32) logits[e] = __ldcg(s.logits + e);
    __syncwarp();
    route_topk(logits, E, k, norm_topk != 0, f.ids, f.w, f.w + k);
  }
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x <= k) {
    if (threadIdx.x < k) {
      s.ids[threadIdx.x] = f.ids[threadIdx.x];
      s.weights[threadIdx.x] = f.w[threadIdx.x];
    } else {
      *s.shared_gate = f.w[k];
    }
  }
  auto tile_of = [&](int t, int& rb) -> const QMat& {
    if (t < n_shared) {
      rb = t;
      return m.shared_gate_up;
    }
    const int r = t - n_shared;
    rb = f.ids[r / rbe] * rbe + r % rbe;
    return m.gate_up;
  };
  auto load_task = [&](int t) {  // tile_of sets rb: call it before rb is read
    int rb = 0;
    const QMat& W = tile_of(t, rb);
    next.load(W, rb, g0, G, lane);
  };
  if (task >= n_shared && task < n_tasks) load_task(task);
  for (int it = 0; task < n_tasks; task += gridDim.x, ++it) {
    const MmaTiles<GPW> cur = next;
    const int nt = task + gridDim.x;
    if (nt < n_tasks) load_task(nt);
    float y0 = 0.0f, y1 = 0.0f;
    cur.accumulate(g0, G, g0, xf, xsum, lane, y0, y1);
    put_rows16(f.red[it & 1], y0, y1);
    __syncthreads();
    if (threadIdx.x < 8) {
      const float gate = row_total(f.red[it & 1], threadIdx.x), up = row_total(f.red[it & 1], threadIdx.x + 8);
      const int r = task - n_shared;
      const int out = task < n_shared ? k * I + 8 * task : (r / rbe) * I + 8 * (r % rbe);
      s.act[out + threadIdx.x] = siluf_(gate) * up;
    }
  }
  bar.arrive();

  // Phase 3: down + combine. The first tile depends only on the routing: load it while
  // waiting for the activations.
  const int gI = I / 64, gS = Is / 64;
  uint4 c[DU];
  uint32_t s0[DU], s1[DU];
  auto load = [&](int rb3) {
#pragma unroll
    for (int i = 0; i < DU; ++i) {
      const int pr = warp + kWarps * i;
      if (pr < P) {
        const bool shared = pr >= k * gI;
        const int slot = shared ? k : pr / gI, gi = shared ? pr - k * gI : pr - slot * gI;
        const QMat& W = shared ? m.shared_down : m.down;
        const size_t t = static_cast<size_t>(shared ? rb3 : f.ids[slot] * n_rb + rb3) * (shared ? gS : gI) + gi;
        c[i] = load_stream(W.codes + t * 32 + lane);
        s0[i] = __ldg(W.sb + t * 16 + (lane >> 2));
        s1[i] = __ldg(W.sb + t * 16 + (lane >> 2) + 8);
      }
    }
  };
  int rb3 = blockIdx.x;
  if (rb3 < n_rb) load(rb3);
  bar.wait();
  // (The next kernel was triggered at the wait: it launches only once every block of this
  // grid has triggered, i.e. is resident, so its blocks cannot keep the barriers from opening.)
  timeline_done();
  if (rb3 >= n_rb) return;

  // The activations come from other blocks (build_x reads x through L2).
  {
    float* xsum3 = reinterpret_cast<float*>(xf + cols3 / 4);
    float* raw = xsum3 + (P + 3) / 4 * 4;
    XSpec A;
    A.x = s.act;
    stage_x_mma(A, cols3, xf, xsum3, raw, raw + cols3);
  }
  const float* xsum3 = reinterpret_cast<const float*>(xf + cols3 / 4);
  for (int it = 0; rb3 < n_rb; rb3 += gridDim.x, ++it) {
    float y0[V] = {}, y1[V] = {};
#pragma unroll
    for (int i = 0; i < DU; ++i) {
      const int pr = warp + kWarps * i;
      if (pr < P) {
        const float2 v = group_mma(c[i], xf, pr, lane);
        const float wgt = f.w[pr >= k * gI ? k : pr / gI], xs = xsum3[pr];
        y0[i % V] = fmaf(wgt, group_term(s0[i], v.x, xs), y0[i % V]);
        y1[i % V] = fmaf(wgt, group_term(s1[i], v.y, xs), y1[i % V]);
      }
    }
    if (rb3 + static_cast<int>(gridDim.x) < n_rb) load(rb3 + gridDim.x);
#pragma unroll
    for (int v = 0; v < V; ++v) put_rows16(f.red[it & 1] + kWarps * v, y0[v], y1[v]);
    __syncthreads();
    const float y = threadIdx.x < 16 ? row_total(f.red[it & 1], threadIdx.x, kWarps * V) : 0.0f;
    if (threadIdx.x < 16) h[rb3 * 16 + threadIdx.x] = __ldcg(h + rb3 * 16 + threadIdx.x) + y;
  }
  if (pos_inc && blockIdx.x == 0 && threadIdx.x == 0) *pos_inc += 1;
}

template <int GPW, int DU, int V>
void launch_fused(const QMat& R, const MoeExperts& m, const XSpec& X, int E, int k, bool norm_topk,
                  const MoeFusedScratch& s, float* h, int* pos_inc, const int* halt, cudaStream_t stream) {
  auto kernel = moe_fused_kernel<GPW, DU, V>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), kMaxSmem, "moe_fused: set smem");
  static const int blocks_per_sm = [&] {
    int n = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kWarps * 32, kMaxSmem), "moe_fused: occupancy");
    return n;
  }();
  if (blocks_per_sm < 1) fail("moe_fused: the kernel does not fit on a multiprocessor");
  const int H = m.gate_up.cols, cols3 = k * m.inter + m.shared_inter;
  const int tasks = std::max({2 * m.shared_inter / 16 + k * 2 * m.inter / 16, H / 16, (E + 1 + kWarps - 1) / kWarps});
  // Every block must be resident at once (grid barriers): at most what the device holds.
  const int grid = std::min(tasks, std::min(blocks_per_sm, kBlocksPerSm) * sm_count());
  launch("moe_fused", kernel, dim3(grid), dim3(kWarps * 32), fused_smem_bytes(H, cols3, E), stream, R, m, X, E, k,
         int(norm_topk), s, h, pos_inc, halt);
}

}  // namespace

void moe_fused(const QMat& router, const MoeExperts& m, const XSpec& X, int top_k, bool norm_topk,
               const MoeFusedScratch& s, float* h, int* pos_inc, const int* halt, cudaStream_t stream) {
  const int E = m.n_experts, H = m.gate_up.cols, I = m.inter, Is = m.shared_inter, k = top_k;
  if (!(m.gate_up.tiled && m.down.tiled && m.shared_gate_up.tiled && m.shared_down.tiled))
    fail("moe_fused: expert weights must be in the tiled tensor-core layout");
  if (router.tiled || router.bits != 8) fail("moe_fused: the router must be 8-bit in the MLX row layout");
  if (router.rows != E + 1) fail("moe_fused: router must hold E router rows plus the shared-expert gate row");
  if (router.cols != H || m.shared_gate_up.cols != H || m.shared_down.rows != H)
    fail("moe_fused: router and expert matrices disagree on the hidden size");
  if (H % 64 != 0 || H > 4096) fail("moe_fused: hidden size must be a multiple of 64, at most 4096");
  if (I % 64 != 0 || Is % 64 != 0) fail("moe_fused: expert widths must be multiples of 64");
  if (m.gate_up.rows != E * 2 * I || m.down.rows != E * H || m.down.cols != I || m.shared_gate_up.rows != 2 * Is ||
      m.shared_down.cols != Is)
    fail("moe_fused: expert matrix shapes do not match E, I, Is and the hidden size");
  if (E > kMoeMaxExperts) fail("moe_fused: more than ", std::to_string(kMoeMaxExperts), " experts");
  if (k < 1 || k > kMoeMaxTopK || k > E) fail("moe_fused: top_k must be in [1, ", std::to_string(kMoeMaxTopK), "] and <= E");
  if (!s.logits || !s.ids || !s.weights || !s.shared_gate || !s.act || !s.sync || !h)
    fail("moe_fused: missing scratch or output pointer");
  if (reinterpret_cast<uintptr_t>(s.act) % 16 != 0) fail("moe_fused: act must be 16-byte aligned");
  const int cols3 = k * I + Is;
  if (fused_smem_bytes(H, cols3, E) > kMaxSmem)
    fail("moe_fused: ", std::to_string(fused_smem_bytes(H, cols3, E)), " bytes of shared memory needed, more than ",
         std::to_string(kMaxSmem));
  const int du = (cols3 / 64 + kWarps - 1) / kWarps;
  if (du > 10) fail("moe_fused: more than 80 (slot, group) pairs in the down projection are not supported");
  // GPW is moe_gate_up's choice (it sets which warp sums which groups: the same order).
  // V sums a warp reproduce moe_down's order with its V x 8 warps (Fixed::red holds them).
  const int dw = moe_down_warps(H), V = dw / kWarps;
  static_assert(kMoeDownMaxWarps == 2 * kWarps, "moe_fused follows moe_down with 1 or 2 sums a warp");
  if (dw % kWarps != 0 || V < 1 || V > 2)
    fail("moe_fused: cannot follow moe_down's order with ", std::to_string(dw), " warps a block");
  with_groups_per_warp(H, kWarps, "moe_fused", [&](auto gpw) {
    auto go = [&](auto du) {
      if (V == 1) launch_fused<gpw, du, 1>(router, m, X, E, k, norm_topk, s, h, pos_inc, halt, stream);
      else launch_fused<gpw, du, 2>(router, m, X, E, k, norm_topk, s, h, pos_inc, halt, stream);
    };
    if (du <= 2) go(std::integral_constant<int, 2>{});
    else go(std::integral_constant<int, 10>{});
  });
}

}  // namespace lily::cuda
