// The kernel of qmatmul_prefill.h. mma.sync m16n8k16 with the dequantised weight tile as the A
// operand straight from its fragment-ordered storage (one 16-byte word per lane per 16x64
// tile) and X as B through ldmatrix; xsum per (row, group) also on the tensor cores.
#include "qmatmul/qmatmul_prefill.h"
#include "qmatmul/qmatmul_prefill_bf16w.h"
#include "qmatmul/qmatmul_prefill_wgmma.h"

#include <cstdint>
#include <string>

#include "qmatmul/qmatmul_prefill_core.cuh"

namespace lily::cuda {
namespace {

// Block tile: 128 features (8 row blocks of 16) x BM GEMM rows. Warps: 4 along the
// features (2 row blocks each) x kWarpsM along the rows (kNT n-tiles of 8 rows each),
// so a warp holds 2 x kNT x 4 running sums plus as many per-group sums (<= 128 floats).
// Per group of 64 columns a stage holds the block's 8 weight tiles (codes + scale|bias,
// copied as stored) and the X tile [BM][64]; stages are filled kStages - 1 groups ahead
// with cp.async, so weights and activations share one pipeline.
template <int BM>
struct Tile {
  static constexpr int kWarpsN = 4, kWarpsM = BM == 128 ? 2 : 1, kWarps = kWarpsN * kWarpsM, kThreads = 32 * kWarps;
  static constexpr int kRB = 2, kNT = BM / (8 * kWarpsM);
  static constexpr int kBlocks = kWarpsN * kRB;  // 16-row blocks per tile: 128 features
  static constexpr int kMinBlocks = BM == 128 ? 1 : BM == 64 ? 2 : BM == 32 ? 3 : 4;  // blocks per SM (register cap)
  static constexpr int kStages = 4;
  static constexpr int kXStride = 72;  // bf16 per staged X row: 144 B rows keep ldmatrix conflict-free
  static constexpr int kCodeBytes = kBlocks * 512, kSbBytes = kBlocks * 64, kXBytes = BM * kXStride * 2;
  static constexpr int kStageBytes = kCodeBytes + kSbBytes + kXBytes;
  static constexpr int kCodeOff = 0, kSbOff = kCodeBytes;  // stage layout: codes, scale|bias, X rows
  __host__ __device__ static constexpr int x_chunk(int r, int c) {
    return kCodeBytes + kSbBytes + r * kXStride * 2 + 16 * c;
  }
  static constexpr int kSmem = kStages * kStageBytes + 2 * BM * 4;  // + xsum [2][BM]
  static constexpr int kCodeCopies = kBlocks * 32 / kThreads, kXChunks = BM * 8, kXCopies = kXChunks / kThreads;
  static constexpr int kSbThreads = 32;  // 8 blocks x 4 threads of 16 bytes
  static_assert(kNT >= 2 && kNT % 2 == 0, "n-tiles go in pairs (one ldmatrix.x4)");
  static_assert(BM / 16 <= kWarps, "one warp sums each 16 rows of X");
  static_assert(kCodeCopies * kThreads == kBlocks * 32 && kXCopies * kThreads == BM * 8 && kThreads >= 32);
};

// Grid: x = feature blocks of 128, y = row tiles (dense) or tile-list entries (grouped).
// Lane (gid = lane / 4, t = lane % 4) of warp (wn, wm) ends with acc[rb][nt][i] =
// y[feature 16 (lb0 + 2 wn + rb) + gid + 8 (i / 2)][row 8 (wm kNT + nt) + 2t + i % 2].
template <int BM>
__global__ void __launch_bounds__(Tile<BM>::kThreads, Tile<BM>::kMinBlocks) qmatmul_prefill_kernel(GemmArgs a) {
  using T = Tile<BM>;
  constexpr int kRB = T::kRB, kNT = T::kNT, S = T::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  float* xsum_s = reinterpret_cast<float*>(smem + S * T::kStageBytes);  // [2][BM], group g in g & 1
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2;
  const int wn = warp % T::kWarpsN, wm = warp / T::kWarpsN;
  const int G = a.W.cols / 64;

  pdl_wait();
  BlockSpan span;
  if (!block_span<BM>(a, T::kBlocks, span)) return;

  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const StagePlan<T> plan(a, tid, span, G);

  auto load_stage = [&](int g) { plan.stage(a, smem0, tid, g, G); };

  // xsum of group g on the tensor cores: X rows as the A operand times a B of ones;
  // warp w sums rows 16w .. 16w+15 (ldmatrix.x4 of a 16x16 block is an A fragment).
  constexpr uint32_t kOnes = 0x3F803F80u;  // bf16 pair (1, 1)
  auto row_sums = [&](int g) {
    if (warp < BM / 16) {
      const uint32_t addr = smem0 + (g % S) * T::kStageBytes + T::kCodeBytes + T::kSbBytes +
                            ((16 * warp + (lane & 15)) * T::kXStride + 8 * (lane >> 4)) * 2;
      float c[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t xa[4];
        ldmatrix_x4(addr + 32 * j, xa);
        if (j == 0) mma_16816_first(c, xa, kOnes, kOnes);
        else mma_16816(c, xa, kOnes, kOnes);
      }
      if ((lane & 3) == 0) {
        float* xs = xsum_s + (g & 1) * BM + 16 * warp + gid;
        xs[0] = c[0];  // row gid
        xs[8] = c[2];  // row gid + 8
      }
    }
  };

  // B fragments of n-tiles (2p, 2p+1) at k-step j: one ldmatrix.x4 of X rows
  // 8 wm kNT + 16p + (lane & 7) + 8 (lane >> 4), columns 16j + 8 ((lane >> 3) & 1).
  const uint32_t b_lane = T::kCodeBytes + T::kSbBytes +
                          ((8 * wm * kNT + (lane & 7) + 8 * (lane >> 4)) * T::kXStride + 8 * ((lane >> 3) & 1)) * 2;
  // This lane's weight words of group g: codes of its row blocks, scale|bias of rows gid, gid + 8.
  uint4 w_next[kRB];
  uint32_t sb_next[kRB][2];
  auto load_tiles = [&](int g) {
    const unsigned char* stage = smem + (g % S) * T::kStageBytes;
    const uint4* codes = reinterpret_cast<const uint4*>(stage) + wn * kRB * 32 + lane;
    const uint32_t* sbw = reinterpret_cast<const uint32_t*>(stage + T::kCodeBytes) + wn * kRB * 16 + gid;
#pragma unroll
    for (int rb = 0; rb < kRB; ++rb) {
      w_next[rb] = codes[rb * 32];
      sb_next[rb][0] = sbw[rb * 16];
      sb_next[rb][1] = sbw[rb * 16 + 8];
    }
  };
  float acc[kRB][kNT][4] = {};

#pragma unroll
  for (int s = 0; s < S - 1; ++s) load_stage(s);
  cp_async_wait<S - 2>();
  __syncthreads();
  row_sums(0);
  load_tiles(0);

  for (int g = 0; g < G; ++g) {
    // Groups g and g + 1 have landed (g + 1 for its row sums and weight words); the
    // barrier also frees the stage read in iteration g - 1 and publishes xsum of group g.
    cp_async_wait<S - 3>();
    __syncthreads();
    load_stage(g + S - 1);
    if (g + 1 < G) row_sums(g + 1);

    uint4 w[kRB];
    float scale[kRB][2], offset[kRB][2];  // rows gid, gid + 8: s and b - 128 s
#pragma unroll
    for (int rb = 0; rb < kRB; ++rb) {
      w[rb] = w_next[rb];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        scale[rb][h] = bf16_lo(sb_next[rb][h]);
        offset[rb][h] = fmaf(-128.0f, scale[rb][h], bf16_hi(sb_next[rb][h]));
      }
    }
    const uint32_t xb = smem0 + (g % S) * T::kStageBytes + b_lane;
    float c[kRB][kNT][4];  // C_g = (128 + q) · X_gᵀ
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t af[kRB][4];
#pragma unroll
      for (int rb = 0; rb < kRB; ++rb) dequant_word(kstep_word(w[rb], j), af[rb]);
#pragma unroll
      for (int p = 0; p < kNT / 2; ++p) {
        uint32_t b[4];
        ldmatrix_x4(xb + p * 16 * T::kXStride * 2 + 32 * j, b);
#pragma unroll
        for (int rb = 0; rb < kRB; ++rb) {
          if (j == 0) {
            mma_16816_first(c[rb][2 * p], af[rb], b[0], b[1]);
            mma_16816_first(c[rb][2 * p + 1], af[rb], b[2], b[3]);
          } else {
            mma_16816(c[rb][2 * p], af[rb], b[0], b[1]);
            mma_16816(c[rb][2 * p + 1], af[rb], b[2], b[3]);
          }
        }
      }
    }
    if (g + 1 < G) load_tiles(g + 1);  // its latency hides behind the fold and the next barrier
    // y += s C_g + (b - 128 s) xsum_g; this lane's columns are rows 2t and 2t + 1 of each n-tile.
    const float* xs = xsum_s + (g & 1) * BM + 8 * wm * kNT + 2 * (lane & 3);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const float2 xv = *reinterpret_cast<const float2*>(xs + 8 * nt);
#pragma unroll
      for (int rb = 0; rb < kRB; ++rb) {
        float(&y)[4] = acc[rb][nt];
        y[0] = fmaf(scale[rb][0], c[rb][nt][0], fmaf(offset[rb][0], xv.x, y[0]));
        y[1] = fmaf(scale[rb][0], c[rb][nt][1], fmaf(offset[rb][0], xv.y, y[1]));
        y[2] = fmaf(scale[rb][1], c[rb][nt][2], fmaf(offset[rb][1], xv.x, y[2]));
        y[3] = fmaf(scale[rb][1], c[rb][nt][3], fmaf(offset[rb][1], xv.y, y[3]));
      }
    }
  }
  cp_async_wait<0>();  // only empty groups remain
  pdl_trigger();

  store_tile<kRB, kNT>(a, acc, span, wn, wm, lane);
}

