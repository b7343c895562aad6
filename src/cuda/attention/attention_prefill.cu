// Prefill attention, steps 2 and 3: flash attention on tensor cores (FlashAttention-2
// style, mma.sync m16n8k16 bf16 -> fp32) and the log-sum-exp merge of key splits.
//
// Block = 128 query rows x one KV head. Row r is (token r / G, head r % G) of the block's
// 128/G tokens, so one K/V tile in shared memory serves all G heads of the KV head (GQA
// packing) and the causal limits of a block's rows span only 128/G positions. Warp w owns
// rows 16w .. 16w+15 and all keys of a tile: S = Q K^T (16 x 64) in registers, fp32
// online softmax, P rounded to bf16 in registers becomes the A operand of O += P V
// (O: 16 x D fp32 in registers). Q, K, V live in shared memory with rows padded by 16
// bytes (row stride = 4 banks mod 32, so the 8 row addresses of an ldmatrix hit
// distinct banks); K/V tiles are double buffered with cp.async (tile j+1 loads while
// tile j computes). Key tiles past a block's last query are never visited; only tiles
// that reach past its first query are masked.
//
// For D = 256 step 2 runs on the Hopper warpgroup-MMA kernel instead
// (attention_flash_wgmma.cu; 511 vs 293 TFLOP/s at position 127K on the H200, perf-log P5);
// both share attention_flash.h and this merge.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/async_copy.cuh"
#include "attention/attention_flash_wgmma.h"
#include "attention/attention_prep_prefill.h"
#include "common/device_common.cuh"
#include "qmatmul/qmatmul_decode_mma.cuh"

