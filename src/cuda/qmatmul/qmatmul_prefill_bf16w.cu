// qmatmul_prefill with GemmArgs::weights_bf16: the A fragments are dequantised in registers to the
// true bf16 weights w = bf16(s q + b) (weights_bf16x2: one exact subtract and one bf16x2
// fma per register), so one fp32 accumulator per output runs over all of K: no per-group
// sums, no fold, no row sums of X. The freed registers buy larger warp tiles, so every
// dequantised A fragment and every ldmatrix of X feeds more mmas.
#include <cstdint>
#include <string>

#include "qmatmul/qmatmul_prefill_bf16w.h"
#include "qmatmul/qmatmul_prefill_core.cuh"

namespace lily::cuda {
namespace {

// Block tile: 256 features (16 row blocks of 16) x BM GEMM rows, 8 warps: kWarpsN along
// the features (kRB row blocks each) x kWarpsM along the rows (kNT n-tiles of 8 rows).
// Per warp and k-step: kRB x 4 A registers dequantised (~15 instructions per row block),
// kNT / 2 ldmatrix.x4, kRB x kNT mmas; so ~15 / kNT extra instructions per mma.
//   BM 128: warp 64 features x 64 rows, 128 accumulators, 1 block (8 warps) per SM.
//   BM  64: warp 32 features x 64 rows,  64 accumulators, 2 blocks per SM.
//   BM 32 / 16: warp 32 features x BM rows, 3 / 4 blocks per SM (the grouped MoE tiles).
// A stage holds one group of 64 columns: the block's 16 weight tiles (codes + scale|bias,
// copied as stored) and the X tile [BM][64]; kStages - 1 groups are in flight (cp.async).
template <int BM>
struct TileW {
  static constexpr int kWarpsM = BM == 128 ? 2 : 1, kWarpsN = 8 / kWarpsM, kWarps = 8, kThreads = 32 * kWarps;
  static constexpr int kRB = BM == 128 ? 4 : 2, kNT = BM / (8 * kWarpsM);
  static constexpr int kBlocks = kWarpsN * kRB;  // 16-row blocks per tile
  static constexpr int kFeatures = 16 * kBlocks;
  static constexpr int kMinBlocks = BM == 128 ? 1 : BM == 64 ? 2 : BM == 32 ? 3 : 4;  // blocks per SM (register cap)
  static constexpr int kStages = 4;
  static constexpr int kXStride = 72;  // bf16 per staged X row: 144 B rows keep ldmatrix conflict-free
  static constexpr int kCodeBytes = kBlocks * 512, kSbBytes = kBlocks * 64, kXBytes = BM * kXStride * 2;
  static constexpr int kStageBytes = kCodeBytes + kSbBytes + kXBytes;
  static constexpr int kCodeOff = 0, kSbOff = kCodeBytes;  // stage layout: codes, scale|bias, X rows
  __host__ __device__ static constexpr int x_chunk(int r, int c) {
    return kCodeBytes + kSbBytes + r * kXStride * 2 + 16 * c;
  }
  static constexpr int kSmem = kStages * kStageBytes;
  static constexpr int kCodeCopies = kBlocks * 32 / kThreads, kSbThreads = kBlocks * 4;
  static constexpr int kXChunks = BM * 8, kXCopies = (kXChunks + kThreads - 1) / kThreads;  // 16-byte chunks
  static_assert(kFeatures == 256 && kNT >= 2 && kNT % 2 == 0, "n-tiles go in pairs (one ldmatrix.x4)");
  static_assert(kCodeCopies * kThreads == kBlocks * 32 && kSbThreads <= kThreads);
  static_assert(kXChunks % kThreads == 0 || kXCopies == 1, "partial X copies only for one round");
};

// Grid: x = feature blocks of 256, y = row tiles (dense) or tile-list entries (grouped).
// Lane (gid = lane / 4, t = lane % 4) of warp (wn, wm) ends with acc[rb][nt][i] =
// y[feature 16 (lb0 + kRB wn + rb) + gid + 8 (i / 2)][row 8 (wm kNT + nt) + 2t + i % 2].
template <int BM>
__global__ void __launch_bounds__(TileW<BM>::kThreads, TileW<BM>::kMinBlocks) qmatmul_prefill_bf16w_kernel(GemmArgs a) {
  using T = TileW<BM>;
  constexpr int kRB = T::kRB, kNT = T::kNT, S = T::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2;
  const int wn = warp % T::kWarpsN, wm = warp / T::kWarpsN;
  const int G = a.W.cols / 64;

  pdl_wait();
  BlockSpan span;
  if (!block_span<BM>(a, T::kBlocks, span)) return;

  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const StagePlan<T> plan(a, tid, span, G);

  auto load_stage = [&](int g) { plan.stage(a, smem0, tid, g, G); };

  // B fragments of n-tiles (2p, 2p+1) at k-step j: one ldmatrix.x4 of X rows
  // 8 wm kNT + 16p + (lane & 7) + 8 (lane >> 4), columns 16j + 8 ((lane >> 3) & 1).
  const uint32_t b_lane = T::kCodeBytes + T::kSbBytes +
                          ((8 * wm * kNT + (lane & 7) + 8 * (lane >> 4)) * T::kXStride + 8 * ((lane >> 3) & 1)) * 2;
  float acc[kRB][kNT][4] = {};

#pragma unroll
  for (int s = 0; s < S - 1; ++s) load_stage(s);

  for (int g = 0; g < G; ++g) {
    // Group g has landed; the barrier publishes it to all warps and frees the stage read
    // in iteration g - 1, which load_stage(g + S - 1) refills.
    cp_async_wait<S - 2>();
    __syncthreads();
    load_stage(g + S - 1);

    // This lane's weight words of group g: codes of its row blocks, and per row (gid,
    // gid + 8) the bf16 scale and bias each doubled into a bf16x2 (byte permutes).
    const unsigned char* stage = smem + (g % S) * T::kStageBytes;
    const uint4* codes = reinterpret_cast<const uint4*>(stage) + wn * kRB * 32 + lane;
    const uint32_t* sbw = reinterpret_cast<const uint32_t*>(stage + T::kCodeBytes) + wn * kRB * 16 + gid;
    uint4 w[kRB];
    uint32_t s2[kRB][2], b2[kRB][2];
#pragma unroll
    for (int rb = 0; rb < kRB; ++rb) {
      w[rb] = codes[rb * 32];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t sb = sbw[rb * 16 + 8 * h];
        s2[rb][h] = __byte_perm(sb, 0, 0x1010);
        b2[rb][h] = __byte_perm(sb, 0, 0x3232);
      }
    }
    const uint32_t xb = smem0 + (g % S) * T::kStageBytes + b_lane;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t af[kRB][4];  // registers 0, 2: row gid; 1, 3: row gid + 8
#pragma unroll
      for (int rb = 0; rb < kRB; ++rb)
#pragma unroll
        for (int i = 0; i < 4; ++i) af[rb][i] = weights_bf16x2(kstep_word(w[rb], j), i, s2[rb][i & 1], b2[rb][i & 1]);
#pragma unroll
      for (int p = 0; p < kNT / 2; ++p) {
        uint32_t b[4];
        ldmatrix_x4(xb + p * 16 * T::kXStride * 2 + 32 * j, b);
#pragma unroll
        for (int rb = 0; rb < kRB; ++rb) {
          mma_16816(acc[rb][2 * p], af[rb], b[0], b[1]);
          mma_16816(acc[rb][2 * p + 1], af[rb], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups remain
  pdl_trigger();

  store_tile<kRB, kNT>(a, acc, span, wn, wm, lane);
}

template <int BM>
void launch_tile(const GemmArgs& a, int blocks_y, cudaStream_t stream) {
  using T = TileW<BM>;
  allow_dynamic_smem(reinterpret_cast<const void*>(qmatmul_prefill_bf16w_kernel<BM>), T::kSmem,
                     "qmatmul_prefill (bf16 weights): set shared memory size");
  const int n_feat = a.tiles ? a.expert_rows : a.W.rows;
  const dim3 grid((n_feat + T::kFeatures - 1) / T::kFeatures, blocks_y);
  launch("qmatmul_prefill (bf16 weights)", qmatmul_prefill_bf16w_kernel<BM>, grid, dim3(T::kThreads), T::kSmem, stream, a);
}

}  // namespace

void qmatmul_prefill_bf16w(const GemmArgs& a, int tile_m, int blocks_y, cudaStream_t stream) {
  switch (tile_m) {
    case 16: launch_tile<16>(a, blocks_y, stream); break;
    case 32: launch_tile<32>(a, blocks_y, stream); break;
    case 64: launch_tile<64>(a, blocks_y, stream); break;
    case 128: launch_tile<128>(a, blocks_y, stream); break;
    default: fail("qmatmul_prefill: tile_m ", std::to_string(tile_m), " is not one of 16, 32, 64, 128");
  }
}

}  // namespace lily::cuda
