#include "gdn_fused.h"

#include <cooperative_groups.h>

#include "device_common.cuh"
#include "gdn_step.cuh"
#include "qmma.cuh"

namespace lily::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
// Phase 1 runs as two independent halves of 8 warps, each a chain of row blocks with one
// in flight ahead (named barriers 1 and 2), as two 256-thread blocks on one multiprocessor
// would: the in-projection's row blocks are as many per multiprocessor as in gemv.
constexpr int kHalfWarps = kWarps / 2;
constexpr int kMaxDk = 128;
constexpr int kLanesPerColumn = 16;  // recurrence: 16 threads share a value column, Dk/16 keys each
constexpr int kMaxCluster = 16;

// The in-projection rows of key head kh. Projection rows (GdnArgs::proj order):
// q [Hk*Dk] | k [Hk*Dk] | v [Hv*Dv] | z [Hv*Dv] | b [Hv] | a [Hv]. The head's local copy:
// q [Dk] | k [Dk] | v [R*Dv] | z [R*Dv] | b [R] | a [R] for its R = Hv/Hk value heads.
struct HeadRows {
  int kh, Hk, Hv, Dk, Dv, R;

  __device__ int conv_dim() const { return 2 * Hk * Dk + Hv * Dv; }
  __device__ int b_row() const { return conv_dim() + Hv * Dv + kh * R; }  // first b row of kh
  __device__ int a_row() const { return b_row() + Hv; }
  // 16-row blocks: q, k (Dk/16 each), v, z (R*Dv/16 each), then the b block and (when
  // apart) the a block.
  __device__ int n_blocks() const { return 2 * (Dk / 16) + 2 * (R * Dv / 16) + (a_row() / 16 != b_row() / 16 ? 2 : 1); }
  __device__ int block(int e) const {
    const int nq = Dk / 16, nv = R * Dv / 16;
    if (e < nq) return kh * Dk / 16 + e;
    if ((e -= nq) < nq) return (Hk + kh) * Dk / 16 + e;
    if ((e -= nq) < nv) return (2 * Hk * Dk + kh * R * Dv) / 16 + e;
    if ((e -= nv) < nv) return (conv_dim() + kh * R * Dv) / 16 + e;
    return (e == nv ? b_row() : a_row()) / 16;
  }
  // Where projection row `row` goes in the local copy; -1 when it is not kh's.
  __device__ int slot(int row) const {
    auto in = [&](int start, int len) { return row >= start && row < start + len; };
    if (in(kh * Dk, Dk)) return row - kh * Dk;
    if (in((Hk + kh) * Dk, Dk)) return Dk + row - (Hk + kh) * Dk;
    if (in(2 * Hk * Dk + kh * R * Dv, R * Dv)) return 2 * Dk + row - (2 * Hk * Dk + kh * R * Dv);
    if (in(conv_dim() + kh * R * Dv, R * Dv)) return 2 * Dk + R * Dv + row - (conv_dim() + kh * R * Dv);
    if (in(b_row(), R)) return 2 * Dk + 2 * R * Dv + row - b_row();
    if (in(a_row(), R)) return 2 * Dk + 2 * R * Dv + R + row - a_row();
    return -1;
  }
};

__device__ __forceinline__ void half_sync(int half) {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + half), "r"(kHalfWarps * 32) : "memory");
}

