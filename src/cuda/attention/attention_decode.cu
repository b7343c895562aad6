#include "attention/attention_decode.h"

#include <cfloat>
#include <cmath>

#include "attention/attention_common.cuh"
#include "common/device_common.cuh"

namespace lily::cuda {
namespace {

constexpr int kWarps = 8;    // G <= 8 query heads per KV head
constexpr int kTile = 4;     // keys per warp per step of the online softmax

// DPL = D/32 bf16 values per lane, loaded as one 4/8/16-byte vector (L2 only: the
// newest row was written by this block during this launch).
template <int DPL>
__device__ __forceinline__ void load_bf16(const uint16_t* p, float (&f)[DPL]) {
  uint32_t w[DPL / 2];
  if constexpr (DPL == 8) {
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (DPL == 4) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = __ldcg(reinterpret_cast<const unsigned int*>(p));
  }
#pragma unroll
  for (int i = 0; i < DPL / 2; ++i) {
    f[2 * i] = bf16_lo(w[i]);
    f[2 * i + 1] = bf16_hi(w[i]);
  }
}

// Sums v[0..7] over the warp; afterwards lane l holds the total of v[(l >> 2) & 7].
__device__ __forceinline__ float transpose_reduce8(float (&v)[8], int lane) {
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
  float a[4], b[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float send = b4 ? v[i] : v[i + 4], keep = b4 ? v[i + 4] : v[i];
    a[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float send = b3 ? a[i] : a[i + 2], keep = b3 ? a[i + 2] : a[i];
    b[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
  }
  float s = (b2 ? b[1] : b[0]) + __shfl_xor_sync(0xffffffffu, b2 ? b[0] : b[1], 4);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  return s;
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32) attention_kernel(AttnArgs a, const int* halt) {
  constexpr int DPL = D / 32;
  const int g = blockIdx.x, split = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int G = a.Hq / a.Hkv;
  __shared__ float qs[kWarps][D], acc_s[kWarps][D];
  __shared__ float m_s[kWarps][kWarps], l_s[kWarps][kWarps], head_m[kWarps], head_l[kWarps];

  if (wait_halted(halt)) return;
  const int pos = *a.pos + a.pos_offset, L = pos + 1;
  const auto [chunk, n_splits, start, end] = split_range(a, L, split);
  if (split >= n_splits) return;
  const float* kv_in = a.qkv + static_cast<size_t>(a.Hq) * 2 * D;

  for (int i = threadIdx.x; i < kWarps * D; i += blockDim.x) (&acc_s[0][0])[i] = 0.0f;
  if (warp < G) {
    float q[DPL];
    const float* src = a.qkv + static_cast<size_t>(g * G + warp) * 2 * D + lane * DPL;
#pragma unroll
    for (int i = 0; i < DPL; ++i) q[i] = src[i];
    norm_rope<DPL>(q, a.q_norm, pos, a.rot_dim, a.inv_freq, a.eps, lane);
#pragma unroll
    for (int i = 0; i < DPL; ++i) qs[warp][lane * DPL + i] = q[i] * rsqrtf(static_cast<float>(D));
  }
  if (split == n_splits - 1 && warp == 0) {  // append this token's k, v
    float k[DPL];
    const float* ksrc = kv_in + static_cast<size_t>(g) * D + lane * DPL;
    const float* vsrc = kv_in + static_cast<size_t>(a.Hkv + g) * D + lane * DPL;
#pragma unroll
    for (int i = 0; i < DPL; ++i) k[i] = ksrc[i];
    norm_rope<DPL>(k, a.k_norm, pos, a.rot_dim, a.inv_freq, a.eps, lane);
    const size_t at = (static_cast<size_t>(pos) * a.Hkv + g) * D + lane * DPL;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      a.k_cache[at + i] = to_bf16_bits(k[i]);
      a.v_cache[at + i] = to_bf16_bits(vsrc[i]);
    }
  }
  __syncthreads();  // q staged; the appended row is visible to the whole block

  float qr[kWarps][DPL], acc[kWarps][DPL];
#pragma unroll
  for (int h = 0; h < kWarps; ++h)
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      qr[h][i] = h < G ? qs[h][lane * DPL + i] : 0.0f;
      acc[h][i] = 0.0f;
    }
  float m = -FLT_MAX, l = 0.0f;  // of head (lane >> 2) & 7

  for (int t0 = start + warp * kTile; t0 < end; t0 += kWarps * kTile) {
    float kf[kTile][DPL], vf[kTile][DPL];
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const size_t row = (static_cast<size_t>(min(t0 + j, end - 1)) * a.Hkv + g) * D + lane * DPL;
      load_bf16<DPL>(a.k_cache + row, kf[j]);
      load_bf16<DPL>(a.v_cache + row, vf[j]);
    }
    float s[kTile], tile_max = -FLT_MAX;
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      float part[kWarps];
#pragma unroll
      for (int h = 0; h < kWarps; ++h) {
        float d = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) d = fmaf(qr[h][i], kf[j][i], d);
        part[h] = d;
      }
      s[j] = t0 + j < end ? transpose_reduce8(part, lane) : -FLT_MAX;
      tile_max = fmaxf(tile_max, s[j]);
    }
    const float m_new = fmaxf(m, tile_max);
    const float corr = __expf(m - m_new);
    float p[kTile];
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      p[j] = t0 + j < end ? __expf(s[j] - m_new) : 0.0f;
      l = l * (j == 0 ? corr : 1.0f) + p[j];
    }
    m = m_new;
