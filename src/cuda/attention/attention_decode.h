// Gated full attention for one token (decode), one launch. Grid: KV heads x splits of
// the context; each block serves all G = Hq/Hkv query heads of its KV head, so every K/V
// row is loaded once per block (GQA packing). Per block:
//   q_h = RoPE(RMSNorm(q_h) * q_norm) / sqrt(D) for its G heads; the block holding the
//   current position also normalises/ropes k, and appends k, v (bf16) to the cache;
//   online softmax over its keys. With one split the block writes the output; otherwise
//   a second launch merges the splits by log-sum-exp (one block per query head).
//   out_h = softmax(q_h K^T) V * sigmoid(gate_h)            (gate: the q_proj gate rows)
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace lily::cuda {

struct AttnArgs {
  const float* qkv = nullptr;       // [rows][Hq * 2D (per head: D query, D gate) | Hkv*D k | Hkv*D v]
  const float* q_norm = nullptr;    // [D]
  const float* k_norm = nullptr;    // [D]
  uint16_t* k_cache = nullptr;      // bf16 [ctx][Hkv][D]
  uint16_t* v_cache = nullptr;      // bf16 [ctx][Hkv][D]
  float* partial = nullptr;         // [rows][Hkv][max_splits][G][D + 2] split results
  float* out = nullptr;             // [rows][Hq * D]
  const int* pos = nullptr;         // position of this token (context = pos + 1) is *pos + pos_offset
  int pos_offset = 0;               // the MTP head's rows sit behind the trunk's (step/mtp_step.h)
  const float* inv_freq = nullptr;  // [rot_dim / 2] RoPE inverse frequencies (rope_inv_freq)
  int Hq = 0, Hkv = 0, D = 0, rot_dim = 0;
  float eps = 1e-6f;
  int max_splits = 64;  // blocks per KV head (<= 256; the measured best at 32K-128K: perf-log §6)
  // Keys per split at least (the measured best at 4K: perf-log §12): contexts up to this
  // use one block per KV head.
  int min_chunk = 128;
};

// Floats of one token's qkv row (AttnArgs::qkv).
__host__ __device__ inline int attention_qkv_floats(const AttnArgs& a) { return (2 * a.Hq + 2 * a.Hkv) * a.D; }

// Two launches: the split attention, then the merge (which returns at once for one split).
void attention_decode(const AttnArgs& a, const int* halt, cudaStream_t stream);

size_t attention_partial_floats(int Hq, int Hkv, int D, int max_splits);

// theta^(-2j/rot_dim) for j < rot_dim/2, rounded to fp32 as the references do.
std::vector<float> rope_inv_freq(double theta, int rot_dim);

}  // namespace lily::cuda
