// qmatmul_prefill with GemmArgs::wgmma (sm_90a): the weights_bf16 maths (w = bf16(s q + b), one fp32
// sum over K) on Hopper warpgroup MMA. Per group of 64 columns the block's 4-bit weight
// tiles and its X rows arrive by cp.async; the threads dequantise the weights into a bf16
// tile in shared memory (wgmma's B), and each warpgroup issues wgmma.mma_async over its 64
// GEMM rows (A = X from shared memory) while the threads dequantise the next group.
//
// Shapes (GEMM rows = tokens = wgmma M, features = wgmma N, K-major operands):
//   A  X tile      [BM rows][64 k] bf16, 128-byte rows, 128B swizzle (cp.async writes
//                  16-byte chunk c of row r at chunk c ^ (r % 8));
//   B  weight tile [kN features][64 k] bf16, the same layout (W[n][k] is "B, K-major");
//   D  64 x kN fp32 per warpgroup in registers (qmatmul_prefill_core.cuh: fragment layout).
// Descriptors (qmatmul_prefill_core.cuh, PTX ISA facts): start = tile + 64 wg' rows (A) + 32 j for
// k-step j, SBO = 1024 (8 rows of 128 bytes), LBO = 16 (unused), swizzle 1 = 128B.
#include <cstdint>
#include <string>

#include "qmatmul/qmatmul_prefill_wgmma.h"
#include "qmatmul/qmatmul_prefill_core.cuh"

