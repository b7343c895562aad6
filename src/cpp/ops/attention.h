// Full attention: the rotary embedding and causal GQA over the cache (docs/ops.md says what
// a contract holds).
#pragma once
#include <cstdint>

namespace lily::ops {

// rope: partial rotary embedding, in place: token t sits at position pos0 + t; dims
// [0, rotary_dim) rotate in NeoX pairs (j, j + rotary_dim/2) by pos * theta^(-2j/rotary_dim),
// the others pass through.
// tolerance rope: cpu 1e-6
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

}  // namespace lily::ops
