// The 4/8-bit MLX affine dot product shared by every weight-reading kernel.
//
// A row of W [rows, cols] is read in 16-byte chunks (32 codes at 4 bits, 16 at 8 bits).
// With q the unsigned codes, s/b the group's bf16 scale and bias:
//   y[r] = sum_chunks  s * sum(q * x) + b * sum(x)                          (fp32)
// sum(x) per chunk is computed once per block when x is staged (it is the same for
// every row). Codes become floats without shifts: (word & mask) | 0x4B000000 is the
// float 2^23 + q * 2^p for the bits p the mask selects, so subtracting 2^23 leaves
// q * 2^p exactly; x is pre-scaled by 2^-p when staged, so q * x is exact per term.
#pragma once
#include <cstdint>

#include "common/device_common.cuh"
#include "common/kernel_types.h"

namespace lily::cuda {

template <int BITS>
__host__ __device__ constexpr int cols_per_chunk() { return 128 / BITS; }

// x is staged in shared memory as float4 slots; slot f lives at xs_pos(f), which spreads
// the 8 (4-bit) or 4 (8-bit) slots of consecutive chunks over all banks.
__device__ __forceinline__ int xs_pos(int f) { return f ^ ((f >> 3) & 7); }

// Pre-scale of the 4 columns of float4 slot f (see the file comment).
template <int BITS>
__device__ __forceinline__ float4 prescale(int f) {
  if (BITS == 4) {
    return (f & 1) ? make_float4(0x1p-16f, 0x1p-8f, 0x1p-12f, 0x1p-16f) : make_float4(1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f);
  } else {
    return make_float4(1.0f, 0x1p-8f, 1.0f, 0x1p-8f);
  }
}

__device__ __forceinline__ float code_at(uint32_t w, uint32_t mask) {
  return __uint_as_float((w & mask) | 0x4B000000u) - 8388608.0f;
}

template <int BITS>
__host__ __device__ constexpr int slots_per_chunk() { return BITS == 4 ? 8 : 4; }

// Calls f(k, q_k) for the codes of one chunk in column order, each as the exact float
// q * 2^p (x is pre-scaled to match, see the file comment).
template <int BITS, typename F>
__device__ __forceinline__ void for_each_code(const uint4& c, F f) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (BITS == 4) {
      const uint32_t hi = w[i] >> 12;
      f(8 * i + 0, code_at(w[i], 0xFu));
      f(8 * i + 1, code_at(w[i], 0xF0u));
      f(8 * i + 2, code_at(w[i], 0xF00u));
      f(8 * i + 3, code_at(w[i], 0xF000u));
      f(8 * i + 4, code_at(w[i], 0xF0000u));
      f(8 * i + 5, code_at(hi, 0xF00u));
      f(8 * i + 6, code_at(hi, 0xF000u));
      f(8 * i + 7, code_at(hi, 0xF0000u));
    } else {
      const uint32_t hi = w[i] >> 16;
      f(4 * i + 0, code_at(w[i], 0xFFu));
      f(4 * i + 1, code_at(w[i], 0xFF00u));
      f(4 * i + 2, code_at(hi, 0xFFu));
      f(4 * i + 3, code_at(hi, 0xFF00u));
    }
  }
}

__device__ __forceinline__ float component(const float4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// sum(q * x') over one chunk as one fma chain in column order; xv holds its staged x
// slots. Codes c are dequantised on the way; q are codes dequantised once (dequant_chunk)
// for several x rows, giving each row the same chain.
template <int BITS>
__device__ __forceinline__ float chunk_dot(const uint4& c, const float4 (&xv)[slots_per_chunk<BITS>()]) {
  float acc = 0.0f;
  for_each_code<BITS>(c, [&](int k, float q) { acc = fmaf(q, component(xv[k / 4], k % 4), acc); });
  return acc;
}
template <int BITS>
__device__ __forceinline__ void dequant_chunk(const uint4& c, float (&q)[cols_per_chunk<BITS>()]) {
  for_each_code<BITS>(c, [&](int k, float v) { q[k] = v; });
}
template <int BITS>
__device__ __forceinline__ float chunk_dot(const float (&q)[cols_per_chunk<BITS>()],
                                          const float4 (&xv)[slots_per_chunk<BITS>()]) {
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < cols_per_chunk<BITS>(); ++k) acc = fmaf(q[k], component(xv[k / 4], k % 4), acc);
  return acc;
}

