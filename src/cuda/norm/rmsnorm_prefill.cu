#include "norm/rmsnorm_prefill.h"

#include <string>

#include "common/device_common.cuh"
#include "error.h"

namespace lily::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row; each thread keeps its float4 slots in registers between the two passes.
template <int SLOTS>
__global__ void __launch_bounds__(kThreads) rmsnorm_prefill_kernel(const float* h, const float* w, int H, float eps,
                                                                uint16_t* xb, float* xf, int ld) {
  __shared__ float red[32];
  pdl_wait();
  const size_t row = blockIdx.x;
  const float4* hr = reinterpret_cast<const float4*>(h + row * H);
  const int n4 = H / 4;
  float4 v[SLOTS];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < SLOTS; ++i) {
    const int f = threadIdx.x + i * kThreads;
    v[i] = f < n4 ? hr[f] : make_float4(0.f, 0.f, 0.f, 0.f);
    ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
  }
  const float inv = rsqrtf(block_sum(ss, red) / H + eps);
#pragma unroll
  for (int i = 0; i < SLOTS; ++i) {
    const int f = threadIdx.x + i * kThreads;
    if (f >= n4) break;
    const float4 g = reinterpret_cast<const float4*>(w)[f];
    const float4 y = make_float4(v[i].x * inv * g.x, v[i].y * inv * g.y, v[i].z * inv * g.z, v[i].w * inv * g.w);
    if (xb) reinterpret_cast<uint2*>(xb + row * ld)[f] = make_uint2(pack_bf16(y.x, y.y), pack_bf16(y.z, y.w));
    if (xf) reinterpret_cast<float4*>(xf + row * ld)[f] = y;
  }
  pdl_trigger();
}

}  // namespace

void rmsnorm_prefill(const float* h, const float* w, int T, int H, float eps, uint16_t* xb, float* xf,
                     cudaStream_t stream, int ld) {
  if (H % 4 != 0 || H > 8 * 4 * kThreads) fail("rmsnorm_prefill: H = ", std::to_string(H), " must be a multiple of 4, <= 8192");
  if (T <= 0) fail("rmsnorm_prefill: no rows");
  if (ld == 0) ld = H;
  if (ld < H || ld % 4 != 0) fail("rmsnorm_prefill: row stride ", std::to_string(ld), " must be a multiple of 4, >= H");
  const int slots = (H / 4 + kThreads - 1) / kThreads;
  auto kernel = slots <= 2 ? rmsnorm_prefill_kernel<2> : slots <= 4 ? rmsnorm_prefill_kernel<4> : rmsnorm_prefill_kernel<8>;
  launch("rmsnorm_prefill", kernel, dim3(T), dim3(kThreads), 0, stream, h, w, H, eps, xb, xf, ld);
}

}  // namespace lily::cuda
