// 4-bit GEMV on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate).
//
// Tiled weights (QMat::tiled): rows in blocks of 16, columns in quantisation groups of
// 64. Block rb, group g is 512 bytes; lane L (gid = L/4, t = L%4) owns 16 of them, one
// 32-bit word per k-step j (16 columns, c = 64g + 16j + ...) holding the nibbles
//   n0 = W[gid][2t]   n4 = W[gid][2t+1]   n1 = W[gid+8][2t]   n5 = W[gid+8][2t+1]
//   n2 = W[gid][2t+8] n6 = W[gid][2t+9]   n3 = W[gid+8][2t+8] n7 = W[gid+8][2t+9]
// so ((w >> 4i) & 0x000F000F) | 0x43004300 is A-fragment register i as two bf16 128 + q.
// Scales and biases: sb[(rb * G + g) * 16 + r] for row r of the block.
// x is staged as bf16 hi + lo (x ~ hi + lo to ~16 bits): B column n holds hi for even n,
// lo for odd n, so C[r][2t] + C[r][2t+1] = W[r] . x for every lane, and per group
//   y[r] += s * (C - 128 * sum(x)) + b * sum(x).
#pragma once
#include <cstdint>
#include <type_traits>

#include "common/async_copy.cuh"
#include "qmatmul/qmatmul_decode_fma.cuh"

namespace lily::cuda {

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One lop3 a register ((w & m) | c, both constants in it): the compiler's own mask then
// or takes two, and the dequantisation is most of a tile's instructions (perf-log §20).
__device__ __forceinline__ void dequant_word(uint32_t w, uint32_t (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(a[i]) : "r"(w >> (4 * i)), "r"(0x000F000Fu), "r"(0x43004300u));
}

// Staged x of group g for this lane: 8 words (b0, b1 of k-steps 0..3), hi or lo by gid parity.
__device__ __forceinline__ const uint4* xfrag(const uint4* xf, int g, int lane) {
  return xf + (((g * 4 + (lane & 3)) * 2 + ((lane >> 2) & 1)) * 2);
}

// (W[gid] . x, W[gid+8] . x) over group g before scale and offset: 4 mmas.
__device__ __forceinline__ float2 group_mma(const uint4& codes, const uint4* xf, int g, int lane) {
  const uint4* p = xfrag(xf, g, lane);
  const uint4 x0 = p[0], x1 = p[1];
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  uint32_t a[4];
  dequant_word(codes.x, a);
  mma_16816(c, a, x0.x, x0.y);
  dequant_word(codes.y, a);
  mma_16816(c, a, x0.z, x0.w);
  dequant_word(codes.z, a);
  mma_16816(c, a, x1.x, x1.y);
  dequant_word(codes.w, a);
  mma_16816(c, a, x1.z, x1.w);
  return make_float2(c[0] + c[1], c[2] + c[3]);
}

// s * (v - 128 sum) + b * sum for a packed bf16 scale|bias.
__device__ __forceinline__ float group_term(uint32_t sb, float v, float xsum) {
  const float s = bf16_lo(sb), b = bf16_hi(sb);
  return fmaf(s, v, (b - 128.0f * s) * xsum);
}

// Shared memory of stage_x_mma for T x rows: fragments (T * cols * 4 bytes), group sums
// (T x cols/64 padded to 4), the raw x (T * cols floats), scratch (block sums).
__host__ __device__ constexpr int mma_sum_stride(int cols) { return (cols / 64 + 3) / 4 * 4; }
__host__ __device__ constexpr size_t stage_mma_bytes(int cols, int T = 1) {
  return static_cast<size_t>(T) * (static_cast<size_t>(cols) * 8 + mma_sum_stride(cols) * 4 + 32 * 4);
}

// The regions of stage_x_mma carved from dynamic shared memory (stage_mma_bytes(cols, T)).
struct MmaStage {
  uint4* xf;       // [T][cols / 4] x fragments
  float* xsum;     // [T][mma_sum_stride(cols)] group sums
  float* raw;      // [T][cols] raw x
  float* scratch;  // 32 T floats
};
__device__ __forceinline__ MmaStage mma_stage(uint4* smem, int cols, int T = 1) {
  float* xsum = reinterpret_cast<float*>(smem + static_cast<size_t>(T) * cols / 4);
  float* raw = xsum + T * mma_sum_stride(cols);
  return {smem, xsum, raw, raw + static_cast<size_t>(T) * cols};
}

// Builds T x rows (XSpec) into the fragment layout and the per-group sums of hi + lo.
template <int T = 1>
__device__ inline void stage_x_mma(const XSpec& X, int cols, const MmaStage& st) {
  uint32_t* xw = reinterpret_cast<uint32_t*>(st.xf);
  build_x<T>(X, cols, reinterpret_cast<float4*>(st.raw), cols, st.scratch, [&](int row, int f, bool ok, float4 v) {
    // hi = bf16(x), lo = bf16(x - hi), two values per cvt: [part][pair] words of columns (4f, 4f+1), (4f+2, 4f+3).
    const uint32_t hi[2] = {pack_bf16(v.x, v.y), pack_bf16(v.z, v.w)};
    const float h[4] = {bf16_lo(hi[0]), bf16_hi(hi[0]), bf16_lo(hi[1]), bf16_hi(hi[1])};
    const uint32_t lo[2] = {pack_bf16(v.x - h[0], v.y - h[1]), pack_bf16(v.z - h[2], v.w - h[3])};
    const float l[4] = {bf16_lo(lo[0]), bf16_hi(lo[0]), bf16_lo(lo[1]), bf16_hi(lo[1])};
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) sum += h[i] + l[i];
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (!ok) return;
    const int c = 4 * f, g = c >> 6, p = c & 15, j = (c & 63) >> 4, t = (p & 7) >> 1, word = 2 * j + (p >> 3);
    uint32_t* rw = xw + static_cast<size_t>(row) * cols;
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      const uint32_t* w = part ? lo : hi;
      rw[((g * 4 + t) * 2 + part) * 8 + word] = w[0];
      rw[((g * 4 + t + 1) * 2 + part) * 8 + word] = w[1];
    }
    if ((f & 15) == 0) st.xsum[row * mma_sum_stride(cols) + g] = sum;
  });
}