// One x row staged for the fp32 dot (stage_x), in floats: xs [cols/4 float4] then xsum
// [cols/cpc], rounded up to float4s. T rows lie this far apart, then the scratch floats.
template <int BITS>
__host__ __device__ constexpr int stage_floats(int cols) {
  return (cols + cols / cols_per_chunk<BITS>() + 3) / 4 * 4;
}

// The staged x slots of chunk u.
template <int BITS>
__device__ __forceinline__ void load_x(const float4* xs, int u, float4 (&xv)[slots_per_chunk<BITS>()]) {
#pragma unroll
  for (int i = 0; i < slots_per_chunk<BITS>(); ++i) xv[i] = xs[xs_pos(u * slots_per_chunk<BITS>() + i)];
}

// s * sum(q x) + b * sum(x) of one chunk: codes q (a uint4 or dequant_chunk's floats),
// packed scale/bias sb, x slots xv, chunk sum xsum_u.
template <int BITS, typename Codes>
__device__ __forceinline__ float chunk_term(const Codes& q, uint32_t sb, const float4 (&xv)[slots_per_chunk<BITS>()],
                                            float xsum_u) {
  return fmaf(bf16_lo(sb), chunk_dot<BITS>(q, xv), bf16_hi(sb) * xsum_u);
}

// One warp's tile of W: R rows x U chunks per lane (chunks ub*32U + 32j + lane), held in
// registers so that the next tile can be loaded while this one is consumed.
template <int BITS, int R, int U>
struct RowTile {
  uint4 c[U][R];
  uint32_t sb[U][R];

  __device__ __forceinline__ void load(const QMat& W, const int (&row)[R], int ub, int lane) {
    const int chunks = W.chunks(), groups = W.groups();
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int u = min(ub * 32 * U + 32 * j + lane, chunks - 1);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        c[j][r] = load_stream(W.codes + static_cast<size_t>(row[r]) * chunks + u);
        sb[j][r] = __ldg(W.sb + static_cast<size_t>(row[r]) * groups + (u >> W.gshift));
      }
    }
  }

  // acc[t][r] += this tile's part of row[r] . x_t (lane partial sums; reduce afterwards).
  // Each chunk is dequantised once for all T x rows (staged xs_stride float4s / sum_stride
  // floats apart); every row's fma chain is the one a T = 1 walk runs.
  template <int T>
  __device__ __forceinline__ void accumulate(int chunks, int ub, const float4* xs, int xs_stride, const float* xsum,
                                             int sum_stride, int lane, float (&acc)[T][R]) const {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int u = ub * 32 * U + 32 * j + lane;
      if (u < chunks) {
        if constexpr (T == 1) {  // x loaded once for the R rows
          float4 xv[slots_per_chunk<BITS>()];
          load_x<BITS>(xs, u, xv);
          const float xsu = xsum[u];
#pragma unroll
          for (int r = 0; r < R; ++r) acc[0][r] += chunk_term<BITS>(c[j][r], sb[j][r], xv, xsu);
        } else {  // the codes held once for the T rows
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float q[cols_per_chunk<BITS>()];
            dequant_chunk<BITS>(c[j][r], q);
#pragma unroll
            for (int t = 0; t < T; ++t) {
              float4 xv[slots_per_chunk<BITS>()];
              load_x<BITS>(xs + t * xs_stride, u, xv);
              acc[t][r] += chunk_term<BITS>(q, sb[j][r], xv, xsum[t * sum_stride + u]);
            }
          }
        }
      }
    }
  }
};

// Walks a warp's row groups g = first, first + stride, ... (each split into tile steps
// ub of 32U chunks), loading step i+1 while step i is consumed. The first tile may be
// loaded before the kernel waits on its predecessor (weights are constant):
//   RowWalk<...> walk(first, stride, n_groups, chunks); walk.prefetch(W_of, rows_of, lane);
//   pdl_wait(); stage x; walk.run<T>(W_of, rows_of, xs, xsum, lane, done);
// rows_of(g, row) fills the R rows of group g; W_of(g) is its matrix; done(g, acc) gets
// the warp-reduced sums acc[t][r] of x row t (every lane holds them). T x rows (staged
// stage_floats<BITS>(cols) apart) share each tile; row t sums exactly as a T = 1 walk.
template <int BITS, int R, int U>
struct RowWalk {
  int g, ub, stride, n_groups, chunks, steps;
  RowTile<BITS, R, U> next;

  __device__ RowWalk(int first, int stride_, int n_groups_, int chunks_)
      : g(first), ub(0), stride(stride_), n_groups(n_groups_), chunks(chunks_), steps((chunks_ + 32 * U - 1) / (32 * U)) {}

