#include "gated_delta/gated_delta_chunked_prefill.h"

#include <cstdint>
#include <string>

#include "common/async_copy.cuh"
#include "common/device_common.cuh"
#include "gated_delta/gated_delta_decode.h"

namespace lily::cuda {
namespace {

constexpr int kC = 64;             // tokens per chunk
constexpr int kThreads = 256;      // both kernels: 8 warps
constexpr double kLogZero = -1e4;  // log of a zero decay: exp of any sum holding it is 0 in fp32

// One chunk's record in scratch, per (chunk, value head): W [kC][Dk], U [kC][Dv],
// P [kC][kC], g [kC] and g_{n-1} / g [kC]; rows and columns >= n are zero.
__host__ __device__ constexpr size_t record_floats(int dk, int dv) { return size_t(kC) * (dk + dv + kC) + 2 * kC; }

// ---- tensor-core helpers: mma.sync m16n8k8 tf32, fp32 accumulate, 3xTF32 products ----

__device__ __forceinline__ uint32_t tf32_bits(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- end of the PTX helpers ----

// x = hi + lo, both tf32: a product summed as hi*hi + hi*lo + lo*hi keeps ~fp32 precision.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_bits(x);
  lo = tf32_bits(x - __uint_as_float(hi));
}

// acc[nt] (16 x 8 tile, rows m, columns 8 nt + n) += sum_{k < 8 KS} A(m, k) B(k, 8 nt + n),
// A and B read through a(row, k) and b(k, col) (shared memory). Fragments (gid = lane / 4,
// t = lane % 4): A (gid, t) (gid + 8, t) (gid, t + 4) (gid + 8, t + 4); B (t, gid) (t + 4, gid);
// acc (gid, 2t) (gid, 2t + 1) (gid + 8, 2t) (gid + 8, 2t + 1).
template <int NT, int KS, typename FA, typename FB>
__device__ __forceinline__ void warp_mma3(float (&acc)[NT][4], FA a, FB b, int lane) {
  const int gid = lane >> 2, t = lane & 3;
#pragma unroll 2
  for (int ks = 0; ks < KS; ++ks) {
    const int k = 8 * ks + t;
    uint32_t ah[4], al[4];
    split_tf32(a(gid, k), ah[0], al[0]);
    split_tf32(a(gid + 8, k), ah[1], al[1]);
    split_tf32(a(gid, k + 4), ah[2], al[2]);
    split_tf32(a(gid + 8, k + 4), ah[3], al[3]);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      uint32_t bh0, bl0, bh1, bl1;
      split_tf32(b(k, 8 * nt + gid), bh0, bl0);
      split_tf32(b(k + 4, 8 * nt + gid), bh1, bl1);
      mma_tf32(acc[nt], al, bh0, bh1);
      mma_tf32(acc[nt], ah, bl0, bl1);
      mma_tf32(acc[nt], ah, bh0, bh1);
    }
  }
}

// gated_delta_state_index (gated_delta_decode.cu) on the device: where S[k][v] of head h lives.
__device__ __forceinline__ size_t state_index(int Dk, int Dv, int h, int k, int v) {
  const int C = Dv / kGdnSplit, split = v / C, col = v % C, i = k / 4;
  const size_t base = (static_cast<size_t>(h) * kGdnSplit + split) * Dk * C / 4;
  return (base + static_cast<size_t>(i / 4) * 4 * C + col * 4 + k % 4) * 4 + i % 4;
}

// ---- kernel 1: the state-independent part of every chunk ----

template <int DK>
struct PrepSmem {
  static constexpr int LD = DK + 4;  // row stride of K, Q: fragment reads hit 32 distinct banks
  static constexpr int LDA = kC + 4;
  static constexpr size_t bytes = sizeof(double) * kC + sizeof(float) * (2 * kC * LD + kC * LDA + 2 * kC);
};

// Block (chunk c, value head h). Shared: gamma [kC] (fp64: ratios of nearby tokens stay
// exact however large |gamma| grows), K, Q [kC][LD], A [kC][LDA], beta g [kC], beta [kC].
// Warps 0-3 form K K^T, warps 4-7 Q K^T (16 rows each, 3xTF32); then thread col < Dk + Dv
// solves (I + A) x = rhs for one column of [W | U] by forward substitution in registers.
template <int DK>
__global__ void __launch_bounds__(kThreads) gated_delta_chunk_prep_kernel(GdnChunkedPrefillArgs a) {
  using L = PrepSmem<DK>;
  extern __shared__ float4 smem4[];
  double* gam = reinterpret_cast<double*>(smem4);
  float* ks = reinterpret_cast<float*>(gam + kC);
  float* qs = ks + kC * L::LD;
  float* as = qs + kC * L::LD;
  float* bg = as + kC * L::LDA;
  float* bs = bg + kC;
  const int c = blockIdx.x, h = blockIdx.y, kh = h / (a.Hv / a.Hk), t0 = c * kC, n = min(kC, a.T - t0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* rec = static_cast<float*>(a.scratch) + (static_cast<size_t>(c) * a.Hv + h) * record_floats(DK, a.Dv);
  float* w_out = rec;
  float* u_out = rec + kC * DK;
  float* p_out = u_out + kC * a.Dv;
  float* g_out = p_out + kC * kC;

  pdl_wait();
  for (int i = tid; i < kC * DK / 4; i += kThreads) {
    const int r = i / (DK / 4), d = 4 * (i % (DK / 4));
    float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), qv = kv;
    if (r < n) {
      const size_t at = (static_cast<size_t>(t0 + r) * a.Hk + kh) * DK + d;
      kv = *reinterpret_cast<const float4*>(a.k + at);
      qv = *reinterpret_cast<const float4*>(a.q + at);
    }
    *reinterpret_cast<float4*>(ks + r * L::LD + d) = kv;
    *reinterpret_cast<float4*>(qs + r * L::LD + d) = qv;
  }
  if (tid < kC) {
    const float dec = tid < n ? a.decay[static_cast<size_t>(t0 + tid) * a.Hv + h] : 1.0f;
    gam[tid] = dec > 0.0f ? log(static_cast<double>(dec)) : kLogZero;
  }
  __syncthreads();
  double gi = 0.0;  // gamma_tid: a prefix sum in token order (every thread the same rounding)
  if (tid < kC) {
    for (int j = 0; j <= tid; ++j) gi += gam[j];
  }
  __syncthreads();
  if (tid < kC) {
    gam[tid] = gi;
    const bool ok = tid < n;
    const float beta = ok ? a.beta[static_cast<size_t>(t0 + tid) * a.Hv + h] : 0.0f;
    const float g = ok ? expf(static_cast<float>(gi)) : 0.0f;
    bg[tid] = beta * g;
    bs[tid] = beta;
    g_out[tid] = g;
  }
  __syncthreads();
  if (tid < kC) g_out[kC + tid] = tid < n ? expf(static_cast<float>(gam[n - 1] - gam[tid])) : 0.0f;

  {  // A = strictly lower (beta_i r_ij k_i.k_j) into shared memory; P = lower (r_ij q_i.k_j) to scratch
    const int m0 = 16 * (warp & 3);
    const bool is_p = warp >= 4;
    const float* lhs = (is_p ? qs : ks) + m0 * L::LD;
    float acc[8][4] = {};
    warp_mma3<8, DK / 8>(acc, [&](int r, int k) { return lhs[r * L::LD + k]; },
                         [&](int k, int col) { return ks[col * L::LD + k]; }, lane);
    const int gid = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = m0 + gid + 8 * half;
      const double gam_i = gam[i];
      const float b_i = bs[i];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        float out[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = 8 * nt + 2 * t + e;
          const bool keep = i < n && (is_p ? j <= i : j < i);
          const float r = keep ? expf(static_cast<float>(gam_i - gam[j])) : 0.0f;  // the fp64 difference is exact
          out[e] = keep ? r * acc[nt][2 * half + e] * (is_p ? 1.0f : b_i) : 0.0f;
        }
        float* dst = is_p ? p_out + i * kC + 8 * nt + 2 * t : as + i * L::LDA + 8 * nt + 2 * t;
        *reinterpret_cast<float2*>(dst) = make_float2(out[0], out[1]);
      }
    }
  }
  __syncthreads();

  // Column col of [W | U]: u_i = rhs_i - sum_{j<i} A_ij u_j, rhs = beta g K (col < DK) or beta V.
  if (tid < DK + a.Dv) {
    const bool is_w = tid < DK;
    const float* v_col = a.v + static_cast<size_t>(h) * a.Dv + (is_w ? 0 : tid - DK);
    const size_t v_step = static_cast<size_t>(a.Hv) * a.Dv;
    float u[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i)
      u[i] = is_w ? bg[i] * ks[i * L::LD + tid] : (i < n ? bs[i] * v_col[(t0 + i) * v_step] : 0.0f);
#pragma unroll
    for (int i = 1; i < kC; ++i) {
      const float* ai = as + i * L::LDA;
      float s = u[i];
#pragma unroll
      for (int j = 0; j < i; j += 4) {
        const float4 aj = *reinterpret_cast<const float4*>(ai + j);
        s = fmaf(-aj.x, u[j], s);
        if (j + 1 < i) s = fmaf(-aj.y, u[j + 1], s);
        if (j + 2 < i) s = fmaf(-aj.z, u[j + 2], s);
        if (j + 3 < i) s = fmaf(-aj.w, u[j + 3], s);
      }
      u[i] = s;
    }
    float* out = is_w ? w_out + tid : u_out + (tid - DK);
    const int ld = is_w ? DK : a.Dv;
#pragma unroll
    for (int i = 0; i < kC; ++i) out[i * ld] = u[i];
  }
  pdl_trigger();
}