namespace lily::cuda {
namespace {

constexpr int kRows = kFlashRows;    // query rows per block
constexpr int kKeys = kFlashKeys;    // keys per tile
constexpr int kThreads = 256;        // 8 warps x 16 rows
constexpr int kMinSplitTiles = 4;    // a key split gets at least this many tiles
constexpr int kMaxSplitBlocks = 256; // partial results the scratch holds room for
constexpr float kLog2e = kFlashLog2e;

// Shared memory rows are D bf16 + 16 bytes of padding.
template <int D>
constexpr int kRowBytes = D * 2 + 16;
template <int D>
constexpr int kSmemBytes = (kRows + 4 * kKeys) * kRowBytes<D>;  // Q + 2 stages of K and V

// Grid: x = query tile x KV head, heaviest (latest) tiles first so the causal tail is
// short; y = key split. Writes bf16 outputs (one split) or partial results.
template <int D>
__global__ void __launch_bounds__(kThreads, 1) attention_flash_kernel(FlashParams p) {
  constexpr int RB = kRowBytes<D>, CPR = D / 8;  // padded row bytes, 16-byte chunks per row
  constexpr int NT = D / 8;                      // 8-wide output column tiles per warp
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const FlashBlock b = flash_block(p);
  if (b.kt0 >= b.kt1) return;  // an empty split
  const int g = b.g, q0 = b.q0, kt0 = b.kt0, kt1 = b.kt1, n_keys = b.n_keys;

  const uint32_t s_q = smem_addr(smem), s_kv = s_q + kRows * RB;  // stage s: K at s_kv + s*2*kKeys*RB, V after it
  pdl_wait();

  // Q tile (flash_q_src: rows past the block's tokens are zeros).
#pragma unroll
  for (int j = 0; j < kRows * CPR / kThreads; ++j) {
    const int i = tid + j * kThreads, r = i / CPR, c = i % CPR;
    bool ok;
    const size_t src = flash_q_src(p, b, r, c, D, ok);
    cp_async16(s_q + r * RB + c * 16, p.q + src, ok ? 16u : 0u);
  }
  // K/V tile kt -> stage st; keys past n_keys (not yet written) are zeros.
  auto load_kv = [&](int kt, int st) {
    const uint32_t sk = s_kv + st * 2 * kKeys * RB, sv = sk + kKeys * RB;
#pragma unroll
    for (int j = 0; j < kKeys * CPR / kThreads; ++j) {
      const int i = tid + j * kThreads, r = i / CPR, c = i % CPR, key = kt * kKeys + r;
      const bool ok = key < n_keys;
      const size_t src = (static_cast<size_t>(ok ? key : 0) * p.Hkv + g) * D + c * 8;
      cp_async16(sk + r * RB + c * 16, p.k + src, ok ? 16u : 0u);
      cp_async16(sv + r * RB + c * 16, p.v + src, ok ? 16u : 0u);
    }
    cp_async_commit();
  };
  load_kv(kt0, 0);

  // ldmatrix lane addresses (see the fragment layouts of mma.m16n8k16):
  //   Q (A, x4): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) -> lane row l&15, chunk l>>4
  //   K (B, x4): (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys 8-15, k 0-7), (keys 8-15, k 8-15)
  //              = b0, b1 of key tile n and b0, b1 of n+1 -> lane key (l&7) + (l>>4)*8, chunk (l>>3)&1
  //   V (B, x4.trans): (keys 0-7 | 8-15) x (d 0-7 | 8-15) = b0, b1 of d tile n, b0, b1 of n+1
  //              -> lane key (l&7) + ((l>>3)&1)*8, chunk l>>4
  const uint32_t a_q = s_q + (warp * 16 + (lane & 15)) * RB + (lane >> 4) * 16;
  const uint32_t a_k = ((lane & 7) + (lane >> 4) * 8) * RB + ((lane >> 3) & 1) * 16;
  const uint32_t a_v = ((lane & 7) + ((lane >> 3) & 1) * 8) * RB + (lane >> 4) * 16;

  // This thread's two rows (fragment rows gid and gid + 8) and their last visible key.
  const int r0 = warp * 16 + (lane >> 2), quad = lane & 3;
  const int lim[2] = {p.pos0 + q0 + r0 / p.G, p.pos0 + q0 + (r0 + 8) / p.G};
  float o[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // row max of scores, this thread's part of the row sum

  for (int kt = kt0; kt < kt1; ++kt) {
    const int st = (kt - kt0) & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile kt visible to all; every warp is done with the other stage
    if (kt + 1 < kt1) load_kv(kt + 1, st ^ 1);
    const uint32_t sk = s_kv + st * 2 * kKeys * RB, sv = sk + kKeys * RB;

    // S = Q K^T: s[n] holds keys 8n .. 8n+7 of the tile.
    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a_q + ks * 32, a);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        ldmatrix_x4(sk + a_k + np * 16 * RB + ks * 32, b);
        mma_16816(s[2 * np], a, b[0], b[1]);
        mma_16816(s[2 * np + 1], a, b[2], b[3]);
      }
    }
    if (kt * kKeys + kKeys - 1 > p.pos0 + q0) {  // the tile reaches past the block's first query
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (kt * kKeys + 8 * n + 2 * quad + (e & 1) > lim[e >> 1]) s[n][e] = -INFINITY;
    }

    // Online softmax per row (a row's 64 scores sit in the 4 threads of a quad).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
      mx = quad_max(mx);
      const float m_new = fmaxf(m[i], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: keep exp finite
      const float corr = exp2f((m[i] - m_use) * kLog2e), sub = m_use * kLog2e;
      m[i] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        s[n][2 * i] = exp2f(fmaf(s[n][2 * i], kLog2e, -sub));
        s[n][2 * i + 1] = exp2f(fmaf(s[n][2 * i + 1], kLog2e, -sub));
        sum += s[n][2 * i] + s[n][2 * i + 1];
      }
      l[i] = l[i] * corr + sum;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        o[n][2 * i] *= corr;
        o[n][2 * i + 1] *= corr;
      }
    }

    // O += P V: the S fragments of keys 16kk .. 16kk+15 are exactly the A fragment.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(sv + a_v + kk * 16 * RB + dp * 32, b);
        mma_16816(o[2 * dp], pa, b[0], b[1]);
        mma_16816(o[2 * dp + 1], pa, b[2], b[3]);
      }
    }
  }
  pdl_trigger();