// With T x rows staged, B column n of an mma holds row n / 2 (hi for even n, lo for odd; rows
// past T repeat the last), so lane L supplies row min(L / 8, T - 1) as B, and its C columns
// 2t, 2t + 1 (t = L % 4) are row t's: one mma computes every row, each as a T = 1 step would.
struct MmaRows {
  const uint4* xf;    // the fragments the lane loads (its B row)
  const float* xsum;  // the group sums of its C row
  int row;            // its C row (L % 4; outputs valid when < T)
};
template <int T>
__device__ __forceinline__ MmaRows mma_rows(const MmaStage& st, int cols, int lane) {
  const int b = min(lane >> 3, T - 1), c = lane & 3;
  return {st.xf + static_cast<size_t>(b) * cols / 4, st.xsum + min(c, T - 1) * mma_sum_stride(cols), c};
}

// f(std::integral_constant<int, GPW>{}) for the groups per warp GPW in {1, 2, 4, 8} with
// which `warps` warps cover the cols / 64 groups of a row block (the kernels' template
// argument; it also fixes which warp sums which groups, i.e. the order of summation).
template <class F>
void with_groups_per_warp(int cols, int warps, const char* op, F f) {
  const int gpw = (cols / 64 + warps - 1) / warps;
  if (gpw <= 1) f(std::integral_constant<int, 1>{});
  else if (gpw <= 2) f(std::integral_constant<int, 2>{});
  else if (gpw <= 4) f(std::integral_constant<int, 4>{});
  else if (gpw <= 8) f(std::integral_constant<int, 8>{});
  else fail(op, ": tiled weights with more than ", std::to_string(8 * 64 * warps), " columns are not supported");
}

// A warp's tiles of one 16-row block: groups g0 .. g0+N-1 (those < G), one 16-byte
// load per lane each, plus the two rows' scale|bias words.
template <int N>
struct MmaTiles {
  uint4 c[N];
  uint32_t s0[N], s1[N];

