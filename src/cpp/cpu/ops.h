// The CPU ops: plain fp32 kernels on raw row-major arrays, multithreaded with
// parallel_for. One op per .cpp file beside this header. Shape letters: T tokens,
// H hidden, Hq/Hkv attention heads of D dims, Hk/Hv GDN key/value heads of Dk/Dv dims,
// E experts, K experts per token, I expert width. Every op checks its arguments and
// throws lily::Error naming itself.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "weights.h"

namespace lily::cpu {

// y[T, N] = x[T, Kin] @ W^T with W = scale*q + bias dequantized from w ([N, Kin], one
// matrix of a stack: w.experts == 1). fp32 accumulation; y must not alias x.
void qmatmul(const float* x, int64_t T, const QWeight& w, float* y);

// One product of a batch: y[T, N] = x[T, Kin] @ W^T, as qmatmul.
struct QMatmul {
  const float* x;
  int64_t T;
  QWeight w;
  float* y;
};

// Independent products as one parallel loop over all their row blocks: products each
// too small to split (a decode step's experts) together keep every thread busy. Every
// output equals qmatmul's.
void qmatmul_batch(std::span<const QMatmul> products);

// out[T, H] = rows ids[t] of the quantized table [V, H].
void embedding(const QWeight& table, const int32_t* ids, int64_t T, float* out);

// y = x * rsqrt(mean(x^2) + eps) * w over each row of dim values; y may alias x.
void rmsnorm(const float* x, int64_t rows, int64_t dim, const float* w, float eps, float* y);

// The GDN output norm: y = rmsnorm(x) * w * silu(z), per row of dim; y may alias x.
void gated_rmsnorm(const float* x, const float* z, int64_t rows, int64_t dim, const float* w, float eps, float* y);

// x = x * rsqrt(sum(x^2) + eps) * scale over each row of dim values, in place.
void l2norm(float* x, int64_t rows, int64_t dim, float eps, float scale);

// Partial rotary embedding, in place, on x [T, heads, head_dim]: token t sits at position
// pos0 + t; dims [0, rotary_dim) rotate in NeoX pairs (j, j + rotary_dim/2) by angle
// pos * theta^(-2j/rotary_dim); the other dims pass through.
void rope(float* x, int64_t T, int64_t heads, int64_t head_dim, int64_t rotary_dim, int64_t pos0, double theta);

// Causal depthwise conv over time, then SiLU: y[t, c] = silu(sum_j w[c, j] * x[t-Kc+1+j, c]).
// x, y [T, C] (no aliasing); w [C, Kc], tap Kc-1 multiplies the current token. state
// [Kc-1, C] holds the Kc-1 input rows before x (zeros at sequence start) and is updated to
// the last Kc-1 rows of state ++ x.
void gated_delta_conv(const float* x, int64_t T, int64_t C, const float* w, int64_t Kc, float* state, float* y);

// GDN gates from the a, b projections [T, Hv]: g = -exp(A_log) * softplus(a + dt_bias)
// (log-decay, <= 0) and beta = sigmoid(b), both [T, Hv].
void gated_delta_gates(const float* a, const float* b, int64_t T, int64_t Hv, const float* A_log,
                       const float* dt_bias, float* g, float* beta);

// The gated delta rule, token by token, per value head h (key head h / (Hv/Hk)):
//   S *= exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S += k_t (x) delta;  o_t = S^T q_t
// q, k [T, Hk, Dk] (already normalised and scaled); v, o [T, Hv, Dv]; g, beta [T, Hv];
// state S [Hv, Dk, Dv] fp32, carried in and out.
void gated_delta(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                 int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, float* state, float* o);

// Causal GQA: out[t, h] = softmax_j(scale * q[t, h] . k[j, h']) v[j, h'] over j <= pos0 + t,
// with h' = h / (Hq/Hkv). q, out [T, Hq, D]; k, v [pos0 + T, Hkv, D] (cache incl. this chunk).
void attention(const float* q, const float* k, const float* v, int64_t T, int64_t pos0, int64_t Hq, int64_t Hkv,
               int64_t D, float scale, float* out);

// Router: p = softmax(logits[t]) over E in fp32, the K largest p (ties: lower expert
// first) into experts/weights [T, K], weights divided by their sum when renormalize.
void moe_router(const float* logits, int64_t T, int64_t E, int64_t K, bool renormalize, int32_t* experts,
                float* weights);

// The SwiGLU MLP of one expert: y[T, H] = down(silu(x gate^T) * (x up^T)), gate/up [I, H].
struct MoeExpert {
  const float* x;
  int64_t T;
  QWeight gate, up, down;
  float* y;
};

// Several experts' MLPs at once: their gate and up products in one parallel loop, their
// down products in another. scratch grows to 2 * sum(T * I) floats.
void moe_experts(std::span<const MoeExpert> mlps, std::vector<float>& scratch);

}  // namespace lily::cpu