#pragma unroll
  for (int i = 0; i < 2; ++i) l[i] = quad_sum(l[i]);
#pragma unroll
  for (int i = 0; i < 2; ++i)
    flash_store_row<D>(p, b, r0 + 8 * i, quad, m[i], l[i],
                       [&](int n) { return make_float2(o[n][2 * i], o[n][2 * i + 1]); });
}

// One warp per output row (token t, head h): out = sum_s w_s O_s / sum_s w_s l_s * sigmoid(gate)
// with w_s = exp(m_s - max_s m_s) over the non-empty splits of the row's block.
template <int D>
__global__ void __launch_bounds__(256) attention_prefill_merge_kernel(FlashParams p) {
  constexpr int DPL = D / 32;
  const int lane = threadIdx.x & 31, row = blockIdx.x * 8 + (threadIdx.x >> 5);
  pdl_wait();
  if (row >= p.T * p.Hq) return;
  const int t = row / p.Hq, h = row % p.Hq, g = h / p.G, qt = t / p.tpt;
  const int r = (t % p.tpt) * p.G + h % p.G, blk = qt * p.Hkv + g;
  const int n_tiles = key_tiles(qt, p.tpt, p.T, p.pos0), chunk = split_chunk(n_tiles, p.splits);
  const int live = (n_tiles + chunk - 1) / chunk;
  float M = -INFINITY;
  for (int s = 0; s < live; ++s) M = fmaxf(M, p.part_ml[(static_cast<size_t>(s) * p.blocks + blk) * kRows + r].x);
  float L = 0.0f, acc[DPL] = {};
  for (int s = 0; s < live; ++s) {
    const size_t prow = (static_cast<size_t>(s) * p.blocks + blk) * kRows + r;
    const float2 ml = p.part_ml[prow];
    const float w = exp2f((ml.x - M) * kLog2e);  // 0 for a split where the row saw no key
    L += w * ml.y;
    const float* src = p.part_o + prow * D + lane * DPL;
#pragma unroll
    for (int i = 0; i < DPL; i += 2) {
      const float2 v = *reinterpret_cast<const float2*>(src + i);
      acc[i] = fmaf(w, v.x, acc[i]);
      acc[i + 1] = fmaf(w, v.y, acc[i + 1]);
    }
  }
  pdl_trigger();
  const float inv = 1.0f / L;
  const float* gate = p.proj + static_cast<size_t>(t) * p.ldp + static_cast<size_t>(h) * 2 * D + D + lane * DPL;
  uint32_t w[DPL / 2];
#pragma unroll
  for (int i = 0; i < DPL; i += 2) {
    const float2 gv = *reinterpret_cast<const float2*>(gate + i);
    w[i / 2] = pack_bf16(acc[i] * inv * sigmoidf_(gv.x), acc[i + 1] * inv * sigmoidf_(gv.y));
  }
  uint16_t* dst = p.out + static_cast<size_t>(row) * D + lane * DPL;
  if constexpr (DPL == 8) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (DPL == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  }
}

int split_capacity() { return std::min(sm_count(), kMaxSplitBlocks); }

size_t round_up(size_t n) { return (n + 255) / 256 * 256; }

template <int D>
void launch_flash(const FlashParams& p, cudaStream_t stream) {
  allow_dynamic_smem(reinterpret_cast<const void*>(attention_flash_kernel<D>), kSmemBytes<D>,
                     "attention_prefill: shared memory opt-in");
  launch("attention_prefill_flash", attention_flash_kernel<D>, dim3(p.blocks, p.splits), dim3(kThreads),
         kSmemBytes<D>, stream, p);
}

