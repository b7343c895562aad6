// Expert choice of one token by one warp, shared by the decode router (moe_router.cu),
// the one-launch MoE block (moe_fused.cu) and, for the argmax, the prefill routing.
#pragma once
#include <cfloat>

#include "device_common.cuh"

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

// Bytes of route_topk's shared memory, logits [E + 1] then p [E], rounded up to 16 (what
// a kernel places after them stays 16-byte aligned).
__host__ __device__ constexpr int route_smem_bytes(int E) { return ((2 * E + 1) * 4 + 15) / 16 * 16; }

// Softmax over logits[0..E) and top-k (warp reductions only; k <= 32): ids[j], w[j] for j < k
// (w renormalised over the k when norm_topk, else softmax probabilities), and
// *shared_gate = sigmoid(logits[E]). logits: E + 1 floats of shared memory; p: E floats of
// shared scratch holding exp(l - max), taken experts marked -1.
__device__ inline void route_topk(const float* logits, int E, int k, bool norm_topk, float* p, int* ids, float* w,
                                  float* shared_gate) {
  const int lane = threadIdx.x & 31;
  float m = -FLT_MAX;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, logits[e]);
  m = warp_max(m);
  float z = 0.0f;
  for (int e = lane; e < E; e += 32) z += p[e] = __expf(logits[e] - m);
  z = warp_sum(z);
  float chosen_sum = 0.0f, chosen_p = 0.0f;
  int chosen_i = 0;
  // Each round: the lane's best (key, id), then two warp reductions (redux.sync). A key
  // is p's bits + 1 (p >= 0, so keys order as p does); taken experts (-1) get key 0.
  for (int j = 0; j < k; ++j) {
    unsigned key = 0, id = 0xffffffffu;
    for (int e = lane; e < E; e += 32) {
      const float v = p[e];
      const unsigned ke = v >= 0.0f ? __float_as_uint(v) + 1u : 0u;
      if (ke > key) { key = ke; id = e; }  // ascending e: ties keep the lower id
    }
    const unsigned best = __reduce_max_sync(0xffffffffu, key);
    const unsigned first = __reduce_min_sync(0xffffffffu, key == best ? id : 0xffffffffu);
    const int i = best ? static_cast<int>(first) : 0;  // best == 0: only NaN left (memory-safe garbage)
    const float v = best ? __uint_as_float(best - 1u) : 0.0f;
    if (lane == j) { chosen_p = v; chosen_i = i; }
    if (lane == (i & 31)) p[i] = -1.0f;
    __syncwarp();
    chosen_sum += v;
  }
  if (lane < k) {
    ids[lane] = chosen_i;
    w[lane] = chosen_p / (norm_topk ? chosen_sum : z);
  }
  if (lane == 0) *shared_gate = sigmoidf_(logits[E]);
}

}  // namespace lily::cuda