template <int GPW>
__global__ void __launch_bounds__(kThreads) gdn_fused_kernel(QMat W, XSpec X, GdnArgs a, const int* halt) {
  extern __shared__ uint4 smem_u4[];
  const cg::cluster_group cluster = cg::this_cluster();
  const int C = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const int t = threadIdx.x, lane = t & 31, H = W.cols, G = H / 64;
  const int half = t / (kHalfWarps * 32), hw = (t >> 5) % kHalfWarps, g0 = hw * GPW;
  const HeadRows hr{static_cast<int>(blockIdx.y), a.Hk, a.Hv, a.Dk, a.Dv, a.Hv / a.Hk};
  const auto [xf, xsum, raw] = mma_stage(smem_u4, H);
  float* local = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(smem_u4) + stage_mma_bytes(H));
  __shared__ float red[2][2][kHalfWarps][16];  // [half][row block parity][warp][row]
  __shared__ float qs[kMaxDk], ks[kMaxDk], sums[32], head_ss[kGdnSplit];

  // Block rank -> (value head, split) of the recurrence; thread -> (column, key lane).
  const int vj = rank / kGdnSplit, split = rank % kGdnSplit, vh = hr.kh * hr.R + vj;
  const int Cc = a.Dv / kGdnSplit, nk = a.Dk / kLanesPerColumn;
  const int col = t / kLanesPerColumn, kq = t % kLanesPerColumn;
  const bool active = col < Cc;
  const int vcol = split * Cc + (active ? col : 0);  // this thread's column within the head

  // Before the wait: the first weight tile, pos, the conv taps and the state (none of
  // them written by the kernel launched just before this one).
  int e = rank + half * C;  // this half's row blocks: e, e + 2C, ...
  MmaTiles<GPW> next;
  if (e < hr.n_blocks()) next.load(W, hr.block(e), g0, G, lane);
  const int conv_dim = hr.conv_dim();
  const int pos = __ldcg(a.pos), rc = pos & 3;  // the ring row of this position
  const int q_ch = hr.kh * a.Dk + t, k_ch = (a.Hk + hr.kh) * a.Dk + t, v_ch = 2 * a.Hk * a.Dk + vh * a.Dv + split * Cc + t;
  const ConvRing ring(a.ring, conv_dim, pos);
  ConvTap tq, tk, tv;
  if (t < a.Dk) {
    tq = ConvTap::load(a.conv_w, ring, q_ch);
    tk = ConvTap::load(a.conv_w, ring, k_ch);
  }
  if (t < Cc) tv = ConvTap::load(a.conv_w, ring, v_ch);
  const float dt_bias = a.dt_bias[vh], neg_A = a.neg_A[vh], norm_w = a.norm_w[vcol];
  // S[k][v] for k = 16i + kq, v = vcol, in gdn_state_index's layout.
  const size_t base = (static_cast<size_t>(vh) * kGdnSplit + split) * a.Dk * Cc;
  auto state_at = [&](int i) { return base + (static_cast<size_t>(i) * 4 * Cc + col * 4 + kq % 4) * 4 + kq / 4; };
  float s[kMaxDk / kLanesPerColumn];
#pragma unroll
  for (int i = 0; i < kMaxDk / kLanesPerColumn; ++i) s[i] = active && i < nk ? __ldcg(a.state_in + state_at(i)) : 0.0f;

  if (wait_halted(halt)) return;  // uniform: no block is left waiting at a barrier
  cluster_arrive();

  // 1. The head's projection rows, into every block's local copy.
  stage_x_mma(X, H, xf, xsum, raw, raw + H);
  timeline_mark(0);
  cluster_wait();  // every block has started: its shared memory may be written
  for (int it = 0; e < hr.n_blocks(); e += 2 * C, ++it) {
    const MmaTiles<GPW> cur = next;
    if (e + 2 * C < hr.n_blocks()) next.load(W, hr.block(e + 2 * C), g0, G, lane);
    float y0 = 0.0f, y1 = 0.0f;
    cur.accumulate(g0, G, g0, xf, xsum, lane, y0, y1);
    if (it == 0) timeline_mark(1);
    put_rows16(red[half][it & 1], y0, y1, hw);
    half_sync(half);
    const int r = t % (kHalfWarps * 32);
    if (r < 16) {
      const float y = row_total(red[half][it & 1], r, kHalfWarps);
      const int sl = hr.slot(hr.block(e) * 16 + r);
      if (sl >= 0)
        for (int d = 0; d < C; ++d) cluster.map_shared_rank(local, d)[sl] = y;
    }
  }
  cluster.sync();  // release/acquire: every block holds the whole local copy

  // 2. gdn_decode's step for (vh, split), from the local copy.
  const float* lq = local;
  const float* lk = local + a.Dk;
  const float* lv = local + 2 * a.Dk + vj * a.Dv;
  const float* lz = local + 2 * a.Dk + hr.R * a.Dv + vj * a.Dv;
  const float b = local[2 * a.Dk + 2 * hr.R * a.Dv + vj], araw = local[2 * a.Dk + 2 * hr.R * a.Dv + hr.R + vj];
  float sq = 0.0f, sk = 0.0f;
  if (t < a.Dk) {
    const float xq = lq[t], xk = lk[t];
    if (rank == 0) {
      a.ring[rc * conv_dim + q_ch] = xq;
      a.ring[rc * conv_dim + k_ch] = xk;
    }
    const float q = tq.apply(xq), k = tk.apply(xk);
    qs[t] = q;
    ks[t] = k;
    sq = q * q;
    sk = k * k;
  }
  float v = 0.0f;
  if (t < Cc) {
    const float xv = lv[split * Cc + t];
    a.ring[rc * conv_dim + v_ch] = xv;
    sums[t] = tv.apply(xv);  // v of column t (read after the block sums' barriers)
  }
  sq = block_sum(sq, red[0][0][0]);
  sk = block_sum(sk, red[1][0][0]);
  if (active) v = sums[col];
  const float o = delta_rule<kLanesPerColumn>(s, nk, kq, qs, ks, sq, sk, a.Dk, gdn_decay(araw, dt_bias, neg_A),
                                              sigmoidf_(b), v, active);
