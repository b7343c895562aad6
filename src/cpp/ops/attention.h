// Full attention: the rotary embedding and causal GQA over the cache (docs/ops.md says what
// a contract holds).
#pragma once
#include <cstdint>

namespace lily::ops {

// rope: partial rotary embedding, in place: token t sits at position pos0 + t; dims
// [0, rotary_dim) rotate in NeoX pairs (j, j + rotary_dim/2) by pos * theta^(-2j/rotary_dim),
// the others pass through.
// tolerance rope: cpu 1e-6, metal-emulator 1e-6
struct Rope {
  float* x = nullptr;  // [T, heads, head_dim]
  int64_t T = 0, heads = 0, head_dim = 0, rotary_dim = 0, pos0 = 0;
  double theta = 1e7;
};

// attention, causal GQA: out[t, h] = softmax_j(scale q[t, h] . k[j, h']) v[j, h'] over j <= pos0 + t,
// h' = h / (Hq/Hkv); k, v hold the cache including this chunk.
// tolerance attention: cpu 2e-6, metal-emulator 1e-6
struct Attention {
  const float* q = nullptr;  // [T, Hq, D]
  const float* k = nullptr;  // [pos0 + T, Hkv, D]
  const float* v = nullptr;  // [pos0 + T, Hkv, D]
  int64_t T = 0, pos0 = 0, Hq = 0, Hkv = 0, D = 0;
  float scale = 1.0f;
  float* out = nullptr;      // [T, Hq, D]
};

// gated_attention, the attention mixer between its projections (MODEL.md §4.4): per head
// q = rope(rmsnorm(q) q_norm), k = rope(rmsnorm(k) k_norm) at positions pos0 + t, k and v
// appended to the cache, out = attention(q, cache, D^-1/2) * sigmoid(gate). CUDA keeps the
// cache in bf16 and its decode kernels take q and P into the mma as bf16.
// tolerance gated_attention: cpu 2e-6, cuda:decode 6e-3, cuda:decode_tc 8e-3, cuda:prefill 1e-2, cuda:prefill_mma 1e-2, cuda:prefill_wgmma 1e-2, metal-emulator 2e-6
struct GatedAttention {
  const float* qg = nullptr;      // [T, Hq, 2D]: per head D query values, then D gate values
  const float* k = nullptr;       // [T, Hkv, D] before the norm and rope
  const float* v = nullptr;       // [T, Hkv, D]
  const float* q_norm = nullptr;  // [D]
  const float* k_norm = nullptr;  // [D]
  float* k_cache = nullptr;       // [pos0 + T, Hkv, D]: rows < pos0 as earlier calls wrote them; pos0.. written
  float* v_cache = nullptr;       // [pos0 + T, Hkv, D]
  int64_t T = 0, pos0 = 0, Hq = 0, Hkv = 0, D = 0, rotary_dim = 0;
  double theta = 1e7;
  float eps = 1e-6f;
  float* out = nullptr;           // [T, Hq * D]
};

}  // namespace lily::ops