#pragma unroll
    for (int h = 0; h < kWarps; ++h) {
      if (h >= G) break;
      const float ch = __shfl_sync(0xffffffffu, corr, 4 * h);
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[h][i] *= ch;
#pragma unroll
      for (int j = 0; j < kTile; ++j) {
        const float ph = __shfl_sync(0xffffffffu, p[j], 4 * h);
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[h][i] = fmaf(ph, vf[j][i], acc[h][i]);
      }
    }
  }

  // Merge the warps: rescale each to the block max of its head, add in shared memory.
  if ((lane & 3) == 0 && (lane >> 2) < G) {
    m_s[warp][lane >> 2] = m;
    l_s[warp][lane >> 2] = l;
  }
  __syncthreads();
  if (threadIdx.x < G) {
    float M = -FLT_MAX, S = 0.0f;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, m_s[w][threadIdx.x]);
    for (int w = 0; w < kWarps; ++w) S += l_s[w][threadIdx.x] * __expf(m_s[w][threadIdx.x] - M);
    head_m[threadIdx.x] = M;
    head_l[threadIdx.x] = S;
  }
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) {  // in warp order, so the sum is deterministic
    if (warp == w) {
#pragma unroll
      for (int h = 0; h < kWarps; ++h) {
        if (h >= G) break;
        const float f = __expf(m_s[warp][h] - head_m[h]);
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc_s[h][lane * DPL + i] += acc[h][i] * f;
      }
    }
    __syncthreads();
  }
  timeline_done();

  const float* gate = a.qkv + static_cast<size_t>(g) * G * 2 * D + D;  // + h*2D + d
  float* out = a.out + static_cast<size_t>(g) * G * D;
  if (n_splits == 1) {
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
      const int h = i / D, d = i % D;
      out[i] = acc_s[h][d] / head_l[h] * sigmoidf_(gate[h * 2 * D + d]);
    }
    return;
  }
  const size_t stride = static_cast<size_t>(G) * (D + 2);
  float* part = a.partial + (static_cast<size_t>(g) * a.max_splits + split) * stride;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) part[(i / D) * (D + 2) + i % D] = acc_s[i / D][i % D];
  if (threadIdx.x < G) {
    part[threadIdx.x * (D + 2) + D] = head_m[threadIdx.x];
    part[threadIdx.x * (D + 2) + D + 1] = head_l[threadIdx.x];
  }
}

}  // namespace

void attention_decode(const AttnArgs& a, const int* halt, cudaStream_t stream) {
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0 || a.Hq / a.Hkv > kWarps)
    fail("attention_decode: needs Hq a multiple of Hkv with at most ", std::to_string(kWarps), " query heads per KV head");
  const int dpl = a.D / 32, half = a.rot_dim / 2;
  if (a.rot_dim <= 0 || a.rot_dim > a.D || half % dpl != 0 || ((half / dpl) & (half / dpl - 1)) != 0)
    fail("attention_decode: rotary dim ", std::to_string(a.rot_dim), " does not fit head dim ", std::to_string(a.D));
  if (a.max_splits < 1 || a.max_splits > kAttnMaxSplits || a.min_chunk < 1)
    fail("attention_decode: max_splits must be in [1, ", std::to_string(kAttnMaxSplits), "], min_chunk positive");
  const dim3 grid(a.Hkv, a.max_splits), block(kWarps * 32);
  switch (a.D) {
    case 64:
      launch("attention_decode", attention_kernel<64>, grid, block, 0, stream, a, halt);
      launch("attention_merge", attention_merge_kernel<64>, dim3(a.Hq), dim3(kAttnMergeWarps * 32), 0, stream, a, halt);
      break;
    case 128:
      launch("attention_decode", attention_kernel<128>, grid, block, 0, stream, a, halt);
      launch("attention_merge", attention_merge_kernel<128>, dim3(a.Hq), dim3(kAttnMergeWarps * 32), 0, stream, a, halt);
      break;
    case 256:
      launch("attention_decode", attention_kernel<256>, grid, block, 0, stream, a, halt);
      launch("attention_merge", attention_merge_kernel<256>, dim3(a.Hq), dim3(kAttnMergeWarps * 32), 0, stream, a, halt);
      break;
    default: fail("attention_decode: head dim ", std::to_string(a.D), " is not supported (64, 128, 256)");
  }
}

std::vector<float> rope_inv_freq(double theta, int rot_dim) {
  std::vector<float> f(rot_dim / 2);
  for (int j = 0; j < rot_dim / 2; ++j) f[j] = static_cast<float>(std::pow(theta, -2.0 * j / rot_dim));
  return f;
}

size_t attention_partial_floats(int Hq, int Hkv, int D, int max_splits) {
  return static_cast<size_t>(Hkv) * max_splits * (Hq / Hkv) * (D + 2);
}

}  // namespace lily::cuda