namespace lily::cuda {
namespace {

// Block tile: BM GEMM rows (BM / 64 warpgroups, 64 rows each) x kN features.
//   BM 128: kN 256, 256 threads, 128 accumulators/thread, 1 block per SM (dense shapes).
//   BM  64: kN 128, 128 threads,  64 accumulators/thread, 2 blocks per SM (grouped tiles
//           of <= 64 rows: a 16- or 32-row tile still runs m64, its extra rows are zeros).
// Shared memory: kStages stages of {X tile, weight codes, scale|bias} (1024-aligned, the
// swizzle atom) + two bf16 B tiles (one read by the wgmmas of group g while the threads
// write group g + 1) + 1 KB to align the base:
//   BM 128: 4 x 25 KB + 2 x 32 KB + 1 KB = 165 KB;  BM 64: 4 x 13 KB + 2 x 16 KB + 1 KB = 85 KB.
template <int BM>
struct TileG {
  static constexpr int kWarpgroups = BM / 64, kThreads = 128 * kWarpgroups;
  static constexpr int kN = BM == 128 ? 256 : 128;
  static constexpr int kBlocks = kN / 16;  // 16-row blocks of W per tile
  static constexpr int kMinBlocks = BM == 128 ? 1 : 2;
  static constexpr int kStages = 4;
  static constexpr int kXBytes = BM * 128, kCodeBytes = kBlocks * 512, kSbBytes = kBlocks * 64;
  static constexpr int kCodeOff = kXBytes, kSbOff = kXBytes + kCodeBytes;
  static constexpr int kStageBytes = (kXBytes + kCodeBytes + kSbBytes + 1023) / 1024 * 1024;
  static constexpr int kBBytes = kN * 128;
  static constexpr int kBOff = kStages * kStageBytes;
  static constexpr int kSmem = kBOff + 2 * kBBytes + 1024;
  static constexpr int kCodeCopies = kBlocks * 32 / kThreads, kSbThreads = kBlocks * 4;
  static constexpr int kXChunks = BM * 8, kXCopies = kXChunks / kThreads;  // 16-byte chunks
  // X row r, chunk c (k 8c .. 8c + 7) in the stage: the 128B swizzle.
  __host__ __device__ static constexpr int x_chunk(int r, int c) { return r * 128 + 16 * (c ^ (r & 7)); }
  static_assert(kCodeCopies * kThreads == kBlocks * 32 && kSbThreads <= kThreads && kXCopies * kThreads == kXChunks);
  static_assert(kSmem <= 227 * 1024, "shared memory per block");
};

// Dequantises the stage's weight tiles (as stored, qmatmul_decode_mma.cuh) into the bf16 B tile at
// shared address b: lane-word u = (row block u / 32, lane L = u % 32) holds, per k-step j
// and register i, w = bf16(s q + b) of feature 16 rb + gid + 8 (i & 1), columns
// k = 16 j + 8 (i >> 1) + 2 t, + 1 (gid = L / 4, t = L % 4): one 4-byte store into chunk
// (2 j + (i >> 1)) ^ gid of the feature's 128-byte row. A warp's 32 stores hit 8 distinct
// chunks x 4 words: all 32 banks, conflict-free.
template <class T>
__device__ __forceinline__ void dequant_tile(const unsigned char* stage, uint32_t b, int tid) {
  const uint4* codes = reinterpret_cast<const uint4*>(stage + T::kCodeOff);
  const uint32_t* sbw = reinterpret_cast<const uint32_t*>(stage + T::kSbOff);
#pragma unroll
  for (int c = 0; c < T::kCodeCopies; ++c) {
    const int u = tid + c * T::kThreads, rb = u >> 5, gid = (u >> 2) & 7, t = u & 3;
    const uint4 w = codes[u];
    uint32_t s2[2], b2[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t sb = sbw[rb * 16 + gid + 8 * h];
      s2[h] = __byte_perm(sb, 0, 0x1010);
      b2[h] = __byte_perm(sb, 0, 0x3232);
    }
    const uint32_t row = b + (16 * rb + gid) * 128 + 4 * t;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        st_shared_u32(row + (i & 1) * 8 * 128 + (((2 * j + (i >> 1)) ^ gid) << 4),
                      weights_bf16x2(kstep_word(w, j), i, s2[i & 1], b2[i & 1]));
  }
}

// The epilogue from the D fragment: thread (warp wq of warpgroup wg, gid, t) holds
// acc[4 j + 2 h + e] = y[row 64 wg + 16 wq + gid + 8 h][feature 16 lb0 + 8 j + 2 t + e]
// of the tile's rows row0 .. row0 + rows - 1. SwiGlu: n-tiles 2 jj (8 gate rows) and
// 2 jj + 1 (their 8 up rows) of row block lb0 + jj give outputs 8 (lb0 + jj) + 2 t + e.
template <int kN>
__device__ __forceinline__ void store_wgmma(const GemmArgs& a, const float (&acc)[kN / 2], const BlockSpan& s, int m0,
                                            int lane) {
  const int row0 = s.row0, rows = s.rows, lb0 = s.lb0, n_feat = s.n_feat;
  const int gid = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = m0 + gid + 8 * h;
    if (m >= rows) continue;
    const int r = row0 + m, out = a.y_rows ? a.y_rows[r] : r;
    if (a.epi == GemmEpilogue::SwiGlu) {
      uint16_t* dst = a.act + static_cast<size_t>(out) * a.ldy;
#pragma unroll
      for (int jj = 0; jj < kN / 16; ++jj) {
        const int lb = lb0 + jj;
        if (16 * lb >= n_feat) continue;
#pragma unroll
        for (int e = 0; e < 2; ++e)
          dst[8 * lb + 2 * t + e] = to_bf16_bits(siluf_(acc[8 * jj + 2 * h + e]) * acc[8 * jj + 4 + 2 * h + e]);
      }
    } else {
      float* dst = a.y + static_cast<size_t>(out) * a.ldy;
      const float ys = a.y_scale ? a.y_scale[out] : 1.0f;
#pragma unroll
      for (int j = 0; j < kN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int f = 16 * lb0 + 8 * j + 2 * t + e;
          if (f >= n_feat) continue;
          const float v = acc[4 * j + 2 * h + e];
          if (a.epi == GemmEpilogue::Add) dst[f] += v;
          else dst[f] = v * ys;
        }
    }
  }
}

// Grid: x = feature blocks of kN, y = row tiles of BM (dense) or tile-list entries
// (grouped, rows clipped to tile_m). Per group g (two barriers):
//   issue the 4 k-step wgmmas of g (A: stage g % S, B: tile g % 2); commit
//   wait for cp.async group g + 1; wait_group 1 (this warpgroup's wgmmas of g - 1 done)
//   barrier: all of g - 1 done, so stage (g - 1) % S and B tile (g + 1) % 2 are free
//   cp.async group g + S - 1 into stage (g - 1) % S; dequantise g + 1 into B tile (g + 1) % 2
//   barrier: B tile (g + 1) % 2 complete
// so the dequantisation of g + 1 overlaps the wgmmas of g. Every thread fences its
// generic-proxy writes (cp.async, st.shared) to the async proxy before the barrier that
// precedes a wgmma reading them.
template <int BM>
__global__ void __launch_bounds__(TileG<BM>::kThreads, TileG<BM>::kMinBlocks)
    qmatmul_prefill_wgmma_kernel(GemmArgs a, int tile_m) {
  using T = TileG<BM>;
  constexpr int S = T::kStages, kN = T::kN;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wq = (tid >> 5) & 3;
  const int G = a.W.cols / 64;

  pdl_wait();
  BlockSpan span;
  if (!block_span<BM>(a, T::kBlocks, span, tile_m)) return;

  // The swizzle atoms need 1024-byte alignment (descriptor base offset 0).
  const uint32_t raw0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t smem0 = (raw0 + 1023) & ~1023u;
  const unsigned char* base = smem + (smem0 - raw0);
  const StagePlan<T> plan(a, tid, span, G);

  auto load_stage = [&](int g) { plan.stage(a, smem0, tid, g, G); };
  auto dequant = [&](int g) {
    dequant_tile<T>(base + (g % S) * T::kStageBytes, smem0 + T::kBOff + (g & 1) * T::kBBytes, tid);
  };

  float acc[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) acc[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < S - 1; ++s) load_stage(s);
  cp_async_wait<S - 2>();  // group 0
  __syncthreads();
  dequant(0);
  fence_proxy_async_smem();  // the X tile of group 0 (cp.async) and B tile 0 (st.shared)
  __syncthreads();

  for (int g = 0; g < G; ++g) {
    const uint32_t xa = smem0 + (g % S) * T::kStageBytes + wg * 64 * 128;  // this warpgroup's 64 X rows
    const uint32_t wb = smem0 + T::kBOff + (g & 1) * T::kBBytes;
    wgmma_hold(acc);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j)
      wgmma_ss<kN>(acc, wgmma_desc_kmajor_sw128(xa + 32 * j), wgmma_desc_kmajor_sw128(wb + 32 * j), 1);
    wgmma_commit();
    wgmma_hold(acc);
    if (g + 1 < G) {
      cp_async_wait<S - 3>();  // group g + 1 (this thread's copies)
      fence_proxy_async_smem();
    }
    wgmma_wait<1>();
    wgmma_hold(acc);
    __syncthreads();
    load_stage(g + S - 1);
    if (g + 1 < G) {
      dequant(g + 1);
      fence_proxy_async_smem();
    }
    __syncthreads();
  }
  wgmma_wait<0>();
  wgmma_hold(acc);
  cp_async_wait<0>();  // only empty groups remain
  pdl_trigger();

  store_wgmma<kN>(a, acc, span, 64 * wg + 16 * wq, lane);
}

template <int BM>
void launch_wgmma(const GemmArgs& a, int tile_m, cudaStream_t stream) {
  using T = TileG<BM>;
  allow_dynamic_smem(reinterpret_cast<const void*>(qmatmul_prefill_wgmma_kernel<BM>), T::kSmem,
                     "qmatmul_prefill (wgmma): set shared memory size");
  const int n_feat = a.tiles ? a.expert_rows : a.W.rows;
  const int blocks_y = a.tiles ? a.max_tiles : (a.M + BM - 1) / BM;
  const dim3 grid((n_feat + T::kN - 1) / T::kN, blocks_y);
  launch("qmatmul_prefill (wgmma)", qmatmul_prefill_wgmma_kernel<BM>, grid, dim3(T::kThreads), T::kSmem, stream, a, tile_m);
}

}  // namespace

void qmatmul_prefill_wgmma(const GemmArgs& a, int tile_m, cudaStream_t stream) {
  if (tile_m <= 64) launch_wgmma<64>(a, tile_m, stream);
  else launch_wgmma<128>(a, tile_m, stream);
}

}  // namespace lily::cuda