// ---- kernel 2: the state recurrence over the chunks ----

template <int DK, int CV>
struct StateSmem {
  static constexpr int LDW = DK + 4;   // W, Q rows (A operands, row-major)
  static constexpr int LDK = DK + 8;   // K rows (A operand K^T read down columns)
  static constexpr int LDP = kC + 4;   // P rows (A operand)
  static constexpr int LDB = CV + 8;   // S, D, D' rows (B operands, k-major)
  static constexpr int stage = 2 * kC * LDW + 2 * kC;  // W, Q, g, g_{n-1}/g of one chunk (double-buffered)
  static constexpr int floats = 2 * stage + kC * LDK + kC * LDP + DK * LDB + 2 * kC * LDB;
  static constexpr size_t bytes = sizeof(float) * floats;
};

// Block (slice x, value head h): value columns col0 = x CV .. col0 + CV - 1, the state
// slice S [DK][CV] in registers (warp w < DK/16: rows 16w .. 16w + 15) and in shared
// memory (the B operand of W S and Q S). Per chunk:
//   warps 0-3 (16 token rows each): D = U - W S -> shared D and D' = diag(g_{n-1}/g) D
//   warps 4-7 (16 token rows each): Y = diag(g) Q S, then O = Y + P D -> o
//   warps w < DK/16: S = g_{n-1} S + K^T D' (then S -> shared)
// Copies (cp.async): W, Q, g of chunk c + 1 are fetched during chunk c (two buffers);
// K, P of chunk c + 1 after chunk c's last use, overlapping chunk c + 1's W S, Q S.
template <int DK, int CV>
__global__ void __launch_bounds__(kThreads, 1) gated_delta_chunk_state_kernel(GdnChunkedPrefillArgs a) {
  using L = StateSmem<DK, CV>;
  constexpr int NT = CV / 8;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* kbuf = smem + 2 * L::stage;
  float* pbuf = kbuf + kC * L::LDK;
  float* sbuf = pbuf + kC * L::LDP;
  float* dbuf = sbuf + DK * L::LDB;
  float* dsc = dbuf + kC * L::LDB;
  const int h = blockIdx.y, kh = h / (a.Hv / a.Hk), col0 = blockIdx.x * CV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, t = lane & 3;
  const int n_chunks = (a.T + kC - 1) / kC;
  const size_t rec_floats = record_floats(DK, a.Dv);
  const float* scratch = static_cast<const float*>(a.scratch);
  auto record = [&](int c) { return scratch + (static_cast<size_t>(c) * a.Hv + h) * rec_floats; };

  auto issue_wqg = [&](int c) {
    float* ws = smem + (c & 1) * L::stage;
    float* qs = ws + kC * L::LDW;
    float* gs = qs + kC * L::LDW;
    const float* rec = record(c);
    const int t0 = c * kC;
    for (int i = tid; i < kC * DK / 4; i += kThreads) {
      const int r = i / (DK / 4), d = 4 * (i % (DK / 4));
      const bool ok = t0 + r < a.T;
      cp_async16_or_zero(ws + r * L::LDW + d, rec + r * DK + d, true);
      cp_async16_or_zero(qs + r * L::LDW + d, a.q + (ok ? (static_cast<size_t>(t0 + r) * a.Hk + kh) * DK + d : 0), ok);
    }
    const float* g = rec + kC * (DK + a.Dv + kC);
    for (int i = tid; i < 2 * kC / 4; i += kThreads) cp_async16_or_zero(gs + 4 * i, g + 4 * i, true);
  };
  auto issue_kp = [&](int c) {
    const float* rec = record(c);
    const int t0 = c * kC;
    for (int i = tid; i < kC * DK / 4; i += kThreads) {
      const int r = i / (DK / 4), d = 4 * (i % (DK / 4));
      const bool ok = t0 + r < a.T;
      cp_async16_or_zero(kbuf + r * L::LDK + d, a.k + (ok ? (static_cast<size_t>(t0 + r) * a.Hk + kh) * DK + d : 0), ok);
    }
    const float* p = rec + kC * (DK + a.Dv);
    for (int i = tid; i < kC * kC / 4; i += kThreads) {
      const int r = i / (kC / 4), j = 4 * (i % (kC / 4));
      cp_async16_or_zero(pbuf + r * L::LDP + j, p + r * kC + j, true);
    }
  };

  pdl_wait();
  issue_wqg(0);
  cp_async_commit();
  issue_kp(0);
  cp_async_commit();

  const bool owns_s = warp < DK / 16;
  const int s_row = 16 * warp + gid;  // this lane's state rows s_row, s_row + 8 (owns_s)
  float s[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = s_row + 8 * (e >> 1), col = 8 * nt + 2 * t + (e & 1);
      s[nt][e] = owns_s ? a.state[state_index(DK, a.Dv, h, d, col0 + col)] : 0.0f;
      if (owns_s) sbuf[d * L::LDB + col] = s[nt][e];
    }

  const int m0 = 16 * (warp & 3);  // token rows of this warp's W S or Q S tile
  const bool is_o = warp >= 4;
  for (int c = 0; c < n_chunks; ++c) {
    const int t0 = c * kC, n = min(kC, a.T - t0);
    cp_async_wait<1>();  // W, Q, g of chunk c (K, P of chunk c may still be in flight)
    __syncthreads();
    if (c + 1 < n_chunks) issue_wqg(c + 1);
    cp_async_commit();
    const float* ws = smem + (c & 1) * L::stage;
    const float* qs = ws + kC * L::LDW;
    const float* gs = qs + kC * L::LDW;

    float u[NT][4];  // U of this lane's D elements, fetched before the products hide the latency
    if (!is_o) {
      const float* ur = record(c) + kC * DK + col0 + 2 * t;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 x = *reinterpret_cast<const float2*>(ur + (m0 + gid + 8 * half) * a.Dv + 8 * nt);
          u[nt][2 * half] = x.x, u[nt][2 * half + 1] = x.y;
        }
    }
    float acc[NT][4] = {};
    const float* lhs = (is_o ? qs : ws) + m0 * L::LDW;
    warp_mma3<NT, DK / 8>(acc, [&](int r, int k) { return lhs[r * L::LDW + k]; },
                          [&](int k, int col) { return sbuf[k * L::LDB + col]; }, lane);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = m0 + gid + 8 * half;
      const float g_i = gs[i], gend_i = gs[kC + i];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float* a2 = &acc[nt][2 * half];
        if (is_o) {
          a2[0] *= g_i, a2[1] *= g_i;
        } else {
          const float d0 = u[nt][2 * half] - a2[0], d1 = u[nt][2 * half + 1] - a2[1];
          const int at = i * L::LDB + 8 * nt + 2 * t;
          *reinterpret_cast<float2*>(dbuf + at) = make_float2(d0, d1);
          *reinterpret_cast<float2*>(dsc + at) = make_float2(gend_i * d0, gend_i * d1);
        }
      }
    }
    cp_async_wait<1>();  // K, P of chunk c
    __syncthreads();     // ... and D, D' visible to all

    if (is_o) {  // O = Y + P D, rows < n to o
      const float* pr = pbuf + m0 * L::LDP;
      warp_mma3<NT, kC / 8>(acc, [&](int r, int k) { return pr[r * L::LDP + k]; },
                            [&](int k, int col) { return dbuf[k * L::LDB + col]; }, lane);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = m0 + gid + 8 * half;
        if (i < n) {
          float* dst = a.o + (static_cast<size_t>(t0 + i) * a.Hv + h) * a.Dv + col0 + 2 * t;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            *reinterpret_cast<float2*>(dst + 8 * nt) = make_float2(acc[nt][2 * half], acc[nt][2 * half + 1]);
        }
      }
    }
    if (owns_s) {  // S = g_{n-1} S + K^T D'
      const float g_last = gs[n - 1];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= g_last;
      const float* kr = kbuf + 16 * warp;
      warp_mma3<NT, kC / 8>(s, [&](int r, int k) { return kr[k * L::LDK + r]; },
                            [&](int k, int col) { return dsc[k * L::LDB + col]; }, lane);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          *reinterpret_cast<float2*>(sbuf + (s_row + 8 * half) * L::LDB + 8 * nt + 2 * t) =
              make_float2(s[nt][2 * half], s[nt][2 * half + 1]);
    }
    __syncthreads();  // K, P, D, D' read by all before K, P are refilled
    if (c + 1 < n_chunks) issue_kp(c + 1);
    cp_async_commit();
  }
  cp_async_wait<0>();
  if (owns_s) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        a.state[state_index(DK, a.Dv, h, s_row + 8 * (e >> 1), col0 + 8 * nt + 2 * t + (e & 1))] = s[nt][e];
  }
  pdl_trigger();
}

