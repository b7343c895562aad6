#include "gated_delta/gated_rmsnorm_prefill.h"

#include <string>

#include "common/device_common.cuh"

namespace lily::cuda {
namespace {

constexpr int kWarps = 8;  // rows (token, head) per block

// One warp per row (t, h), lane l owning d = 4l .. 4l+3: loads as float4, bf16 stores as 8 bytes.
__global__ void __launch_bounds__(kWarps * 32) gated_rmsnorm_prefill_kernel(GdnGatedNormArgs a) {
  const int lane = threadIdx.x & 31, row = blockIdx.x * kWarps + (threadIdx.x >> 5);  // row = t * Hv + h
  const bool active = 4 * lane < a.Dv;
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4 w = active ? reinterpret_cast<const float4*>(a.w)[lane] : zero;
  pdl_wait();
  if (row >= a.T * a.Hv) return;
  const int t = row / a.Hv, h = row % a.Hv;
  const float4 o = active ? reinterpret_cast<const float4*>(a.o + static_cast<size_t>(row) * a.Dv)[lane] : zero;
  const float4 z = active ? reinterpret_cast<const float4*>(a.z + static_cast<size_t>(t) * a.ldz + h * a.Dv)[lane] : zero;
  const float inv = rsqrtf(warp_sum(o.x * o.x + o.y * o.y + o.z * o.z + o.w * o.w) / a.Dv + a.eps);
  if (active) {
    const uint32_t lo = pack_bf16(o.x * inv * w.x * siluf_(z.x), o.y * inv * w.y * siluf_(z.y));
    const uint32_t hi = pack_bf16(o.z * inv * w.z * siluf_(z.z), o.w * inv * w.w * siluf_(z.w));
    reinterpret_cast<uint2*>(a.out + static_cast<size_t>(row) * a.Dv)[lane] = make_uint2(lo, hi);
  }
  pdl_trigger();
}

bool aligned(const void* p, unsigned bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

}  // namespace

void gated_rmsnorm_prefill(const GdnGatedNormArgs& a, cudaStream_t stream) {
  const char* op = "gated_rmsnorm_prefill";
  if (a.T < 1 || a.Hv < 1) fail(op, ": need T >= 1 and Hv >= 1 (T ", std::to_string(a.T), ", Hv ", std::to_string(a.Hv), ")");
  if (a.Dv % 16 != 0 || a.Dv < 16 || a.Dv > 128) fail(op, ": value head dim must be a multiple of 16 up to 128 (Dv ", std::to_string(a.Dv), ")");
  if (a.ldz % 4 != 0 || a.ldz < a.Hv * a.Dv) fail(op, ": z row stride ", std::to_string(a.ldz), " must be a multiple of 4, >= Hv*Dv");
  if (static_cast<long long>(a.T) * a.Hv >= (1LL << 31) - kWarps) fail(op, ": too many (token, head) rows");
  if (!a.o || !a.z || !a.w || !a.out) fail(op, ": missing input or output pointer");
  if (!aligned(a.o, 16) || !aligned(a.z, 16) || !aligned(a.w, 16) || !aligned(a.out, 8))
    fail(op, ": o, z and w must be 16-byte aligned, out 8-byte aligned");
  const int rows = a.T * a.Hv;
  launch(op, gated_rmsnorm_prefill_kernel, dim3((rows + kWarps - 1) / kWarps), dim3(kWarps * 32), 0, stream, a);
}

}  // namespace lily::cuda