template <int BM>
void launch_tile(const GemmArgs& a, dim3 grid, cudaStream_t stream) {
  using T = Tile<BM>;
  allow_dynamic_smem(reinterpret_cast<const void*>(qmatmul_prefill_kernel<BM>), T::kSmem, "qmatmul_prefill: set shared memory size");
  launch("qmatmul_prefill", qmatmul_prefill_kernel<BM>, grid, dim3(T::kThreads), T::kSmem, stream, a);
}

void check_args(const GemmArgs& a, int tile_m) {
  const QMat& W = a.W;
  if (tile_m != 16 && tile_m != 32 && tile_m != 64 && tile_m != 128)
    fail("qmatmul_prefill: tile_m ", std::to_string(tile_m), " is not one of 16, 32, 64, 128");
  if (!W.tiled || W.bits != 4 || !W.codes || !W.sb) fail("qmatmul_prefill: W must be a tiled 4-bit matrix (QMat::tiled)");
  if (reinterpret_cast<uintptr_t>(W.codes) % 16 != 0 || reinterpret_cast<uintptr_t>(W.sb) % 16 != 0)
    fail("qmatmul_prefill: W codes and scales must be 16-byte aligned");
  if (W.rows < 1 || W.cols < 64 || W.cols % 64 != 0)
    fail("qmatmul_prefill: W is ", std::to_string(W.rows), " x ", std::to_string(W.cols),
         "; need rows >= 1 and cols a multiple of 64");
  if (static_cast<int64_t>((W.rows + 15) / 16) * W.cols / 64 * 32 > INT32_MAX)
    fail("qmatmul_prefill: W is too large for 32-bit tile offsets");
  if (a.M < 0) fail("qmatmul_prefill: M is negative");
  if (!a.x || reinterpret_cast<uintptr_t>(a.x) % 16 != 0) fail("qmatmul_prefill: x must be a 16-byte aligned device pointer");
  if (a.ldx < W.cols || a.ldx % 8 != 0)
    fail("qmatmul_prefill: ldx ", std::to_string(a.ldx), " must be >= K = ", std::to_string(W.cols), " and a multiple of 8");
  if (a.wgmma && !a.weights_bf16) fail("qmatmul_prefill: wgmma computes the weights_bf16 maths; set weights_bf16 too");
  const bool grouped = a.tiles != nullptr;
  if (grouped) {
    if (!a.n_tiles) fail("qmatmul_prefill: grouped mode needs n_tiles");
    if (a.max_tiles < 0 || a.max_tiles > 65535)
      fail("qmatmul_prefill: max_tiles ", std::to_string(a.max_tiles), " is not in [0, 65535]");
    if (a.expert_rows < 16 || a.expert_rows % 16 != 0 || a.expert_rows > (W.rows + 15) / 16 * 16)
      fail("qmatmul_prefill: expert_rows ", std::to_string(a.expert_rows), " must be a positive multiple of 16 within W's rows");
  } else {
    if (a.n_tiles || a.max_tiles) fail("qmatmul_prefill: n_tiles / max_tiles given without a tile list");
    if ((a.M + tile_m - 1) / tile_m > 65535) fail("qmatmul_prefill: M ", std::to_string(a.M), " needs too many row tiles");
  }
  const int n_feat = grouped ? a.expert_rows : W.rows;
  if (a.epi == GemmEpilogue::SwiGlu) {
    if (!a.act) fail("qmatmul_prefill: SwiGlu needs act");
    if (a.swiglu_inter < 8 || a.swiglu_inter % 8 != 0 || 2 * a.swiglu_inter != n_feat)
      fail("qmatmul_prefill: SwiGlu needs swiglu_inter a multiple of 8 with ", grouped ? "expert_rows" : "W.rows",
           " = 2 * swiglu_inter (", std::to_string(n_feat), " vs ", std::to_string(a.swiglu_inter), ")");
    if (a.ldy < a.swiglu_inter) fail("qmatmul_prefill: ldy ", std::to_string(a.ldy), " is less than swiglu_inter");
    if (a.y_scale) fail("qmatmul_prefill: y_scale is only for the Store epilogue");
  } else if (a.epi == GemmEpilogue::Store || a.epi == GemmEpilogue::Add) {
    if (!a.y) fail("qmatmul_prefill: Store/Add need y");
    if (a.ldy < n_feat)
      fail("qmatmul_prefill: ldy ", std::to_string(a.ldy), " is less than the ", std::to_string(n_feat), " outputs");
    if (a.y_scale && a.epi != GemmEpilogue::Store) fail("qmatmul_prefill: y_scale is only for the Store epilogue");
  } else {
    fail("qmatmul_prefill: unknown epilogue ", std::to_string(static_cast<int>(a.epi)));
  }
}

}  // namespace

void qmatmul_prefill(const GemmArgs& a, int tile_m, cudaStream_t stream) {
  check_args(a, tile_m);
  const bool grouped = a.tiles != nullptr;
  const int n_feat = grouped ? a.expert_rows : a.W.rows;
  const int blocks_y = grouped ? a.max_tiles : (a.M + tile_m - 1) / tile_m;
  if (a.M == 0 || blocks_y == 0) return;  // nothing to compute
  if (a.wgmma) return qmatmul_prefill_wgmma(a, tile_m, stream);
  if (a.weights_bf16) return qmatmul_prefill_bf16w(a, tile_m, blocks_y, stream);
  const dim3 grid((n_feat + 127) / 128, blocks_y);
  switch (tile_m) {
    case 16: launch_tile<16>(a, grid, stream); break;
    case 32: launch_tile<32>(a, grid, stream); break;
    case 64: launch_tile<64>(a, grid, stream); break;
    default: launch_tile<128>(a, grid, stream); break;
  }
}

}  // namespace lily::cuda
