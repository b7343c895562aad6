#include "gated_delta/gated_delta_scan_prefill.h"

#include <cstdint>
#include <string>

#include "common/async_copy.cuh"
#include "common/device_common.cuh"
#include "gated_delta/gated_delta_decode.h"

namespace lily::cuda {
namespace {

constexpr int kStage = 32;            // tokens per shared-memory stage (two stages in flight)
constexpr float kFoldBelow = 1e-20f;  // state scale below which it is folded into the registers

// Floats of one stage buffer: k rows of tokens t0 .. t0 + kStage (one extra: the next
// token's key), q rows of t0 .. t0 + kStage - 1, v [kStage][CB] of the block's columns,
// (beta, decay) pairs [kStage][2].
__host__ __device__ constexpr int stage_floats(int dk, int cb) { return (2 * kStage + 1) * dk + kStage * cb + 2 * kStage; }

// The Dk rows of a value column are split over 16 lanes: lane g owns rows VW*(g + 16m) + u
// (m < NV, u < VW), so a k/q row is read as NV vectors of VW floats, the 16 g reading
// consecutive vectors (no bank conflicts).
template <int DK>
struct RowSplit {
  static constexpr int R = DK / 16;  // rows per lane
  static constexpr int VW = R % 4 == 0 ? 4 : R % 2 == 0 ? 2 : 1;
  static constexpr int NV = R / VW;
  __device__ static int row(int g, int e) { return VW * (g + 16 * (e / VW)) + e % VW; }
};

// This lane's rows of a k/q row: `src` = row + VW*g, vectors 16*VW floats apart.
template <int DK>
__device__ __forceinline__ void load_rows(const float* src, float (&r)[DK / 16]) {
  using L = RowSplit<DK>;
#pragma unroll
  for (int m = 0; m < L::NV; ++m) {
    const float* p = src + 16 * L::VW * m;
    if constexpr (L::VW == 4) {
      const float4 x = *reinterpret_cast<const float4*>(p);
      r[4 * m] = x.x, r[4 * m + 1] = x.y, r[4 * m + 2] = x.z, r[4 * m + 3] = x.w;
    } else if constexpr (L::VW == 2) {
      const float2 x = *reinterpret_cast<const float2*>(p);
      r[2 * m] = x.x, r[2 * m + 1] = x.y;
    } else {
      r[m] = *p;
    }
  }
}

// gated_delta_state_index (gated_delta_decode.cu) on the device: where S[k][v] of head h lives.
__device__ __forceinline__ size_t state_index(int Dk, int Dv, int h, int k, int v) {
  const int C = Dv / kGdnSplit, split = v / C, col = v % C, i = k / 4;
  const size_t base = (static_cast<size_t>(h) * kGdnSplit + split) * Dk * C / 4;
  return (base + static_cast<size_t>(i / 4) * 4 * C + col * 4 + k % 4) * 4 + i % 4;
}

// Sums x0, x1, o0, o1 over the 16 lanes (g = lane / 2, same lane % 2) of a column pair in
// 5 shuffles (reduce-scatter: each xor-16 pair splits the 4 values, each xor-8 pair the 2
// left). Lane g returns the full sum of x0 (g < 4), x1 (4 <= g < 8), o0 (8 <= g < 12) or
// o1 (g >= 12).
__device__ __forceinline__ float reduce_cols(float x0, float x1, float o0, float o1, int lane) {
  const bool hi = lane & 16;
  float a0 = hi ? o0 : x0, a1 = hi ? o1 : x1;
  a0 += __shfl_xor_sync(0xffffffffu, hi ? x0 : o0, 16);
  a1 += __shfl_xor_sync(0xffffffffu, hi ? x1 : o1, 16);
  const bool b = lane & 8;
  float r = b ? a1 : a0;
  r += __shfl_xor_sync(0xffffffffu, b ? a0 : a1, 8);
  r += __shfl_xor_sync(0xffffffffu, r, 4);
  r += __shfl_xor_sync(0xffffffffu, r, 2);
  return r;
}

// Block (x, h): value head h, columns col0 = x*CB .. col0+CB-1 (CB = 32 or 16), CB/4 warps.
// Lane (g = lane / 2, p = lane % 2) of warp w holds S[rows of g][col0 + 4w + 2p + {0, 1}]:
// 2 columns x Dk/16 rows in registers for the whole chunk (lanes 2g and 2g+1 read the same
// k/q addresses, which halves their shared-memory return traffic). Per token, one sweep
// updates S += k_t delta^T and accumulates o = S^T q_t and x = S^T k_{t+1} (the next
// token's recall), then one 5-shuffle reduction over the 16 lanes of a column pair.
// The decay stays out of the registers: state = scale * S, each token's decay multiplies
// `scale` and the update adds k (delta / scale)^T, so a state element costs 3 FMAs per
// token; when scale falls below kFoldBelow it is folded into S (block-uniform, rare).
template <int DK>
__global__ void __launch_bounds__(256, 1) gated_delta_scan_prefill_kernel(GdnScanPrefillArgs a, int CB) {
  constexpr int R = DK / 16;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const int h = blockIdx.y, kh = h / (a.Hv / a.Hk), col0 = blockIdx.x * CB;
  const int lane = threadIdx.x & 31, g = lane >> 1, p = lane & 1;
  const int jl = (threadIdx.x >> 5) * 4 + 2 * p;  // this lane's first column, relative to col0
  const int buf_floats = stage_floats(DK, CB), n_stages = (a.T + kStage - 1) / kStage;

  auto issue_stage = [&](int s) {
    float* ks = smem + (s & 1) * buf_floats;
    float* qs = ks + (kStage + 1) * DK;
    float* vs = qs + kStage * DK;
    float* bd = vs + kStage * CB;
    const int t0 = s * kStage, n4 = DK / 4, c4 = CB / 4;
    for (int i = threadIdx.x; i < (kStage + 1) * n4; i += blockDim.x) {
      const int t = t0 + i / n4;
      const bool ok = t < a.T;
      cp_async16_or_zero(ks + 4 * i, a.k + (ok ? (static_cast<size_t>(t) * a.Hk + kh) * DK + 4 * (i % n4) : 0), ok);
    }
    for (int i = threadIdx.x; i < kStage * n4; i += blockDim.x) {
      const int t = t0 + i / n4;
      const bool ok = t < a.T;
      cp_async16_or_zero(qs + 4 * i, a.q + (ok ? (static_cast<size_t>(t) * a.Hk + kh) * DK + 4 * (i % n4) : 0), ok);
    }
    for (int i = threadIdx.x; i < kStage * c4; i += blockDim.x) {
      const int t = t0 + i / c4;
      const bool ok = t < a.T;
      cp_async16_or_zero(vs + 4 * i, a.v + (ok ? (static_cast<size_t>(t) * a.Hv + h) * a.Dv + col0 + 4 * (i % c4) : 0), ok);
    }
    for (int i = threadIdx.x; i < kStage; i += blockDim.x) {
      const bool ok = t0 + i < a.T;
      const size_t at = ok ? static_cast<size_t>(t0 + i) * a.Hv + h : 0;
      cp_async4_or_zero(bd + 2 * i, a.beta + at, ok);
      cp_async4_or_zero(bd + 2 * i + 1, a.decay + at, ok);
    }
    cp_async_commit();
  };

  pdl_wait();
  issue_stage(0);
  float S[2][R];
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int e = 0; e < R; ++e)
      S[c][e] = a.state[state_index(DK, a.Dv, h, RowSplit<DK>::row(g, e), col0 + jl + c)];

