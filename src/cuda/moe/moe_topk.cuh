// Expert choice of one token by one warp, shared by the decode router (moe_router_decode.cu)
// and, for the argmax, the prefill routing.
#pragma once
#include <cfloat>

#include "common/device_common.cuh"
#include "common/kernel_types.h"

namespace lily::cuda {

// The warp's largest v with its id i; equal values: the lower id (the CPU reference's rule).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
}

// Bytes of moe_topk's shared memory, logits [E + 1], rounded up to 16 (what a kernel
// places after them stays 16-byte aligned).
__host__ __device__ constexpr int route_smem_bytes(int E) { return ((E + 1) * 4 + 15) / 16 * 16; }

// moe_topk for E <= 32 * EPL: lane l holds p of experts l + 32i in registers and keeps
// the key of its best untaken one, so a round is two warp reductions and a rescan by the
// lane that lost its best.
template <int EPL>
__device__ void moe_topk_lanes(const float* logits, int E, int k, bool norm_topk, int* ids, float* w,
                                 float* shared_gate) {
  const int lane = threadIdx.x & 31;
  float m = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < EPL; ++i)
    if (lane + 32 * i < E) m = fmaxf(m, logits[lane + 32 * i]);
  m = warp_max(m);
  float p[EPL], z = 0.0f;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    p[i] = lane + 32 * i < E ? __expf(logits[lane + 32 * i] - m) : -1.0f;
    if (lane + 32 * i < E) z += p[i];
  }
  z = warp_sum(z);
  // A key is p's bits + 1 (p >= 0, so keys order as p does); taken experts (bit i of
  // taken), NaN and lanes past E (p = -1) get key 0. Ascending i: ties keep the lower id.
  unsigned key, id, taken = 0u;
  auto lane_best = [&] {
    key = 0;
    id = 0xffffffffu;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const unsigned ki = p[i] >= 0.0f && !((taken >> i) & 1u) ? __float_as_uint(p[i]) + 1u : 0u;
      if (ki > key) {
        key = ki;
        id = lane + 32 * i;
      }
    }
  };
  lane_best();
  float chosen_sum = 0.0f, chosen_p = 0.0f;
  int chosen_i = 0;
  for (int j = 0; j < k; ++j) {
    const unsigned best = __reduce_max_sync(0xffffffffu, key);
    const unsigned first = __reduce_min_sync(0xffffffffu, key == best ? id : 0xffffffffu);
    const int i = best ? static_cast<int>(first) : 0;  // best == 0: only NaN left (memory-safe garbage)
    const float v = best ? __uint_as_float(best - 1u) : 0.0f;
    if (lane == j) {
      chosen_p = v;
      chosen_i = i;
    }
    if (best && lane == (i & 31)) {
      taken |= 1u << (i >> 5);
      lane_best();
    }
    chosen_sum += v;
  }
  if (lane < k) {
    ids[lane] = chosen_i;
    w[lane] = chosen_p / (norm_topk ? chosen_sum : z);
  }
  if (lane == 0) *shared_gate = sigmoidf_(logits[E]);
}

// Softmax over logits[0..E) and top-k by one warp (E <= kMoeMaxExperts, k <= 32):
// ids[j], w[j] for j < k (w renormalised over the k when norm_topk, else softmax
// probabilities), and *shared_gate = sigmoid(logits[E]). logits: E + 1 floats of shared
// memory. Ties go to the lower id (the CPU reference's rule).
static_assert(kMoeMaxExperts <= 32 * 32, "moe_topk_lanes marks a lane's taken experts in 32 bits");
__device__ inline void moe_topk(const float* logits, int E, int k, bool norm_topk, int* ids, float* w,
                                  float* shared_gate) {
  if (E <= 256) moe_topk_lanes<8>(logits, E, k, norm_topk, ids, w, shared_gate);
  else moe_topk_lanes<kMoeMaxExperts / 32>(logits, E, k, norm_topk, ids, w, shared_gate);
}

}  // namespace lily::cuda
