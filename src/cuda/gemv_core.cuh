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

#include "device_common.cuh"
#include "kernel_types.h"

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

// sum(q * x') over one chunk; xv holds the chunk's staged x slots in order.
__device__ __forceinline__ float chunk_dot4(const uint4& c, const float4 (&xv)[8]) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 a = xv[2 * i], b = xv[2 * i + 1];
    const uint32_t hi = w[i] >> 12;
    acc = fmaf(code_at(w[i], 0xFu), a.x, acc);
    acc = fmaf(code_at(w[i], 0xF0u), a.y, acc);
    acc = fmaf(code_at(w[i], 0xF00u), a.z, acc);
    acc = fmaf(code_at(w[i], 0xF000u), a.w, acc);
    acc = fmaf(code_at(w[i], 0xF0000u), b.x, acc);
    acc = fmaf(code_at(hi, 0xF00u), b.y, acc);
    acc = fmaf(code_at(hi, 0xF000u), b.z, acc);
    acc = fmaf(code_at(hi, 0xF0000u), b.w, acc);
  }
  return acc;
}

__device__ __forceinline__ float chunk_dot8(const uint4& c, const float4 (&xv)[4]) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t hi = w[i] >> 16;
    acc = fmaf(code_at(w[i], 0xFFu), xv[i].x, acc);
    acc = fmaf(code_at(w[i], 0xFF00u), xv[i].y, acc);
    acc = fmaf(code_at(hi, 0xFFu), xv[i].z, acc);
    acc = fmaf(code_at(hi, 0xFF00u), xv[i].w, acc);
  }
  return acc;
}

template <int BITS>
__host__ __device__ constexpr int slots_per_chunk() { return BITS == 4 ? 8 : 4; }

// The staged x slots of chunk u.
template <int BITS>
__device__ __forceinline__ void load_x(const float4* xs, int u, float4 (&xv)[slots_per_chunk<BITS>()]) {
#pragma unroll
  for (int i = 0; i < slots_per_chunk<BITS>(); ++i) xv[i] = xs[xs_pos(u * slots_per_chunk<BITS>() + i)];
}

// s * sum(q x) + b * sum(x) of one chunk: codes c, packed scale/bias sb, x slots xv, chunk sum xsum_u.
template <int BITS>
__device__ __forceinline__ float chunk_term(const uint4& c, uint32_t sb, const float4 (&xv)[slots_per_chunk<BITS>()],
                                            float xsum_u) {
  float d;
  if constexpr (BITS == 4) d = chunk_dot4(c, xv);
  else d = chunk_dot8(c, xv);
  return fmaf(bf16_lo(sb), d, bf16_hi(sb) * xsum_u);
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

  // acc[r] += this tile's part of row[r] . x (lane partial sums; reduce afterwards).
  __device__ __forceinline__ void accumulate(int chunks, int ub, const float4* xs, const float* xsum, int lane,
                                             float (&acc)[R]) const {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int u = ub * 32 * U + 32 * j + lane;
      if (u < chunks) {
        float4 xv[slots_per_chunk<BITS>()];
        load_x<BITS>(xs, u, xv);
        const float xsu = xsum[u];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += chunk_term<BITS>(c[j][r], sb[j][r], xv, xsu);
      }
    }
  }
};

// Walks a warp's row groups g = first, first + stride, ... (each split into tile steps
// ub of 32U chunks), loading step i+1 while step i is consumed. The first tile may be
// loaded before the kernel waits on its predecessor (weights are constant):
//   RowWalk<...> walk(first, stride, n_groups, chunks); walk.prefetch(W_of, rows_of, lane);
//   pdl_wait(); stage x; walk.run(W_of, rows_of, xs, xsum, lane, done);
// rows_of(g, row) fills the R rows of group g; W_of(g) is its matrix; done(g, acc) gets
// the warp-reduced sums (every lane holds them).
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

  template <typename WOf, typename RowsOf, typename Done>
  __device__ __forceinline__ void run(WOf W_of, RowsOf rows_of, const float4* xs, const float* xsum, int lane,
                                      Done done) {
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
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
      cur.accumulate(chunks, ub, xs, xsum, lane, acc);
      if (ub == steps - 1) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
        done(g, acc);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
      }
      g = g2;
      ub = ub2;
    }
  }
};

// Shared memory of stage_x: xs [cols/4 float4] + xsum [cols/cpc] + 32 scratch floats (block_sum).
template <int BITS>
__host__ __device__ constexpr size_t stage_bytes(int cols) {
  return static_cast<size_t>(cols) * 4 + static_cast<size_t>(cols / cols_per_chunk<BITS>()) * 4 + 32 * 4;
}