  // Lanes with g = 8 (o of column jl) and g = 12 (column jl + 1) store o.
  const bool stores_o = (lane & 22) == 16;
  float* o_out = a.o + static_cast<size_t>(h) * a.Dv + col0 + jl + ((lane >> 3) & 1);
  const size_t o_step = static_cast<size_t>(a.Hv) * a.Dv;
  float scale = 1.0f;             // the state is scale * S
  float kvd0 = 0.f, kvd1 = 0.f;   // S^T k_t of this lane's two columns

  // One token t: kc = rows of k_t (in registers), kn <- rows of k_{t+1} (at k1), q_t at q,
  // v_t at v (this lane's two columns), (beta_t, decay_t) at bd; k1 and q lane-adjusted.
  auto token = [&](const float* k1, const float* q, const float* v, const float* bd, const float (&kc)[R],
                   float (&kn)[R]) {
    const float2 beta_decay = *reinterpret_cast<const float2*>(bd);
    const float2 vv = *reinterpret_cast<const float2*>(v);
    // delta / scale' = beta (v - decay * scale * S^T k) / scale', with scale' the new scale
    const float decayed = scale * beta_decay.y;
    const bool fold = decayed < kFoldBelow;  // also catches decay == 0
    if (fold) {
#pragma unroll
      for (int e = 0; e < R; ++e) S[0][e] *= decayed, S[1][e] *= decayed;
    }
    scale = fold ? 1.0f : decayed;
    const float bv = beta_decay.x / scale, bk = bv * decayed;
    const float d0 = fmaf(-bk, kvd0, bv * vv.x), d1 = fmaf(-bk, kvd1, bv * vv.y);
    float qr[R];
    load_rows<DK>(q, qr);
    load_rows<DK>(k1, kn);
#pragma unroll
    for (int e = 0; e < R; ++e) S[0][e] = fmaf(kc[e], d0, S[0][e]), S[1][e] = fmaf(kc[e], d1, S[1][e]);
    float x0 = 0.f, x1 = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int e = 0; e < R; ++e) {
      o0 = fmaf(S[0][e], qr[e], o0), o1 = fmaf(S[1][e], qr[e], o1);
      x0 = fmaf(S[0][e], kn[e], x0), x1 = fmaf(S[1][e], kn[e], x1);
    }
    const float r = reduce_cols(x0, x1, o0, o1, lane);
    kvd0 = __shfl_sync(0xffffffffu, r, p);
    kvd1 = __shfl_sync(0xffffffffu, r, 8 | p);
    if (stores_o) *o_out = scale * r;
    o_out += o_step;
  };