template <int DK>
void launch_chunked(const GdnChunkedPrefillArgs& a, cudaStream_t stream) {
  auto prep = gated_delta_chunk_prep_kernel<DK>;
  auto state32 = gated_delta_chunk_state_kernel<DK, 32>;
  auto state16 = gated_delta_chunk_state_kernel<DK, 16>;
  allow_dynamic_smem(reinterpret_cast<const void*>(prep), PrepSmem<DK>::bytes, "gated_delta_chunked_prefill: set prep smem");
  allow_dynamic_smem(reinterpret_cast<const void*>(state32), StateSmem<DK, 32>::bytes, "gated_delta_chunked_prefill: set state smem");
  allow_dynamic_smem(reinterpret_cast<const void*>(state16), StateSmem<DK, 16>::bytes, "gated_delta_chunked_prefill: set state smem");
  const int n_chunks = (a.T + kC - 1) / kC;
  launch("gated_delta_chunk_prep", prep, dim3(n_chunks, a.Hv), dim3(kThreads), PrepSmem<DK>::bytes, stream, a);
  if (a.Dv % 32 == 0)
    launch("gated_delta_chunk_state", state32, dim3(a.Dv / 32, a.Hv), dim3(kThreads), StateSmem<DK, 32>::bytes, stream, a);
  else
    launch("gated_delta_chunk_state", state16, dim3(a.Dv / 16, a.Hv), dim3(kThreads), StateSmem<DK, 16>::bytes, stream, a);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

size_t gated_delta_chunked_prefill_scratch_bytes(int T, int Hv, int Dk, int Dv) {
  const size_t n_chunks = T > 0 ? (static_cast<size_t>(T) + kC - 1) / kC : 0;
  return n_chunks * static_cast<size_t>(Hv > 0 ? Hv : 0) * record_floats(Dk, Dv) * sizeof(float);
}

void gated_delta_chunked_prefill(const GdnChunkedPrefillArgs& a, cudaStream_t stream) {
  const char* op = "gated_delta_chunked_prefill";
  if (a.T < 1) fail(op, ": need T >= 1 (T ", std::to_string(a.T), ")");
  if (a.Dk % 16 != 0 || a.Dk < 16 || a.Dk > 128 || a.Dv % 16 != 0 || a.Dv < 16 || a.Dv > 128)
    fail(op, ": head dims must be multiples of 16 up to 128 (Dk ", std::to_string(a.Dk), ", Dv ", std::to_string(a.Dv), ")");
  if (a.Hk <= 0 || a.Hv % a.Hk != 0) fail(op, ": value heads must be a multiple of key heads");
  if (!a.q || !a.k || !a.v || !a.beta || !a.decay || !a.state || !a.o || !a.scratch)
    fail(op, ": missing input, state, output or scratch pointer");
  for (const void* p : {static_cast<const void*>(a.q), static_cast<const void*>(a.k), static_cast<const void*>(a.v),
                        static_cast<const void*>(a.state), static_cast<const void*>(a.o), static_cast<const void*>(a.scratch)})
    if (!aligned16(p)) fail(op, ": q, k, v, state, o and scratch must be 16-byte aligned");
  const size_t need = gated_delta_chunked_prefill_scratch_bytes(a.T, a.Hv, a.Dk, a.Dv);
  if (a.scratch_bytes < need)
    fail(op, ": scratch of ", std::to_string(a.scratch_bytes), " bytes, need ", std::to_string(need));
  switch (a.Dk) {
    case 16: return launch_chunked<16>(a, stream);
    case 32: return launch_chunked<32>(a, stream);
    case 48: return launch_chunked<48>(a, stream);
    case 64: return launch_chunked<64>(a, stream);
    case 80: return launch_chunked<80>(a, stream);
    case 96: return launch_chunked<96>(a, stream);
    case 112: return launch_chunked<112>(a, stream);
    default: return launch_chunked<128>(a, stream);
  }
}

}  // namespace lily::cuda
