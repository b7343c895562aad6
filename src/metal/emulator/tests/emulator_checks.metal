// Test-only kernels for tests/test_metal_emulator.py: each breaks one rule of the MSL subset
// (docs/metal.md) that the emulator must report, except simd_ops, which follows them all.
#include <metal_stdlib>
using namespace metal;

// Lanes below `active` sum their ids; the others return first: a divergent simd_sum.
kernel void divergent_simd_sum(device float* out [[buffer(0)]],
                               constant uint& active [[buffer(1)]],
                               uint lane [[thread_index_in_simdgroup]]) {
  if (lane >= active) return;
  out[lane] = simd_sum(float(lane));
}

// Threads below `active` wait at the barrier; the others return: a divergent barrier.
kernel void divergent_barrier(device float* out [[buffer(0)]],
                              constant uint& active [[buffer(1)]],
                              uint tid [[thread_position_in_threadgroup]]) {
  if (tid >= active) return;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = 1.0f;
}

// out[lane][0..5] = simd_sum, simd_max, broadcast of lane 3, shuffle_xor 1, shuffle_down 1,
// shuffle_up 1 of in[lane], over the lanes of each simdgroup.
kernel void simd_ops(device const float* in [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     uint tid [[thread_position_in_grid]]) {
  const float v = in[tid];
  device float* o = out + size_t(tid) * 6;
  o[0] = simd_sum(v);
  o[1] = simd_max(v);
  o[2] = simd_broadcast(v, 3);
  o[3] = simd_shuffle_xor(v, 1);
  o[4] = simd_shuffle_down(v, 1);
  o[5] = simd_shuffle_up(v, 1);
}

// 36 KiB of threadgroup variables, over the 32 KiB a threadgroup has.
kernel void too_much_threadgroup_memory(device float* out [[buffer(0)]],
                                        uint tid [[thread_position_in_threadgroup]]) {
  threadgroup float a[4096];
  threadgroup float b[5120];
  a[tid] = 1.0f;
  b[tid] = 2.0f;
  out[tid] = a[tid] + b[tid];
}