__device__ __forceinline__ float embed_value(const QMat& E, int row, int c) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(E.codes) + static_cast<size_t>(row) * E.chunks() * 4;
  const int per_word = 32 / E.bits;
  const uint32_t q = (words[c / per_word] >> (E.bits * (c % per_word))) & ((1u << E.bits) - 1u);
  const int cpc = 128 / E.bits;
  const uint32_t sb = E.sb[static_cast<size_t>(row) * E.groups() + (c / cpc >> E.gshift)];
  return fmaf(bf16_lo(sb), static_cast<float>(q), bf16_hi(sb));
}

// Builds x (per XSpec) for the block: raw values past the ones a thread holds in
// registers go to raw[xs_pos(f)] (float4 slot f = columns 4f..4f+3), then emit(f, ok, v)
// receives each final slot. emit is called by all
// threads the same number of times (ok = false past the end), so it may shuffle within
// aligned groups of up to 32 consecutive slots. Ends with a barrier.
// A thread's first kHeld slots are loaded together with their norm weights and kept in
// registers, so x and the norm weight arrive in one memory round trip (cols <= 4096 at
// 256 threads), not one before and one after the block reduction. x (in global memory)
// is read through L2 (ld.cg), so a kernel may build x before its PDL wait when the kernel
// that wrote it has completed (device_common.cuh).
template <typename Emit>
__device__ void build_x(const XSpec& X, int cols, float4* raw, float* scratch, Emit emit) {
  constexpr int kHeld = 4;
  const int n4 = cols / 4, tid = threadIdx.x, nt = blockDim.x;
  const bool rms = X.mode == XMode::RmsNorm || X.mode == XMode::EmbedRmsNorm;

  auto raw_value = [&](int f) {
    if (X.mode != XMode::EmbedRmsNorm) return __ldcg(reinterpret_cast<const float4*>(X.x) + f);
    const int row = *X.token;
    const float4 v = make_float4(embed_value(X.embed, row, 4 * f), embed_value(X.embed, row, 4 * f + 1),
                                 embed_value(X.embed, row, 4 * f + 2), embed_value(X.embed, row, 4 * f + 3));
    if (blockIdx.x + blockIdx.y + blockIdx.z == 0) reinterpret_cast<float4*>(X.h_out)[f] = v;  // the first block
    return v;
  };
  auto norm_w = [&](int f) { return rms ? reinterpret_cast<const float4*>(X.w)[f] : make_float4(1.f, 1.f, 1.f, 1.f); };
  auto square_sum = [](float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; };

  // Pass A: raw values (and sums of squares), all loads of the held slots first; only the
  // slots past them go through shared memory (raw).
  float4 held_v[kHeld], held_w[kHeld];
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    const int f = tid + i * nt;
    if (f < n4) {
      held_v[i] = raw_value(f);
      held_w[i] = norm_w(f);
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kHeld; ++i)
    if (tid + i * nt < n4) ss += square_sum(held_v[i]);
  for (int f = tid + kHeld * nt; f < n4; f += nt) {
    const float4 v = raw_value(f);
    ss += square_sum(v);
    raw[xs_pos(f)] = v;
  }

  // No barrier in Plain mode: each thread reads back only the raw slots it stored.
  float inv = 1.0f;
  if (rms) inv = rsqrtf(block_sum(ss, scratch) / cols + X.eps);

  // Pass B: normalise and hand out. The loop bound is uniform so emit sees full warps.
  auto finish = [&](float4 v, float4 w) {
    if (!rms) return v;
    return make_float4(v.x * inv * w.x, v.y * inv * w.y, v.z * inv * w.z, v.w * inv * w.w);
  };
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    if (i * nt >= n4) break;
    const int f = tid + i * nt;
    const bool ok = f < n4;
    emit(f, ok, ok ? finish(held_v[i], held_w[i]) : make_float4(0.f, 0.f, 0.f, 0.f));
  }
  for (int base = kHeld * nt; base < n4; base += nt) {
    const int f = base + tid;
    const bool ok = f < n4;
    emit(f, ok, ok ? finish(raw[xs_pos(f)], norm_w(f)) : make_float4(0.f, 0.f, 0.f, 0.f));
  }
  __syncthreads();
}

// Stages x for the fp32 dot: pre-scaled, swizzled, with its chunk sums (in place).
template <int BITS>
__device__ void stage_x(const XSpec& X, int cols, float4* xs, float* xsum, float* scratch) {
  constexpr int S = slots_per_chunk<BITS>();
  build_x(X, cols, xs, scratch, [&](int f, bool ok, float4 v) {
    float s = v.x + v.y + v.z + v.w;
#pragma unroll
    for (int o = 1; o < S; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (ok) {
      if (f % S == 0) xsum[f / S] = s;
      const float4 p = prescale<BITS>(f);
      xs[xs_pos(f)] = make_float4(v.x * p.x, v.y * p.y, v.z * p.z, v.w * p.w);
    }
  });
}

}  // namespace lily::cuda
