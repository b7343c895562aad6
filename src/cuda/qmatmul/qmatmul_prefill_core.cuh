// Pieces shared by the three qmatmul_prefill kernels (qmatmul_prefill.cu: exact affine maths; qmatmul_prefill_bf16w.cu:
// bf16-rounded weights; qmatmul_prefill_wgmma.cu: the same on warpgroup MMA, primitives in
// wgmma.cuh): the first-k-step mma, the bf16 weight dequantisation, the block's rows and
// cp.async plan, and the host entries of the two bf16-weight kernels (qmatmul_prefill() validates
// and dispatches to them).
#pragma once
#include <cstdint>

#include "common/async_copy.cuh"
#include "qmatmul/qmatmul_prefill.h"
#include "qmatmul/qmatmul_decode_mma.cuh"
#include "common/wgmma.cuh"

namespace lily::cuda {

// d = a · b with a fresh accumulator (the first k-step of a group).
__device__ __forceinline__ void mma_16816_first(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

__device__ __forceinline__ uint32_t kstep_word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// The true bf16 weights of A register i of k-step word `code` (nibbles as in qmatmul_decode_mma.cuh),
// s2 / b2 the row's scale / bias twice: ((code >> 4i) & 0x000F000F) | 0x43004300 is two
// bf16 128 + q (one lop3: both masks in one instruction), q = (128 + q) - 128 is exact,
// and the bf16x2 fma rounds once: w = bf16(s q + b), what MLX's kernels dequantise to.
__device__ __forceinline__ uint32_t weights_bf16x2(uint32_t code, int i, uint32_t s2, uint32_t b2) {
  uint32_t biased, q, w;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(biased) : "r"(code >> (4 * i)), "r"(0x000F000Fu), "r"(0x43004300u));
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(q) : "r"(biased), "r"(0x43004300u));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(w) : "r"(q), "r"(s2), "r"(b2));
  return w;
}

// A 32-bit store to shared memory by address (qmatmul_prefill_wgmma.cu writes its dequantised B
// tile in the 128B-swizzle layout of wgmma.cuh; fence_proxy_async_smem before wgmma reads it).
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// What one block works on: GEMM rows row0 .. row0 + rows - 1 (a row tile of blockIdx.y
// when dense, tile-list entry {expert, row0, rows} when grouped) against the weight row
// blocks lb0, lb0 + 1, ... (blockIdx.x) of the expert's matrix of n_feat features, i.e.
// rb0, rb0 + 1, ... of W's n_rb.
struct BlockSpan {
  int expert = 0, row0 = 0, rows = 0, n_feat = 0, lb0 = 0, rb0 = 0, n_rb = 0;
  // Row block lb of the tile exists (in the expert's matrix and in W).
  __device__ __forceinline__ bool has_block(int lb) const {
    return 16 * (lb0 + lb) < n_feat && rb0 + lb >= 0 && rb0 + lb < n_rb;
  }
};

// The span of this block, with blocks_per_tile row blocks per feature tile. False:
// nothing to do (past *n_tiles, or no rows). clip: the most rows of a grouped tile (the
// tile_m its list was built for, <= BM).
template <int BM>
__device__ __forceinline__ bool block_span(const GemmArgs& a, int blocks_per_tile, BlockSpan& s, int clip = BM) {
  s.row0 = blockIdx.y * BM;
  s.rows = min(BM, a.M - s.row0);
  if (a.tiles != nullptr) {
    if (static_cast<int>(blockIdx.y) >= *a.n_tiles) return false;
    const int4 t = a.tiles[blockIdx.y];
    s.expert = t.x;
    s.row0 = t.y;
    s.rows = min(min(t.z, clip), a.M - t.y);
  }
  s.n_feat = a.tiles ? a.expert_rows : a.W.rows;
  s.lb0 = blockIdx.x * blocks_per_tile;
  s.rb0 = s.expert * (a.expert_rows / 16) + s.lb0;
  s.n_rb = (a.W.rows + 15) / 16;
  return s.row0 >= 0 && s.rows > 0;
}

// A block's cp.async plan, the same for all three kernels (T: their tile constants): per
// group g of 64 columns one stage holds the block's weight tiles as stored (codes at
// T::kCodeOff, the scale|bias words at T::kSbOff) and its X tile [BM][64], whose 16-byte
// chunk c of row r goes to T::x_chunk(r, c) (padded rows, or the wgmma swizzle). The
// sources are kept as element offsets at group 0, 32-bit to spare registers; -1 marks a
// missing row block or row, copied as 0 bytes, i.e. zero-filled (zero weights, zero rows).
template <class T>
struct StagePlan {
  int code_off[T::kCodeCopies];  // uint4 of W.codes: tile (block, group 0), lane part
  int sb_off = -1;               // threads < kSbThreads: uint32 of W.sb, 4 of a block's 16 words
  int x_row[T::kXCopies];        // X row of this thread's chunks (stage layout [row][8 chunks of 8 bf16])