template <int D>
void launch_merge(const FlashParams& p, cudaStream_t stream) {
  launch("attention_prefill_merge", attention_prefill_merge_kernel<D>, dim3((p.T * p.Hq + 7) / 8), dim3(256), 0, stream, p);
}

// Whether the route takes the wgmma flash kernel (AttnPrefillArgs::route).
bool use_wgmma(AttnRoute route, int D) {
  if (route == AttnRoute::ByHeadDim) return flash_wgmma_supports(D);
  if (route == AttnRoute::Mma) return false;
  if (!flash_wgmma_supports(D))
    fail("attention_prefill (wgmma route: LILY_PREFILL_ATTN=wgmma or the op route prefill_wgmma): ",
         "the wgmma kernel takes head dim 256, got ", std::to_string(D));
  return true;
}

}  // namespace

size_t attention_prefill_scratch_bytes(int T, int Hq, int D) {
  const size_t q = round_up(static_cast<size_t>(T) * Hq * D * 2);
  const size_t rows = static_cast<size_t>(split_capacity()) * kRows;
  return q + round_up(rows * D * 4) + round_up(rows * 8);
}

void attention_prefill(const AttnPrefillArgs& a, cudaStream_t stream) {
  using std::to_string;
  if (!a.out || !a.scratch) fail("attention_prefill: null out or scratch");
  if (reinterpret_cast<uintptr_t>(a.out) % 16 != 0 || reinterpret_cast<uintptr_t>(a.scratch) % 256 != 0)
    fail("attention_prefill: out must be 16-byte and scratch 256-byte aligned");
  if (a.T >= 1 && a.Hq >= 1 && a.D >= 1 && a.scratch_bytes < attention_prefill_scratch_bytes(a.T, a.Hq, a.D))
    fail("attention_prefill: scratch of ", to_string(a.scratch_bytes), " bytes, needs ",
         to_string(attention_prefill_scratch_bytes(a.T, a.Hq, a.D)));
  const bool wgmma = use_wgmma(a.route, a.D);  // before any launch: a refused route leaves the cache untouched
  uint16_t* q = static_cast<uint16_t*>(a.scratch);
  attention_prep_prefill(a, q, stream);  // validates the shapes

  FlashParams p{};
  p.q = q;
  p.k = a.k_cache;
  p.v = a.v_cache;
  p.proj = a.proj;
  p.out = a.out;
  uint8_t* part = static_cast<uint8_t*>(a.scratch) + round_up(static_cast<size_t>(a.T) * a.Hq * a.D * 2);
  p.part_o = reinterpret_cast<float*>(part);
  p.part_ml = reinterpret_cast<float2*>(part + round_up(static_cast<size_t>(split_capacity()) * kRows * a.D * 4));
  p.ldp = a.ldp, p.T = a.T, p.pos0 = a.pos0, p.Hq = a.Hq, p.Hkv = a.Hkv, p.G = a.Hq / a.Hkv;
  p.tpt = kRows / p.G;
  p.blocks = (a.T + p.tpt - 1) / p.tpt * a.Hkv;
  // Split the keys only when the blocks cannot fill the GPU: as many splits as fit the
  // SMs (one wave), each of at least kMinSplitTiles tiles.
  const int cap = split_capacity(), most_tiles = key_tiles(p.blocks / a.Hkv - 1, p.tpt, a.T, a.pos0);
  p.splits = p.blocks < cap ? std::max(1, std::min(cap / p.blocks, most_tiles / kMinSplitTiles)) : 1;
  if (wgmma) {
    launch_flash_wgmma(p, a.D, stream);
  } else {
    switch (a.D) {
      case 64: launch_flash<64>(p, stream); break;
      case 128: launch_flash<128>(p, stream); break;
      default: launch_flash<256>(p, stream); break;
    }
  }
  if (p.splits > 1) {
    switch (a.D) {
      case 64: launch_merge<64>(p, stream); break;
      case 128: launch_merge<128>(p, stream); break;
      default: launch_merge<256>(p, stream); break;
    }
  }
}

}  // namespace lily::cuda
