// Prefill attention step 2 on Hopper warpgroup MMA (wgmma, sm_90a), head dim 256; picked
// by LILY_PREFILL_ATTN=wgmma (attention_prefill.cu). Same grid, GQA row packing, causal
// rule, gated bf16 output and split partial results as the mma.sync kernel
// (attention_flash.h), so the merge launch is shared.
//
// Block = 128 query rows x one KV head = 2 warpgroups (256 threads) x 64 rows. Per key
// tile of 64 keys, each warpgroup:
//   S (64 x 64 fp32, 32 registers/thread) = Q K^T: 16 x wgmma m64n64k16, A = its 64 Q rows
//     and B = the K tile, both from shared memory, K-major (d contiguous), 128B swizzle;
//   online softmax on the S fragment (a row's 64 scores sit in the 4 threads of a quad);
//   O (64 x 256 fp32, 128 registers/thread) += P V: 4 x wgmma m64n256k16, A = P from
//     registers, B = the V tile from shared memory, MN-major (V rows are [key][d], d
//     contiguous, so N = d is the contiguous index: imm-trans-b = 1), 128B swizzle.
// The D fragment of S and the A fragment of P V place (row, key) alike (wgmma.cuh): for
// keys 16kk .. 16kk+15, A registers 0..3 = bf16 pairs of S elements 8kk + {0,1}, {2,3},
// {4,5}, {6,7} (rows gid / gid+8, keys 2t / 2t+8), so P never leaves the thread.
// Pipeline: tile j+1 loads by cp.async (all 256 threads) while tile j computes. P V of
// tile j is left in flight across the next block barrier: its wait is the one after
// S = Q K^T of tile j+1 is issued, so the tensor cores see P V(j), S(j+1) back to back
// with no drain at the barrier, and the two warpgroups' softmax overlaps the other's
// wgmmas. Hence V has three stages (the load of tile j+2 must not hit the stage P V(j)
// may still read) and K two (S(j) is waited for before its softmax).
//
// Shared memory (bytes): Q 128 x 256 bf16 = 65,536; K and V tiles 64 x 256 bf16 = 32,768
// each, 2 K + 3 V stages = 163,840; + 1,024 to align the base to a swizzle atom =
// 230,400 (of the 232,448 a block may opt into).
// A [rows][256] bf16 tile is stored as 4 panels of 64 columns (128-byte rows, panel p at
// p * rows * 128), 16-byte chunk j of row r at chunk j ^ (r % 8): the 128B-swizzle
// canonical layout, conflict-free for the cp.async writes and the wgmma reads.
// Registers: O 128 + S 32 + P 16 + softmax state and addresses: 232, no spills (ptxas -v).
#include <string>

#include "common/async_copy.cuh"
#include "attention/attention_flash_wgmma.h"
#include "common/device_common.cuh"
#include "common/wgmma.cuh"