  __device__ __forceinline__ StagePlan(const GemmArgs& a, int tid, const BlockSpan& s, int G) {
#pragma unroll
    for (int i = 0; i < T::kCodeCopies; ++i) {
      const int c = tid + i * T::kThreads, lb = c >> 5;  // stage layout [block][lane] uint4
      code_off[i] = s.has_block(lb) ? (s.rb0 + lb) * G * 32 + (c & 31) : -1;
    }
    if (tid < T::kSbThreads && s.has_block(tid >> 2)) sb_off = (s.rb0 + (tid >> 2)) * G * 16 + 4 * (tid & 3);
#pragma unroll
    for (int i = 0; i < T::kXCopies; ++i) {
      const int r = (tid + i * T::kThreads) >> 3;
      x_row[i] = r < s.rows ? (a.x_rows ? a.x_rows[s.row0 + r] : s.row0 + r) : -1;
    }
  }

  // Group g (< G) into its stage of the S-stage ring at shared address smem0, as one
  // commit group; past G an empty one, so wait counts stay uniform.
  __device__ __forceinline__ void stage(const GemmArgs& a, uint32_t smem0, int tid, int g, int G) const {
    if (g < G) load(a, smem0 + (g % T::kStages) * T::kStageBytes, tid, g);
    cp_async_commit();
  }

  // Issues the copies of group g into the stage at shared address st (no commit).
  __device__ __forceinline__ void load(const GemmArgs& a, uint32_t st, int tid, int g) const {
#pragma unroll
    for (int i = 0; i < T::kCodeCopies; ++i) {
      const bool ok = code_off[i] >= 0;
      cp_async16(st + T::kCodeOff + (tid + i * T::kThreads) * 16, a.W.codes + (ok ? code_off[i] + g * 32 : 0),
                 ok ? 16 : 0);
    }
    if (tid < T::kSbThreads) {
      const bool ok = sb_off >= 0;
      cp_async16(st + T::kSbOff + tid * 16, a.W.sb + (ok ? sb_off + g * 16 : 0), ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < T::kXCopies; ++i) {
      const int c = tid + i * T::kThreads;
      if (T::kXChunks % T::kThreads != 0 && c >= T::kXChunks) continue;
      const bool ok = x_row[i] >= 0;
      const uint16_t* src = a.x + (ok ? static_cast<size_t>(x_row[i]) * a.ldx + 64 * g + 8 * (c & 7) : 0);
      cp_async16(st + T::x_chunk(c >> 3, c & 7), src, ok ? 16 : 0);
    }
  }
};

// The epilogue of both kernels. Lane (gid = lane / 4, t = lane % 4) of warp (wn, wm) holds
// acc[rb][nt][i] = y[feature 16 (lb0 + kRB wn + rb) + gid + 8 (i / 2)][row 8 (wm kNT + nt) + 2t + i % 2]
// of the span's rows row0 .. row0 + rows - 1: every (row, feature) belongs to exactly one lane.
template <int kRB, int kNT>
__device__ __forceinline__ void store_tile(const GemmArgs& a, const float (&acc)[kRB][kNT][4], const BlockSpan& s,
                                           int wn, int wm, int lane) {
  const int gid = lane >> 2, row0 = s.row0, rows = s.rows, lb0 = s.lb0, n_feat = s.n_feat;
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = 8 * (wm * kNT + nt) + 2 * (lane & 3) + h;
      if (n >= rows) continue;
      const int r = row0 + n, out = a.y_rows ? a.y_rows[r] : r;
      if (a.epi == GemmEpilogue::SwiGlu) {
        // Row block lb = 8 gate rows then their 8 up rows: outputs 8 lb + gid.
        uint16_t* dst = a.act + static_cast<size_t>(out) * a.ldy;
#pragma unroll
        for (int rb = 0; rb < kRB; ++rb) {
          const int lb = lb0 + wn * kRB + rb;
          if (16 * lb < n_feat) dst[8 * lb + gid] = to_bf16_bits(siluf_(acc[rb][nt][h]) * acc[rb][nt][2 + h]);
        }
      } else {
        float* dst = a.y + static_cast<size_t>(out) * a.ldy;
        const float ys = a.y_scale ? a.y_scale[out] : 1.0f;
#pragma unroll
        for (int rb = 0; rb < kRB; ++rb) {
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            const int f = 16 * (lb0 + wn * kRB + rb) + gid + 8 * hi;
            if (f >= n_feat) continue;
            const float v = acc[rb][nt][2 * hi + h];
            if (a.epi == GemmEpilogue::Add) dst[f] += v;
            else dst[f] = v * ys;
          }
        }
      }
    }
  }
}

}  // namespace lily::cuda