  float ka[R], kb[R];  // k rows of the current and the next token, alternating
  for (int s = 0; s < n_stages; ++s) {
    cp_async_wait<0>();
    __syncthreads();  // stage s visible to all; everyone is done with stage s - 1, whose buffer is refilled next
    if (s + 1 < n_stages) issue_stage(s + 1);
    const float* kp = smem + (s & 1) * buf_floats + RowSplit<DK>::VW * g;  // k_t rows of this lane
    const float* qp = kp + (kStage + 1) * DK;
    const float* vp = qp - RowSplit<DK>::VW * g + kStage * DK + jl;
    const float* bp = vp - jl + kStage * CB;
    if (s == 0) {  // the first token's recall
      load_rows<DK>(kp, ka);
      float x0 = 0.f, x1 = 0.f;
#pragma unroll
      for (int e = 0; e < R; ++e) x0 = fmaf(S[0][e], ka[e], x0), x1 = fmaf(S[1][e], ka[e], x1);
      const float r = reduce_cols(x0, x1, 0.f, 0.f, lane);
      kvd0 = __shfl_sync(0xffffffffu, r, p);
      kvd1 = __shfl_sync(0xffffffffu, r, 8 | p);
    }
    const int n = min(kStage, a.T - s * kStage);
    int tt = 0;
    for (; tt + 1 < n; tt += 2) {  // two tokens per trip: ka and kb swap roles without copies
      token(kp + DK, qp, vp, bp, ka, kb);
      token(kp + 2 * DK, qp + DK, vp + CB, bp + 2, kb, ka);
      kp += 2 * DK, qp += 2 * DK, vp += 2 * CB, bp += 4;
    }
    if (tt < n) {  // odd count: only in the last stage
      token(kp + DK, qp, vp, bp, ka, kb);
#pragma unroll
      for (int e = 0; e < R; ++e) ka[e] = kb[e];
    }
  }
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int e = 0; e < R; ++e)
      a.state[state_index(DK, a.Dv, h, RowSplit<DK>::row(g, e), col0 + jl + c)] = scale * S[c][e];
  pdl_trigger();
}

template <int DK>
void launch_scan(const GdnScanPrefillArgs& a, cudaStream_t stream) {
  auto kernel = gated_delta_scan_prefill_kernel<DK>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), 2 * stage_floats(DK, 32) * sizeof(float),
                     "gated_delta_scan_prefill: set smem");
  const int cb = a.Dv % 32 == 0 ? 32 : 16;
  launch("gated_delta_scan_prefill", kernel, dim3(a.Dv / cb, a.Hv), dim3(cb / 4 * 32), 2 * stage_floats(DK, cb) * sizeof(float),
         stream, a, cb);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

void gated_delta_scan_prefill(const GdnScanPrefillArgs& a, cudaStream_t stream) {
  const char* op = "gated_delta_scan_prefill";
  if (a.T < 1) fail(op, ": need T >= 1 (T ", std::to_string(a.T), ")");
  if (a.Dk % 16 != 0 || a.Dk < 16 || a.Dk > 128 || a.Dv % 16 != 0 || a.Dv < 16 || a.Dv > 128)
    fail(op, ": head dims must be multiples of 16 up to 128 (Dk ", std::to_string(a.Dk), ", Dv ", std::to_string(a.Dv), ")");
  if (a.Hk <= 0 || a.Hv % a.Hk != 0) fail(op, ": value heads must be a multiple of key heads");
  if (!a.q || !a.k || !a.v || !a.beta || !a.decay || !a.state || !a.o) fail(op, ": missing input, state or output pointer");
  for (const void* p : {static_cast<const void*>(a.q), static_cast<const void*>(a.k), static_cast<const void*>(a.v),
                        static_cast<const void*>(a.state)})
    if (!aligned16(p)) fail(op, ": q, k, v and state must be 16-byte aligned");
  switch (a.Dk) {
    case 16: return launch_scan<16>(a, stream);
    case 32: return launch_scan<32>(a, stream);
    case 48: return launch_scan<48>(a, stream);
    case 64: return launch_scan<64>(a, stream);
    case 80: return launch_scan<80>(a, stream);
    case 96: return launch_scan<96>(a, stream);
    case 112: return launch_scan<112>(a, stream);
    default: return launch_scan<128>(a, stream);
  }
}

}  // namespace lily::cuda