  template <typename WOf, typename RowsOf>
  __device__ __forceinline__ void prefetch(WOf W_of, RowsOf rows_of, int lane) {
    if (g >= n_groups) return;
    int row[R];
    rows_of(g, row);
    next.load(W_of(g), row, 0, lane);
  }

  template <int T = 1, typename WOf, typename RowsOf, typename Done>
  __device__ __forceinline__ void run(WOf W_of, RowsOf rows_of, const float4* xs, const float* xsum, int lane,
                                      Done done) {
    const int xs_stride = stage_floats<BITS>(chunks * cols_per_chunk<BITS>()) / 4;
    const int sum_stride = stage_floats<BITS>(chunks * cols_per_chunk<BITS>());
    float acc[T][R];
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[t][r] = 0.0f;
    while (g < n_groups) {
      const RowTile<BITS, R, U> cur = next;
      int g2 = g, ub2 = ub + 1;
      if (ub2 == steps) {
        ub2 = 0;
        g2 = g + stride;
      }
      if (g2 < n_groups) {
        int row[R];
        rows_of(g2, row);
        next.load(W_of(g2), row, ub2, lane);
      }
      cur.template accumulate<T>(chunks, ub, xs, xs_stride, xsum, sum_stride, lane, acc);
      if (ub == steps - 1) {
#pragma unroll
        for (int t = 0; t < T; ++t)
#pragma unroll
          for (int r = 0; r < R; ++r) acc[t][r] = warp_sum(acc[t][r]);
        done(g, acc);
#pragma unroll
        for (int t = 0; t < T; ++t)
#pragma unroll
          for (int r = 0; r < R; ++r) acc[t][r] = 0.0f;
      }
      g = g2;
      ub = ub2;
    }
  }
};

template <int BITS>
__host__ __device__ constexpr size_t stage_bytes(int cols, int T = 1) {
  return (static_cast<size_t>(T) * stage_floats<BITS>(cols) + 32 * T) * 4;
}
// The regions of stage_x carved from dynamic shared memory (stage_bytes(cols, T)).
struct FmaStage {
  float4* xs;      // row t at xs + t * stage_floats / 4
  float* xsum;     // row t at xsum + t * stage_floats
  float* scratch;  // 32 T floats: block sums
};
template <int BITS>
__device__ __forceinline__ FmaStage fma_stage(float4* smem, int cols, int T = 1) {
  float* f = reinterpret_cast<float*>(smem);
  return {smem, f + cols, f + T * stage_floats<BITS>(cols)};
}

__device__ __forceinline__ float embed_value(const QMat& E, int row, int c) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(E.codes) + static_cast<size_t>(row) * E.chunks() * 4;
  const int per_word = 32 / E.bits;
  const uint32_t q = (words[c / per_word] >> (E.bits * (c % per_word))) & ((1u << E.bits) - 1u);
  const int cpc = 128 / E.bits;
  const uint32_t sb = E.sb[static_cast<size_t>(row) * E.groups() + (c / cpc >> E.gshift)];
  return fmaf(bf16_lo(sb), static_cast<float>(q), bf16_hi(sb));
}

