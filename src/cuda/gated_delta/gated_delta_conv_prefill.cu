#include "gated_delta/gated_delta_conv_prefill.h"

#include <cstdint>
#include <string>

#include "common/device_common.cuh"
#include "gated_delta/gated_delta_step.cuh"

namespace lily::cuda {
namespace {

constexpr int kWarps = 4;  // warps per block
constexpr int kRun = 32;   // tokens per warp: >= 3, so only run 0 reaches back into the ring; <= 32 for the gates

// silu(conv) of 4 channels: w[u] = the taps of channel u (x: t-3, y: t-2, z: t-1, w: t).
__device__ __forceinline__ float4 conv_silu(const float4 (&w)[4], float4 p0, float4 p1, float4 p2, float4 x) {
  return make_float4(conv4_silu(w[0], p0.x, p1.x, p2.x, x.x), conv4_silu(w[1], p0.y, p1.y, p2.y, x.y),
                     conv4_silu(w[2], p0.z, p1.z, p2.z, x.z), conv4_silu(w[3], p0.w, p1.w, p2.w, x.w));
}

// Block (x, group): warp w walks the run of kRun tokens starting at t0 = (4x + w) * kRun for
// one head of channels (group: q heads, then k heads, then v heads), lane l owning the 4
// channels 4l..4l+3 of the head, with the previous 3 pre-conv rows in registers. The
// warp of run 0 is the only reader of the ring rows of its channels and also writes
// them at the end, so no other block can see a half-updated ring.
__global__ void __launch_bounds__(kWarps * 32) gated_delta_conv_prefill_kernel(GdnConvPrefillArgs a) {
  const int lane = threadIdx.x & 31, run = blockIdx.x * kWarps + (threadIdx.x >> 5), group = blockIdx.y;
  const int key_dim = a.Hk * a.Dk, value_dim = a.Hv * a.Dv, conv_dim = 2 * key_dim + value_dim;
  const int kind = group < a.Hk ? 0 : group < 2 * a.Hk ? 1 : 2;  // q, k, v
  const int head = group - kind * a.Hk, width = kind == 2 ? a.Dv : a.Dk;
  const int ch = (kind == 2 ? 2 * key_dim + head * a.Dv : group * a.Dk) + 4 * lane;  // first channel of this lane
  const bool active = 4 * lane < width;
  float* out = kind == 0 ? a.q + head * a.Dk : kind == 1 ? a.k + head * a.Dk : a.v + head * a.Dv;
  const int ld_out = kind == 2 ? value_dim : key_dim;

  float4 w[4];
#pragma unroll
  for (int u = 0; u < 4; ++u)
    w[u] = active ? reinterpret_cast<const float4*>(a.conv_w)[ch + u] : make_float4(0.f, 0.f, 0.f, 0.f);

  pdl_wait();
  const int t0 = run * kRun;
  if (t0 >= a.T) return;
  const int t1 = min(t0 + kRun, a.T);
  // Pre-conv values of token t >= -3 (t < 0: the ring row of position pos0 + t).
  auto pre = [&](int t) {
    const float* row = t >= 0 ? a.proj + static_cast<size_t>(t) * a.ldp : a.ring + ((a.pos0 + t) & (kGdnRingRows - 1)) * conv_dim;
    return *reinterpret_cast<const float4*>(row + ch);
  };
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  float4 p0 = zero, p1 = zero, p2 = zero;  // rows t-3, t-2, t-1
  if (active) p0 = pre(t0 - 3), p1 = pre(t0 - 2), p2 = pre(t0 - 1);

  const float qk_scale = kind == 0 ? rsqrtf(static_cast<float>(a.Dk)) : 1.0f;
  for (int tb = t0; tb < t1; tb += 4) {  // 4 rows in flight per lane
    float4 x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = active && tb + u < t1 ? pre(tb + u) : zero;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      float4 y = conv_silu(w, p0, p1, p2, x[u]);
      p0 = p1, p1 = p2, p2 = x[u];
      if (kind < 2) {  // warp-uniform; idle lanes hold y = 0
        const float f = rsqrtf(warp_sum(y.x * y.x + y.y * y.y + y.z * y.z + y.w * y.w) + 1e-6f) * qk_scale;
        y = make_float4(y.x * f, y.y * f, y.z * f, y.w * f);
      }
      if (active && tb + u < t1) *reinterpret_cast<float4*>(out + static_cast<size_t>(tb + u) * ld_out + 4 * lane) = y;
    }
  }

  if (kind == 2 && t0 + lane < t1) {  // gates of value head `head`, one token per lane
    const int t = t0 + lane;
    const float* ba = a.proj + static_cast<size_t>(t) * a.ldp + conv_dim + value_dim;
    a.beta[static_cast<size_t>(t) * a.Hv + head] = sigmoidf_(ba[head]);
    a.decay[static_cast<size_t>(t) * a.Hv + head] = gated_delta_decay(ba[a.Hv + head], a.dt_bias[head], a.neg_A[head]);
  }

  if (run == 0 && active)  // after this lane's own ring reads above (same addresses, program order)
    for (int t = max(0, a.T - kGdnRingRows); t < a.T; ++t)
      *reinterpret_cast<float4*>(a.ring + ((a.pos0 + t) & (kGdnRingRows - 1)) * conv_dim + ch) = pre(t);
  pdl_trigger();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

void gated_delta_conv_prefill(const GdnConvPrefillArgs& a, cudaStream_t stream) {
  const char* op = "gated_delta_conv_prefill";
  if (a.T < 1 || a.pos0 < 0) fail(op, ": need T >= 1 and pos0 >= 0 (T ", std::to_string(a.T), ", pos0 ", std::to_string(a.pos0), ")");
  if (a.Dk % 16 != 0 || a.Dk < 16 || a.Dk > 128 || a.Dv % 16 != 0 || a.Dv < 16 || a.Dv > 128)
    fail(op, ": head dims must be multiples of 16 up to 128 (Dk ", std::to_string(a.Dk), ", Dv ", std::to_string(a.Dv), ")");
  if (a.Hk <= 0 || a.Hv % a.Hk != 0) fail(op, ": value heads must be a multiple of key heads");
  const long long conv_dim = 2LL * a.Hk * a.Dk + static_cast<long long>(a.Hv) * a.Dv;
  if (a.ldp % 4 != 0 || a.ldp < conv_dim + static_cast<long long>(a.Hv) * a.Dv + 2 * a.Hv)
    fail(op, ": proj row stride ", std::to_string(a.ldp), " must be a multiple of 4 covering q|k|v|z|b|a");
  if (!a.proj || !a.conv_w || !a.ring || !a.dt_bias || !a.neg_A || !a.q || !a.k || !a.v || !a.beta || !a.decay)
    fail(op, ": missing input or output pointer");
  for (const void* p : {static_cast<const void*>(a.proj), static_cast<const void*>(a.conv_w), static_cast<const void*>(a.ring),
                        static_cast<const void*>(a.q), static_cast<const void*>(a.k), static_cast<const void*>(a.v)})
    if (!aligned16(p)) fail(op, ": proj, conv_w, ring, q, k and v must be 16-byte aligned");
  const int runs = (a.T + kRun - 1) / kRun;
  launch(op, gated_delta_conv_prefill_kernel, dim3((runs + kWarps - 1) / kWarps, 2 * a.Hk + a.Hv), dim3(kWarps * 32), 0, stream, a);
}

}  // namespace lily::cuda