#pragma unroll
  for (int i = 0; i < kMaxDk / kLanesPerColumn; ++i)
    if (active && i < nk) a.state_out[state_at(i)] = s[i];

  // Gated RMSNorm over the value head: the sums of squares of its kGdnSplit blocks.
  const float part = block_sum(active && kq == 0 ? o * o : 0.0f, red[0][0][0]);
  const float hinv = head_inv_rms(part, head_ss, vj * kGdnSplit, split, a.Dv, a.eps);
  if (active && kq == 0) a.out[vh * a.Dv + vcol] = o * hinv * norm_w * siluf_(lz[vcol]);
  decode_trigger();
}

// The kernel for this shape, its cluster size and dynamic shared memory (attributes set).
struct FusedLaunch {
  void (*kernel)(QMat, XSpec, GdnArgs, const int*);
  int cluster;
  size_t smem;
};

FusedLaunch fused_launch(const QMat& W, const GdnArgs& g) {
  FusedLaunch f{};
  with_groups_per_warp(W.cols, kHalfWarps, "gdn_fused", [&](auto gpw) { f.kernel = gdn_fused_kernel<gpw>; });
  const int R = g.Hv / g.Hk;
  f.cluster = R * kGdnSplit;  // <= 16: the size max_cluster_size allows above 8
  f.smem = stage_mma_bytes(W.cols) + static_cast<size_t>(2 * g.Dk + 2 * R * g.Dv + 2 * R) * 4;
  allow_dynamic_smem(reinterpret_cast<const void*>(f.kernel), f.smem, "gdn_fused: set smem");
  if (max_cluster_size(reinterpret_cast<const void*>(f.kernel), kThreads, f.smem, f.cluster, "gdn_fused") < f.cluster)
    fail("gdn_fused: this device cannot place clusters of ", std::to_string(f.cluster), " blocks");
  return f;
}

}  // namespace

bool gdn_fused_supported(const QMat& W_in, const GdnArgs& g) {
  if (g.Hk <= 0 || g.Hv <= 0 || g.Dk <= 0 || g.Dv <= 0 || g.Hv % g.Hk != 0) return false;
  const int R = g.Hv / g.Hk;
  const int rows = 2 * g.Hk * g.Dk + 2 * g.Hv * g.Dv + 2 * g.Hv;
  return W_in.tiled && W_in.bits == 4 && W_in.rows == rows && R * kGdnSplit <= kMaxCluster && 16 % R == 0 &&
         g.Dk % 16 == 0 && g.Dk <= kMaxDk && g.Dv % 16 == 0 && g.Dv / kGdnSplit * kLanesPerColumn <= kThreads &&
         W_in.cols % 64 == 0 && W_in.cols <= 4096;
}

void gdn_fused_decode(const QMat& W_in, const XSpec& X, const GdnArgs& g, const int* halt, cudaStream_t stream) {
  if (!gdn_fused_supported(W_in, g)) fail("gdn_fused: unsupported shape (gdn_fused.h lists what it takes)");
  if (!g.norm_w) fail("gdn_fused: the gated norm weight (norm_w) is missing");
  if (X.mode == XMode::EmbedRmsNorm) fail("gdn_fused: x from the embedding writes h early (gdn_fused.h); use the two launches");
  const FusedLaunch f = fused_launch(W_in, g);
  launch_clustered("gdn_fused", f.cluster, f.kernel, dim3(f.cluster, g.Hk), dim3(kThreads), f.smem, stream, W_in, X, g,
                   halt);
}

int gdn_fused_max_active_clusters(const QMat& W_in, const GdnArgs& g) {
  if (!gdn_fused_supported(W_in, g)) fail("gdn_fused: unsupported shape (gdn_fused.h lists what it takes)");
  const FusedLaunch f = fused_launch(W_in, g);
  return max_active_clusters(reinterpret_cast<const void*>(f.kernel), dim3(f.cluster, g.Hk), kThreads, f.smem, f.cluster,
                             "gdn_fused");
}

}  // namespace lily::cuda
