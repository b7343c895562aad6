// gated_delta: the Gated DeltaNet recurrence (contract: src/cpp/ops/gated_delta.h), token by
// token, for decode and short chunks; fp32 throughout. Per value head h (key head
// h / (Hv/Hk)) and value column j of its state S [Dk, Dv]:
//   S *= exp(g_t);  delta = beta_t (v_t[j] - sum_i S[i, j] k_t[i]);  S[:, j] += k_t delta;
//   o_t[j] = sum_i S[i, j] q_t[i]
// A threadgroup owns tpg/4 columns of one head, grid (ceil(Dv / (tpg/4)), Hv). A quad (4
// adjacent lanes) owns a column: lane l holds S[4r + l, j], r < Dk/4, in registers, read
// once at the start and written once at the end, so each dot product over Dk is 4 partial
// sums joined by two simd_shuffle_xor. q_t, k_t (the same for every column) and the gates
// are staged in threadgroup memory TOKENS tokens at a time, two barriers per block.
#include <metal_stdlib>
using namespace metal;

constant constexpr uint TOKENS = 8;  // tokens staged per block: 2 * 8 * 128 floats at Dk 128

// The sum over the 4 lanes of a quad, the same (bit for bit) on each of them.
inline float quad_sum(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  return x + simd_shuffle_xor(x, ushort(2));
}

// NR: state rows a thread holds, Dk <= 4 NR. A compile-time bound lets the compiler unroll
// the row loops and keep s[] in registers; rows past Dk/4 are predicated off. qk: a block's
// q then k, [2][TOKENS][4 NR]; gates: its exp(g) then beta, [2][TOKENS].
template <uint NR>
void gated_delta_scan(device const float* q, device const float* k, device const float* v, device const float* g,
                      device const float* beta, device const float* state_in, device float* state_out,
                      device float* o, uint T, uint Hk, uint Hv, uint Dk, uint Dv, threadgroup float* qk,
                      threadgroup float* gates, uint2 tg, uint tid, uint tpg) {
  constexpr uint LD = 4 * NR;  // a staged row
  threadgroup float* qs = qk;
  threadgroup float* ks = qk + TOKENS * LD;
  threadgroup float* decay = gates;
  threadgroup float* betas = gates + TOKENS;
  const uint h = tg.y, hk = h / (Hv / Hk), lane = tid % 4, rows = Dk / 4;
  const uint j = tg.x * (tpg / 4) + tid / 4;
  const bool active = j < Dv;  // per quad: a column past Dv joins the shuffles and barriers, stores nothing
  const size_t s0 = size_t(h) * Dk * Dv + j;

  float s[NR];
  for (uint r = 0; r < NR; ++r) s[r] = active && r < rows ? state_in[s0 + size_t(4 * r + lane) * Dv] : 0.0f;

  for (uint t0 = 0; t0 < T; t0 += TOKENS) {
    const uint n = min(TOKENS, T - t0);
    for (uint e = tid; e < n * Dk; e += tpg) {  // coalesced: a block's q, k rows of key head hk
      const uint t = e / Dk, i = e % Dk;
      const size_t src = (size_t(t0 + t) * Hk + hk) * Dk + i;
      qs[t * LD + i] = q[src];
      ks[t * LD + i] = k[src];
    }
    if (tid < n) {
      decay[tid] = exp(g[size_t(t0 + tid) * Hv + h]);
      betas[tid] = beta[size_t(t0 + tid) * Hv + h];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint t = 0; t < n; ++t) {
      const float a = decay[t];
      float kv = 0.0f;
      for (uint r = 0; r < NR; ++r)
        if (r < rows) {
          s[r] *= a;
          kv = fma(s[r], ks[t * LD + 4 * r + lane], kv);
        }
      kv = quad_sum(kv);
      const size_t at = (size_t(t0 + t) * Hv + h) * Dv + j;
      const float delta = active ? (v[at] - kv) * betas[t] : 0.0f;
      float out = 0.0f;
      for (uint r = 0; r < NR; ++r)
        if (r < rows) {
          s[r] = fma(ks[t * LD + 4 * r + lane], delta, s[r]);
          out = fma(s[r], qs[t * LD + 4 * r + lane], out);
        }
      out = quad_sum(out);
      if (active && lane == 0) o[at] = out;
    }
    // Every thread is done with this block before the next one overwrites qs, ks and the gates.
    if (t0 + TOKENS < T) threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (uint r = 0; r < NR; ++r)
    if (active && r < rows) state_out[s0 + size_t(4 * r + lane) * Dv] = s[r];
}

// One instance per register budget (metal_ops picks the smallest): Dk <= 32, 64, 128.
kernel void gated_delta_dk32(device const float* q [[buffer(0)]],
                             device const float* k [[buffer(1)]],
                             device const float* v [[buffer(2)]],
                             device const float* g [[buffer(3)]],
                             device const float* beta [[buffer(4)]],
                             device const float* state_in [[buffer(5)]],
                             device float* state_out [[buffer(6)]],
                             device float* o [[buffer(7)]],
                             constant uint& T [[buffer(8)]],
                             constant uint& Hk [[buffer(9)]],
                             constant uint& Hv [[buffer(10)]],
                             constant uint& Dk [[buffer(11)]],
                             constant uint& Dv [[buffer(12)]],
                             uint2 tg [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint tpg [[threads_per_threadgroup]]) {
  threadgroup float qk[2 * TOKENS * 32];
  threadgroup float gates[2 * TOKENS];
  gated_delta_scan<8>(q, k, v, g, beta, state_in, state_out, o, T, Hk, Hv, Dk, Dv, qk, gates, tg, tid, tpg);
}

kernel void gated_delta_dk64(device const float* q [[buffer(0)]],
                             device const float* k [[buffer(1)]],
                             device const float* v [[buffer(2)]],
                             device const float* g [[buffer(3)]],
                             device const float* beta [[buffer(4)]],
                             device const float* state_in [[buffer(5)]],
                             device float* state_out [[buffer(6)]],
                             device float* o [[buffer(7)]],
                             constant uint& T [[buffer(8)]],
                             constant uint& Hk [[buffer(9)]],
                             constant uint& Hv [[buffer(10)]],
                             constant uint& Dk [[buffer(11)]],
                             constant uint& Dv [[buffer(12)]],
                             uint2 tg [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint tpg [[threads_per_threadgroup]]) {
  threadgroup float qk[2 * TOKENS * 64];
  threadgroup float gates[2 * TOKENS];
  gated_delta_scan<16>(q, k, v, g, beta, state_in, state_out, o, T, Hk, Hv, Dk, Dv, qk, gates, tg, tid, tpg);
}

kernel void gated_delta_dk128(device const float* q [[buffer(0)]],
                              device const float* k [[buffer(1)]],
                              device const float* v [[buffer(2)]],
                              device const float* g [[buffer(3)]],
                              device const float* beta [[buffer(4)]],
                              device const float* state_in [[buffer(5)]],
                              device float* state_out [[buffer(6)]],
                              device float* o [[buffer(7)]],
                              constant uint& T [[buffer(8)]],
                              constant uint& Hk [[buffer(9)]],
                              constant uint& Hv [[buffer(10)]],
                              constant uint& Dk [[buffer(11)]],
                              constant uint& Dv [[buffer(12)]],
                              uint2 tg [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint tpg [[threads_per_threadgroup]]) {
  threadgroup float qk[2 * TOKENS * 128];
  threadgroup float gates[2 * TOKENS];
  gated_delta_scan<32>(q, k, v, g, beta, state_in, state_out, o, T, Hk, Hv, Dk, Dv, qk, gates, tg, tid, tpg);
}