namespace lily::cuda {
namespace {

constexpr int kD = 256;
constexpr int kThreads = 256;                          // 2 warpgroups
constexpr int kChunks = kD / 8;                        // 16-byte chunks per row
constexpr int kQBytes = kFlashRows * kD * 2;           // 65,536
constexpr int kTileBytes = kFlashKeys * kD * 2;        // 32,768: one K or V tile
constexpr int kKStages = 2, kVStages = 3;
constexpr int kSmemBytes = kSwizzleAtomBytes + kQBytes + (kKStages + kVStages) * kTileBytes;  // 230,400

// Grid: x = query tile x KV head, heaviest (latest) tiles first; y = key split.
__global__ void __launch_bounds__(kThreads, 1) attention_flash_wgmma_kernel(FlashParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wg_warp = (tid >> 5) & 3;
  const FlashBlock b = flash_block(p);
  if (b.kt0 >= b.kt1) return;  // an empty split
  const int g = b.g, q0 = b.q0, kt0 = b.kt0, kt1 = b.kt1, n_keys = b.n_keys;

  // Swizzle atoms must start 1024-byte aligned (descriptor base offset 0).
  const uint32_t s_q = (smem_addr(smem) + kSwizzleAtomBytes - 1) & ~uint32_t(kSwizzleAtomBytes - 1);
  const uint32_t s_k = s_q + kQBytes, s_v = s_k + kKStages * kTileBytes;  // stage st at + st * kTileBytes
  pdl_wait();

  // Q tile (flash_q_src: rows past the block's tokens are zeros).
#pragma unroll
  for (int j = 0; j < kFlashRows * kChunks / kThreads; ++j) {
    const int i = tid + j * kThreads, r = i / kChunks, c = i % kChunks;
    bool ok;
    const size_t src = flash_q_src(p, b, r, c, kD, ok);
    cp_async16(s_q + sw128_chunk_offset(kFlashRows, r, c), p.q + src, ok ? 16u : 0u);
  }
  // K/V tile kt -> K stage kst, V stage vst; keys past n_keys (not yet written) are zeros.
  auto load_kv = [&](int kt, int kst, int vst) {
    const uint32_t sk = s_k + kst * kTileBytes, sv = s_v + vst * kTileBytes;
#pragma unroll
    for (int j = 0; j < kFlashKeys * kChunks / kThreads; ++j) {
      const int i = tid + j * kThreads, r = i / kChunks, c = i % kChunks, key = kt * kFlashKeys + r;
      const bool ok = key < n_keys;
      const size_t src = (static_cast<size_t>(ok ? key : 0) * p.Hkv + g) * kD + c * 8;
      const uint32_t off = sw128_chunk_offset(kFlashKeys, r, c);
      cp_async16(sk + off, p.k + src, ok ? 16u : 0u);
      cp_async16(sv + off, p.v + src, ok ? 16u : 0u);
    }
    cp_async_commit();
  };
  load_kv(kt0, 0, 0);

  // Descriptors (wgmma.cuh). Q rows of this warpgroup: 64wg .. 64wg+63, and K's 64 keys:
  // K-major (wgmma_desc_kmajor_sw128: 8-row groups 1024 bytes apart). V (MN-major):
  // 64-column panels kFlashKeys * 128 bytes apart (LBO), 8-key groups 1024 bytes apart
  // (SBO); keys 16kk .. start 16kk * 128 bytes in.
  constexpr uint32_t kSbo = 8 * kSwizzleRowBytes;
  constexpr uint32_t kVPanelBytes = kFlashKeys * kSwizzleRowBytes;
  const uint32_t s_qwg = s_q + wg * 64 * kSwizzleRowBytes;

  // This thread's two rows (D-fragment rows gid and gid + 8 of its warp) and their last
  // visible key.
  const int r0 = wg * 64 + wg_warp * 16 + (lane >> 2), quad = lane & 3;
  const int lim[2] = {p.pos0 + q0 + r0 / p.G, p.pos0 + q0 + (r0 + 8) / p.G};
  float o[128], s[32] = {};
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // row max of scores, this thread's part of the row sum
  uint32_t pa[4][4] = {};  // P of the last tile as A fragments (read by its in-flight P V)

  for (int kt = kt0; kt < kt1; ++kt) {
    const int step = kt - kt0, kst = step % kKStages, vst = step % kVStages;
    cp_async_wait<0>();
    fence_proxy_async_smem();  // the landed tile becomes visible to wgmma reads
    // Tile kt visible to all. Both warpgroups have waited for S(kt-1) (K stage kst^1) and
    // for P V(kt-2) (V stage (step+1) % 3), the stages the next load overwrites.
    __syncthreads();
    if (kt + 1 < kt1) load_kv(kt + 1, (step + 1) % kKStages, (step + 1) % kVStages);
    const uint32_t sk = s_k + kst * kTileBytes, sv = s_v + vst * kTileBytes;

    // S = Q K^T over 16 K-steps of 16 dims; s[4i + 2h + e] = (row r0 + 8h, key 8i + 2 quad + e).
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks)
      wgmma_ss<64>(s, wgmma_desc_kmajor_sw128(s_qwg + sw128_kstep_offset(kFlashRows, ks)),
                   wgmma_desc_kmajor_sw128(sk + sw128_kstep_offset(kFlashKeys, ks)), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();  // S(kt) and P V(kt-1): O and P's registers are free again
    wgmma_hold(s);
    wgmma_hold(o);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_hold(pa[kk]);

    if (kt * kFlashKeys + kFlashKeys - 1 > p.pos0 + q0) {  // the tile reaches past the block's first query
#pragma unroll
      for (int i = 0; i < 32; ++i)
        if (kt * kFlashKeys + 8 * (i >> 2) + 2 * quad + (i & 1) > lim[(i >> 1) & 1]) s[i] = -INFINITY;
    }

    // Online softmax per row h (elements 4i + 2h + e).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 8; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]));
      mx = quad_max(mx);
      const float m_new = fmaxf(m[h], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: keep exp finite
      const float corr = exp2f((m[h] - m_use) * kFlashLog2e), sub = m_use * kFlashLog2e;
      m[h] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        s[4 * i + 2 * h] = exp2f(fmaf(s[4 * i + 2 * h], kFlashLog2e, -sub));
        s[4 * i + 2 * h + 1] = exp2f(fmaf(s[4 * i + 2 * h + 1], kFlashLog2e, -sub));
        sum += s[4 * i + 2 * h] + s[4 * i + 2 * h + 1];
      }
      l[h] = l[h] * corr + sum;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        o[4 * i + 2 * h] *= corr;
        o[4 * i + 2 * h + 1] *= corr;
      }
    }

    // O += P V over 4 K-steps of 16 keys; P's A fragment is the S fragment in bf16. Left
    // in flight: the wait after the next tile's S (or after the loop) covers it.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = pack_bf16(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
    wgmma_hold(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_m64n256k16_rs_tb(o, pa[kk], wgmma_desc_sw128(sv + kk * 16 * kSwizzleRowBytes, kVPanelBytes, kSbo));
    wgmma_commit();
  }
  wgmma_wait<0>();
  wgmma_hold(o);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_hold(pa[kk]);
  pdl_trigger();

#pragma unroll
  for (int h = 0; h < 2; ++h) l[h] = quad_sum(l[h]);
  // O element 4n + 2h + e = (row r0 + 8h, column 8n + 2 quad + e).
#pragma unroll
  for (int h = 0; h < 2; ++h)
    flash_store_row<kD>(p, b, r0 + 8 * h, quad, m[h], l[h],
                        [&](int n) { return make_float2(o[4 * n + 2 * h], o[4 * n + 2 * h + 1]); });
}

}  // namespace

void launch_flash_wgmma(const FlashParams& p, int D, cudaStream_t stream) {
  if (!flash_wgmma_supports(D)) fail("attention_prefill wgmma: head dim ", std::to_string(D), " not supported");
  allow_dynamic_smem(reinterpret_cast<const void*>(attention_flash_wgmma_kernel), kSmemBytes,
                     "attention_prefill wgmma: shared memory opt-in");
  launch("attention_prefill_flash_wgmma", attention_flash_wgmma_kernel, dim3(p.blocks, p.splits), dim3(kThreads),
         kSmemBytes, stream, p);
}

}  // namespace lily::cuda
