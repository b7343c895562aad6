// Memory-bound: one thread per float4 of h; its k slot rows and the shared-expert row
// are streamed once (evict-first loads), all issued before the adds.
#include "moe/moe_combine_prefill.h"

#include <cstdint>
#include <string>

#include "common/device_common.cuh"
#include "common/kernel_types.h"

namespace lily::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// grid (T, ceil(H4 / kThreads)): token blockIdx.x, float4 column c.
__global__ void __launch_bounds__(kThreads) combine_kernel(float4* h, const float4* y_slots, const float4* y_shared,
                                                           const float* shared_logit, int H4, int k) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x, c = blockIdx.y * kThreads + threadIdx.x;
  if (c >= H4) return;
  const size_t i = static_cast<size_t>(t) * H4 + c;
  const float4* ys = y_slots + static_cast<size_t>(t) * k * H4 + c;
  float4 y[kMoeMaxTopK];
#pragma unroll
  for (int j = 0; j < kMoeMaxTopK; ++j)
    if (j < k) y[j] = __ldcs(ys + static_cast<size_t>(j) * H4);
  const float4 sh = __ldcs(y_shared + i);
  const float g = sigmoidf_(shared_logit[t]);
  float4 r = y[0];
#pragma unroll
  for (int j = 1; j < kMoeMaxTopK; ++j)
    if (j < k) r = add4(r, y[j]);
  float4 v = h[i];
  v.x += fmaf(g, sh.x, r.x);
  v.y += fmaf(g, sh.y, r.y);
  v.z += fmaf(g, sh.z, r.z);
  v.w += fmaf(g, sh.w, r.w);
  h[i] = v;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

void moe_combine_prefill(float* h, const float* y_slots, const float* y_shared, const float* shared_logit, int T, int H, int k,
                 cudaStream_t stream) {
  if (!h || !y_slots || !y_shared || !shared_logit) fail("moe_combine_prefill: a required pointer is null");
  if (T < 1) fail("moe_combine_prefill: token count must be >= 1, got ", std::to_string(T));
  if (H < 4 || H % 4 != 0) fail("moe_combine_prefill: hidden size must be a positive multiple of 4, got ", std::to_string(H));
  if (k < 1 || k > kMoeMaxTopK)
    fail("moe_combine_prefill: top_k must be in [1, ", std::to_string(kMoeMaxTopK), "], got ", std::to_string(k));
  if (!aligned16(h) || !aligned16(y_slots) || !aligned16(y_shared))
    fail("moe_combine_prefill: h, y_slots and y_shared must be 16-byte aligned");
  const int H4 = H / 4;
  const dim3 grid(T, (H4 + kThreads - 1) / kThreads);
  launch("moe_combine_prefill", combine_kernel, grid, dim3(kThreads), 0, stream, reinterpret_cast<float4*>(h),
         reinterpret_cast<const float4*>(y_slots), reinterpret_cast<const float4*>(y_shared), shared_logit, H4, k);
}

}  // namespace lily::cuda