// Builds T x rows (per XSpec: row t at X.x + t * cols, or the embedding of X.token[t],
// stored to X.h_out + t * cols) for the block: raw values past the ones a thread holds in
// registers go to raw + t * raw_stride floats (slot f of a row at xs_pos(f)), then
// emit(t, f, ok, v) receives each final slot (float4 slot f = columns 4f..4f+3). emit is
// called by all threads the same number of times (ok = false past the end), so it may
// shuffle within aligned groups of up to 32 consecutive slots. Ends with a barrier.
// A thread's first kHeld slots of every row are loaded together with their norm weights
// and kept in registers, so x and the norm weight arrive in one memory round trip (cols
// <= 4096 at 256 threads for T <= 2), not one before and one after the block reduction;
// the T rows' sums of squares share one reduction. x (in global memory) is read through
// L2 (ld.cg), so a kernel may build x before its PDL wait when the kernel that wrote it
// has completed (device_common.cuh).
template <int T = 1, typename Emit>
__device__ void build_x(const XSpec& X, int cols, float4* raw, int raw_stride, float* scratch, Emit emit) {
  constexpr int kHeld = T <= 2 ? 4 : 2;
  const int n4 = cols / 4, tid = threadIdx.x, nt = blockDim.x;
  const bool rms = X.mode == XMode::RmsNorm || X.mode == XMode::EmbedRmsNorm;

  auto raw_value = [&](int t, int f) {
    if (X.mode != XMode::EmbedRmsNorm) return __ldcg(reinterpret_cast<const float4*>(X.x + static_cast<size_t>(t) * cols) + f);
    const int row = X.token[t];
    const float4 v = make_float4(embed_value(X.embed, row, 4 * f), embed_value(X.embed, row, 4 * f + 1),
                                 embed_value(X.embed, row, 4 * f + 2), embed_value(X.embed, row, 4 * f + 3));
    if (blockIdx.x + blockIdx.y + blockIdx.z == 0)  // the first block
      reinterpret_cast<float4*>(X.h_out + static_cast<size_t>(t) * cols)[f] = v;
    return v;
  };
  auto norm_w = [&](int f) { return rms ? reinterpret_cast<const float4*>(X.w)[f] : make_float4(1.f, 1.f, 1.f, 1.f); };
  auto square_sum = [](float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; };
  auto raw_row = [&](int t) { return raw + static_cast<size_t>(t) * raw_stride / 4; };

  // Pass A: raw values (and sums of squares), all loads of the held slots first; only the
  // slots past them go through shared memory (raw).
  float4 held_v[T][kHeld], held_w[kHeld];
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    const int f = tid + i * nt;
    if (f < n4) {
#pragma unroll
      for (int t = 0; t < T; ++t) held_v[t][i] = raw_value(t, f);
      held_w[i] = norm_w(f);
    }
  }
  float ss[T];
#pragma unroll
  for (int t = 0; t < T; ++t) {
    ss[t] = 0.0f;
#pragma unroll
    for (int i = 0; i < kHeld; ++i)
      if (tid + i * nt < n4) ss[t] += square_sum(held_v[t][i]);
  }
  for (int f = tid + kHeld * nt; f < n4; f += nt) {
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float4 v = raw_value(t, f);
      ss[t] += square_sum(v);
      raw_row(t)[xs_pos(f)] = v;
    }
  }

  // No barrier in Plain mode: each thread reads back only the raw slots it stored.
  float inv[T];
#pragma unroll
  for (int t = 0; t < T; ++t) inv[t] = 1.0f;
  if (rms) {
    if constexpr (T == 1) {
      inv[0] = rsqrtf(block_sum(ss[0], scratch) / cols + X.eps);
    } else {
      block_sums(ss, scratch);
#pragma unroll
      for (int t = 0; t < T; ++t) inv[t] = rsqrtf(ss[t] / cols + X.eps);
    }
  }

  // Pass B: normalise and hand out. The loop bound is uniform so emit sees full warps.
  auto finish = [&](int t, float4 v, float4 w) {
    if (!rms) return v;
    return make_float4(v.x * inv[t] * w.x, v.y * inv[t] * w.y, v.z * inv[t] * w.z, v.w * inv[t] * w.w);
  };
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    if (i * nt >= n4) break;
    const int f = tid + i * nt;
    const bool ok = f < n4;
#pragma unroll
    for (int t = 0; t < T; ++t) emit(t, f, ok, ok ? finish(t, held_v[t][i], held_w[i]) : make_float4(0.f, 0.f, 0.f, 0.f));
  }
  for (int base = kHeld * nt; base < n4; base += nt) {
    const int f = base + tid;
    const bool ok = f < n4;
#pragma unroll
    for (int t = 0; t < T; ++t) emit(t, f, ok, ok ? finish(t, raw_row(t)[xs_pos(f)], norm_w(f)) : make_float4(0.f, 0.f, 0.f, 0.f));
  }
  __syncthreads();
}

// Stages T x rows for the fp32 dot (fma_stage's regions): pre-scaled, swizzled, with their
// chunk sums (in place: a row's raw overflow goes to its own xs).
template <int BITS, int T = 1>
__device__ void stage_x(const XSpec& X, int cols, const FmaStage& st) {
  constexpr int S = slots_per_chunk<BITS>();
  const int stride = stage_floats<BITS>(cols);
  build_x<T>(X, cols, st.xs, stride, st.scratch, [&](int t, int f, bool ok, float4 v) {
    float s = v.x + v.y + v.z + v.w;
#pragma unroll
    for (int o = 1; o < S; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (ok) {
      if (f % S == 0) st.xsum[t * stride + f / S] = s;
      const float4 p = prescale<BITS>(f);
      st.xs[t * stride / 4 + xs_pos(f)] = make_float4(v.x * p.x, v.y * p.y, v.z * p.z, v.w * p.w);
    }
  });
}

}  // namespace lily::cuda
