#include "head/sampler.h"

#include "head/token_select.cuh"

namespace lily::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kBins = 4096;  // 12-bit radix digits

// Order-preserving map of a float to an unsigned key.
__device__ __forceinline__ unsigned order_key(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

// Inclusive prefix sum of x[0..n) in place (n <= 4 * kThreads); `warp_tot` holds 32 floats.
__device__ void block_scan(float* x, int n, float* warp_tot) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, base = threadIdx.x * 4;
  float v[4], run = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = base + i < n ? x[base + i] : 0.0f;
    run += v[i];
    v[i] = run;
  }
  float incl = run;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    float t = warp_tot[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float u = __shfl_up_sync(0xffffffffu, t, o);
      if (lane >= o) t += u;
    }
    warp_tot[lane] = t;
  }
  __syncthreads();
  const float offset = (warp > 0 ? warp_tot[warp - 1] : 0.0f) + incl - run;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (base + i < n) x[base + i] = v[i] + offset;
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* logits, int V, const DecodeCtl* ctl_ptr, TokenSink sink, const int* halt) {
  extern __shared__ unsigned char smem_raw[];
  unsigned* hist = reinterpret_cast<unsigned*>(smem_raw);          // [kBins]
  float* cv = reinterpret_cast<float*>(hist + kBins);              // [kSampleCap] candidate logits, then probabilities
  int* ci = reinterpret_cast<int*>(cv + kSampleCap);               // [kSampleCap] candidate ids
  __shared__ float warp_tot[32];
  __shared__ unsigned s_prefix, s_above, s_count;
  __shared__ int s_first, s_keep;

  if (wait_halted(halt)) return;
  const DecodeCtl c = *ctl_ptr;
  const int tid = threadIdx.x;
  const int Vl = c.vocab_limit > 0 ? min(c.vocab_limit, V) : V;
  const int kk = c.top_k > 0 ? min(c.top_k, Vl) : Vl;
  const unsigned need = min(kk, kSampleCap);
  auto value = [&](int i) { return penalized(logits[i], i, c, sink.counts, sink.seen); };

  // Radix select: the smallest key threshold T with count(key >= T) >= need, refined
  // digit by digit (12, 12, 8 bits) until that count fits kSampleCap.
  if (tid == 0) { s_prefix = 0; s_above = 0; }
  unsigned threshold = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const int bits = pass < 2 ? 12 : 8, shift = 32 - 12 * pass - bits, nb = 1 << bits;
    for (int b = tid; b < nb; b += kThreads) hist[b] = 0;
    __syncthreads();
    const unsigned prefix = s_prefix, above = s_above;
    for (int i = tid; i < Vl; i += kThreads) {
      const unsigned k = order_key(value(i));
      if (pass == 0 || (k >> (shift + bits)) == prefix) atomicAdd(&hist[(k >> shift) & (nb - 1)], 1u);
    }
    __syncthreads();
    // cv[i] = count of bins >= nb-1-i (a prefix sum over the bins from the top).
    for (int b = tid; b < nb; b += kThreads) cv[b] = static_cast<float>(hist[nb - 1 - b]);
    if (tid == 0) s_first = nb - 1;
    __syncthreads();
    block_scan(cv, nb, warp_tot);
    for (int i = tid; i < nb; i += kThreads)
      if (above + cv[i] >= need) atomicMin(&s_first, i);
    __syncthreads();
    const int i = s_first, bin = nb - 1 - i;
    const unsigned count = above + static_cast<unsigned>(cv[i]);
    const unsigned base = pass == 0 ? 0u : prefix << (shift + bits);
    threshold = base | (static_cast<unsigned>(bin) << shift);
    __syncthreads();
    if (count <= kSampleCap || pass == 2) break;
    if (tid == 0) {
      s_above = above + (i > 0 ? static_cast<unsigned>(cv[i - 1]) : 0u);
      s_prefix = (prefix << bits) | bin;
    }
    __syncthreads();
  }

  // Collect the candidates, keys above the threshold first (so ties at the threshold
  // are the only ones that can miss the cap), then sort them: value desc, id asc.
  if (tid == 0) s_count = 0;
  __syncthreads();
  for (int phase = 0; phase < 2; ++phase) {
    for (int i = tid; i < Vl; i += kThreads) {
      const float v = value(i);
      const unsigned k = order_key(v);
      if (phase == 0 ? k > threshold : k == threshold) {
        const unsigned at = atomicAdd(&s_count, 1u);
        if (at < kSampleCap) { cv[at] = v; ci[at] = i; }
      }
    }
    __syncthreads();
  }
  const int n = min(s_count, static_cast<unsigned>(kSampleCap));
  int P = 1;
  while (P < n) P <<= 1;
  for (int i = n + tid; i < P; i += kThreads) { cv[i] = -FLT_MAX; ci[i] = 0x7fffffff; }
  __syncthreads();
  for (int k = 2; k <= P; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = tid; i < P; i += kThreads) {
        const int o = i ^ j;
        if (o > i) {
          const bool first_better = better(cv[i], ci[i], cv[o], ci[o]);
          if (((i & k) == 0) != first_better) {
            const float tv = cv[i]; cv[i] = cv[o]; cv[o] = tv;
            const int ti = ci[i]; ci[i] = ci[o]; ci[o] = ti;
          }
        }
      }
      __syncthreads();
    }

  // Softmax over the first m candidates, cumulative mass, top-p / min-p cut, draw.
  const int m = min(n, static_cast<int>(need));
  const float top = cv[0], inv_t = 1.0f / c.temperature;
  __syncthreads();
  for (int i = tid; i < m; i += kThreads) cv[i] = __expf((cv[i] - top) * inv_t);  // p_i / p_0
  __syncthreads();
  if (tid == 0) { s_first = m; s_keep = m; }
  __syncthreads();
  if (c.min_p > 0.0f)
    for (int i = tid; i < m; i += kThreads)
      if (i >= 1 && cv[i] < c.min_p) atomicMin(&s_keep, i);
  __syncthreads();
  block_scan(cv, m, warp_tot);
  const float total = cv[m - 1];
  if (c.top_p < 1.0f)
    for (int i = tid; i < m; i += kThreads)
      if (cv[i] >= c.top_p * total) atomicMin(&s_first, i + 1);
  __syncthreads();
  const int keep = max(1, min(s_first, s_keep));
  const float u = uniform01(c.seed, c.n_generated, -1) * cv[keep - 1];
  if (tid == 0) s_first = keep - 1;
  __syncthreads();
  for (int i = tid; i < keep; i += kThreads)
    if (cv[i] > u) atomicMin(&s_first, i);
  __syncthreads();
  if (tid == 0) emit_token(ci[s_first], sink);
  timeline_done();
}

}  // namespace

void sample_topk(const float* logits, int vocab, const DecodeCtl* ctl, const TokenSink& sink, const int* halt,
                 cudaStream_t stream) {
  const size_t smem = kBins * 4 + kSampleCap * 8;
  allow_dynamic_smem(reinterpret_cast<const void*>(sample_kernel), 64 * 1024, "sample_topk: set smem");
  launch("sample_topk", sample_kernel, dim3(1), dim3(kThreads), smem, stream, logits, vocab, ctl, sink, halt);
}

}  // namespace lily::cuda