  __device__ __forceinline__ void load(const QMat& W, int rb, int g0, int G, int lane) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int g = g0 + i;
      if (g < G) {
        const size_t t = static_cast<size_t>(rb) * G + g;
        c[i] = load_stream(W.codes + t * 32 + lane);
        s0[i] = __ldg(W.sb + t * 16 + (lane >> 2));
        s1[i] = __ldg(W.sb + t * 16 + (lane >> 2) + 8);
      }
    }
  }

  // y0 += W[gid] . x, y1 += W[gid+8] . x over these groups (x of groups xg0 + i).
  __device__ __forceinline__ void accumulate(int g0, int G, int xg0, const uint4* xf, const float* xsum, int lane,
                                             float& y0, float& y1, float weight = 1.0f) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (g0 + i < G) {
        const float2 v = group_mma(c[i], xf, xg0 + i, lane);
        const float xs = xsum[xg0 + i];
        y0 = fmaf(weight, group_term(s0[i], v.x, xs), y0);
        y1 = fmaf(weight, group_term(s1[i], v.y, xs), y1);
      }
    }
  }
};

// A warp's ring of S slots of MmaTiles<N> in shared memory, filled by cp.async: S - 1 tasks'
// tiles stay in flight while one is computed, with no registers held for them. Slot: N
// groups of 512 code bytes (lane L's 16 at 16 L) and 64 scale|bias bytes (rows 0..15).
template <int N, int S>
struct MmaTileRing {
  static constexpr size_t kBytes = static_cast<size_t>(S) * N * (512 + 64);
  uint4* codes;  // [S][N][32]
  uint32_t* sb;  // [S][N][16]

  __device__ explicit MmaTileRing(void* base)
      : codes(static_cast<uint4*>(base)), sb(reinterpret_cast<uint32_t*>(codes + S * N * 32)) {}

  // Starts copying row block rb's groups g0 .. g0+N-1 (those < G) into slot s; commits one
  // cp.async group either way (load = false: an empty one), so waits count tasks.
  __device__ __forceinline__ void load(int s, bool load, const QMat& W, int rb, int g0, int G, int lane) {
    if (load)
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (g0 + i < G) {
          const size_t t = static_cast<size_t>(rb) * G + g0 + i;
          cp_async16(smem_addr(codes + (s * N + i) * 32 + lane), W.codes + t * 32 + lane);
          if (lane < 4) cp_async16(smem_addr(sb + (s * N + i) * 16 + 4 * lane), W.sb + t * 16 + 4 * lane);
        }
      }
    cp_async_commit();
  }

  // Slot s in registers, once its copies have landed (cp_async_wait, then __syncwarp: the
  // scale words were copied by lanes 0..3).
  __device__ __forceinline__ MmaTiles<N> tiles(int s, int g0, int G, int lane) const {
    MmaTiles<N> t;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (g0 + i < G) {
        t.c[i] = codes[(s * N + i) * 32 + lane];
        t.s0[i] = sb[(s * N + i) * 16 + (lane >> 2)];
        t.s1[i] = sb[(s * N + i) * 16 + (lane >> 2) + 8];
      }
    }
    return t;
  }
};

// Per-row totals of a 16-row block over the block's warps, for T x rows: every warp calls
// put_rows16 with its (y0, y1) (C row lane % 4); after a barrier, row_total(red + t *
// warps, r) sums row r of x row t in warp order (deterministic). red is [T][warps][16]
// (row_total's n rows: the block's warps by default); alternate two of them between row blocks.
template <int T = 1>
__device__ __forceinline__ void put_rows16(float (*red)[16], float y0, float y1) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
  const int at = T == 1 ? warp : t * static_cast<int>(blockDim.x >> 5) + warp;
  if (t < T) {
    red[at][lane >> 2] = y0;
    red[at][(lane >> 2) + 8] = y1;
  }
}

__device__ __forceinline__ float row_total(const float (*red)[16], int r, int n = static_cast<int>(blockDim.x >> 5)) {
  float y = 0.0f;
  for (int w = 0; w < n; ++w) y += red[w][r];
  return y;
}

// put_rows16 + barrier + row_total for thread i < 16 T: x row i / 16, row i % 16 of the block.
template <int T = 1>
__device__ __forceinline__ float reduce_rows16(float (*red)[16], float y0, float y1) {
  put_rows16<T>(red, y0, y1);
  __syncthreads();
  if constexpr (T == 1) return threadIdx.x < 16 ? row_total(red, threadIdx.x) : 0.0f;
  const int warps = blockDim.x >> 5;
  return threadIdx.x < 16 * T ? row_total(red + (threadIdx.x >> 4) * warps, threadIdx.x & 15) : 0.0f;
}

}  // namespace lily::cuda
