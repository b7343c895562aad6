// Prefill attention, step 1: per token, q/k RMSNorm + partial RoPE, q to bf16 scratch,
// k and v appended to the bf16 cache. One warp per (token, head); lane l holds dims
// l*DPL .. l*DPL + DPL-1 (DPL = D/32), exactly as attention_decode.cu lays them out,
// so the cache rows are the ones T decode steps would write.
#include <string>

#include "attention/attention_common.cuh"
#include "attention/attention_prep_prefill.h"
#include "common/device_common.cuh"

namespace lily::cuda {
namespace {

constexpr int kWarps = 8;

template <int DPL>
__device__ __forceinline__ void load_f32(const float* p, float (&x)[DPL]) {
  if constexpr (DPL == 2) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    x[0] = v.x, x[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < DPL; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(p + i);
      x[i] = v.x, x[i + 1] = v.y, x[i + 2] = v.z, x[i + 3] = v.w;
    }
  }
}

// Warp w of the grid handles token w / (Hq + Hkv), item w % (Hq + Hkv): items < Hq are
// query heads, the rest KV heads (k and v).
template <int D>
__global__ void __launch_bounds__(kWarps * 32) attention_prep_kernel(AttnPrefillArgs a, uint16_t* q_out) {
  constexpr int DPL = D / 32;
  const int lane = threadIdx.x & 31, items = a.Hq + a.Hkv;
  const int w = blockIdx.x * kWarps + (threadIdx.x >> 5);
  pdl_wait();
  if (w >= a.T * items) return;
  const int t = w / items, item = w % items, pos = a.pos0 + t;
  const float* row = a.proj + static_cast<size_t>(t) * a.ldp;
  float x[DPL];
  if (item < a.Hq) {
    load_f32<DPL>(row + static_cast<size_t>(item) * 2 * D + lane * DPL, x);
    pdl_trigger();
    norm_rope<DPL>(x, a.q_norm, pos, a.rot_dim, a.inv_freq, a.eps, lane);
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] *= rsqrtf(static_cast<float>(D));
    store_bf16<DPL>(q_out + (static_cast<size_t>(t) * a.Hq + item) * D + lane * DPL, x);
  } else {
    const int g = item - a.Hq;
    const float* kv = row + static_cast<size_t>(a.Hq) * 2 * D;
    float v[DPL];
    load_f32<DPL>(kv + static_cast<size_t>(g) * D + lane * DPL, x);
    load_f32<DPL>(kv + static_cast<size_t>(a.Hkv + g) * D + lane * DPL, v);
    pdl_trigger();
    norm_rope<DPL>(x, a.k_norm, pos, a.rot_dim, a.inv_freq, a.eps, lane);
    const size_t at = (static_cast<size_t>(pos) * a.Hkv + g) * D + lane * DPL;
    store_bf16<DPL>(a.k_cache + at, x);
    store_bf16<DPL>(a.v_cache + at, v);
  }
}

bool misaligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes != 0; }

}  // namespace

void attention_prep_prefill(const AttnPrefillArgs& a, uint16_t* q_out, cudaStream_t stream) {
  using std::to_string;
  if (a.D != 64 && a.D != 128 && a.D != 256)
    fail("attention_prefill: head dim ", to_string(a.D), " is not supported (64, 128, 256)");
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0 || a.Hq / a.Hkv > 16)
    fail("attention_prefill: needs Hq (", to_string(a.Hq), ") a multiple of Hkv (", to_string(a.Hkv),
         ") with at most 16 query heads per KV head");
  const int dpl = a.D / 32, half = a.rot_dim / 2;
  if (a.rot_dim <= 0 || a.rot_dim > a.D || half % dpl != 0 || ((half / dpl) & (half / dpl - 1)) != 0)
    fail("attention_prefill: rotary dim ", to_string(a.rot_dim), " does not fit head dim ", to_string(a.D));
  if (a.T < 1 || a.pos0 < 0 || a.pos0 + a.T > a.ctx)
    fail("attention_prefill: tokens ", to_string(a.pos0), " .. ", to_string(a.pos0 + a.T - 1),
         " do not fit a cache of ", to_string(a.ctx), " rows");
  if (a.ldp < (a.Hq * 2 + a.Hkv * 2) * a.D || a.ldp % 4 != 0)
    fail("attention_prefill: proj row stride ", to_string(a.ldp), " must be a multiple of 4 and hold ",
         to_string((a.Hq * 2 + a.Hkv * 2) * a.D), " values");
  std::string null;
  for (auto [p, name] : {std::pair<const void*, const char*>{a.proj, "proj"}, {a.q_norm, "q_norm"}, {a.k_norm, "k_norm"},
                         {a.inv_freq, "inv_freq"}, {a.k_cache, "k_cache"}, {a.v_cache, "v_cache"}, {q_out, "queries"}})
    if (!p) null += std::string(null.empty() ? "" : ", ") + name;
  if (!null.empty()) fail("attention_prefill: null pointer: ", null);
  if (misaligned(a.proj, 16) || misaligned(a.k_cache, 16) || misaligned(a.v_cache, 16) || misaligned(q_out, 16))
    fail("attention_prefill: proj, k_cache, v_cache and the scratch must be 16-byte aligned");
  const int warps = a.T * (a.Hq + a.Hkv);
  const dim3 grid((warps + kWarps - 1) / kWarps), block(kWarps * 32);
  switch (a.D) {
    case 64: launch("attention_prep_prefill", attention_prep_kernel<64>, grid, block, 0, stream, a, q_out); break;
    case 128: launch("attention_prep_prefill", attention_prep_kernel<128>, grid, block, 0, stream, a, q_out); break;
    default: launch("attention_prep_prefill", attention_prep_kernel<256>, grid, block, 0, stream, a, q_out); break;
  }
}

}  // namespace lily::cuda
