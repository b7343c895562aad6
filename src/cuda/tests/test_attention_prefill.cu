// Prefill attention (prep + flash attention + split merge) against fp64 references: the
// cache rows it appends, the gated bf16 outputs (head dims 64/128/256, GQA groups 1, 2, 3, 8, 16,
// token counts off the tile sizes, fresh and pre-filled caches, a 40K context), chunked
// calls, and decode continuing after prefill on the same cache; then the same for the
// wgmma flash kernel (AttnRoute::Wgmma, D = 256) and its refusal of other head dims.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "attention/attention_decode.h"
#include "attention/attention_prefill.h"
#include "test_util.h"

namespace lily::cuda::test {
namespace {

struct Shape {
  int Hq, Hkv, D;
};

// f(0 .. n-1) on every host core: the long-context reference is ~20 GFLOP.
template <typename F>
void parallel_for(int n, const F& f) {
  const int workers = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 64u));
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&] {
      for (int i; (i = next.fetch_add(1)) < n;) f(i);
    });
  for (auto& th : pool) th.join();
}

// An attention layer's inputs for tokens at positions pos0 .. pos0+T-1 and its cache:
// rows before pos0 random bf16, the rest NaN (never read before written; 3 spare rows
// past the chunk must stay so).
struct Problem {
  Shape s;
  int rot, T, pos0, ctx, ldp;
  std::vector<float> proj, qn, kn, inv_freq;  // proj [T][ldp]
  std::vector<uint16_t> k0, v0;               // initial cache [ctx][Hkv][D]
};

Problem make_problem(Shape s, int T, int pos0, Rng& r) {
  Problem P{s, s.D / 4, T, pos0, pos0 + T + 3, (2 * s.Hq + 2 * s.Hkv) * s.D + 4, {}, {}, {}, {}, {}, {}};
  P.proj = randn(static_cast<size_t>(T) * P.ldp, r);
  P.qn = randn(s.D, r, 0.1);
  P.kn = randn(s.D, r, 0.1);
  for (float& v : P.qn) v += 1;
  for (float& v : P.kn) v += 1;
  P.inv_freq = rope_inv_freq(1e7, P.rot);
  const size_t n = static_cast<size_t>(P.ctx) * s.Hkv * s.D, filled = static_cast<size_t>(pos0) * s.Hkv * s.D;
  P.k0.assign(n, 0xFFFF);
  P.v0.assign(n, 0xFFFF);
  for (size_t i = 0; i < filled; ++i) {
    P.k0[i] = float_to_bf16(static_cast<float>(2 * r.sym()));
    P.v0[i] = float_to_bf16(static_cast<float>(2 * r.sym()));
  }
  return P;
}

// Device copies of a Problem, outputs poisoned with NaN.
struct Device {
  float *proj, *qn, *kn, *inv_freq;
  uint16_t *k, *v, *out;
  uint8_t* scratch;
  size_t scratch_bytes;

  explicit Device(const Problem& P)
      : proj(to_dev(P.proj)), qn(to_dev(P.qn)), kn(to_dev(P.kn)), inv_freq(to_dev(P.inv_freq)), k(to_dev(P.k0)),
        v(to_dev(P.v0)), out(dev_alloc<uint16_t>(static_cast<size_t>(P.T) * P.s.Hq * P.s.D)),
        scratch_bytes(attention_prefill_scratch_bytes(P.T, P.s.Hq, P.s.D)) {
    scratch = dev_alloc<uint8_t>(scratch_bytes);
  }
  Device(const Device&) = delete;
  ~Device() {
    cudaFree(proj), cudaFree(qn), cudaFree(kn), cudaFree(inv_freq);
    cudaFree(k), cudaFree(v), cudaFree(out), cudaFree(scratch);
  }
  std::vector<uint16_t> cache(const uint16_t* c, const Problem& P) const {
    return from_dev(c, static_cast<size_t>(P.ctx) * P.s.Hkv * P.s.D);
  }
};

// The flash kernel the tests ask for (AttnPrefillArgs::route): ScopedRoute below sets it.
AttnRoute g_route = AttnRoute::ByHeadDim;

// Prefill of tokens t0 .. t0+T-1 of the problem.
void prefill(const Problem& P, const Device& d, int t0, int T) {
  AttnPrefillArgs a;
  a.proj = d.proj + static_cast<size_t>(t0) * P.ldp;
  a.ldp = P.ldp;
  a.q_norm = d.qn;
  a.k_norm = d.kn;
  a.inv_freq = d.inv_freq;
  a.k_cache = d.k;
  a.v_cache = d.v;
  a.out = d.out + static_cast<size_t>(t0) * P.s.Hq * P.s.D;
  a.scratch = d.scratch;
  a.scratch_bytes = d.scratch_bytes;
  a.T = T;
  a.pos0 = P.pos0 + t0;
  a.ctx = P.ctx;
  a.Hq = P.s.Hq, a.Hkv = P.s.Hkv, a.D = P.s.D, a.rot_dim = P.rot, a.eps = 1e-6f;
  a.route = g_route;
  attention_prefill(a, 0);
  CK(cudaGetLastError());
}

// q/k reference: RMSNorm * w, then rotate-half RoPE on the first rot dims (fp32 angle).
std::vector<double> norm_rope(const float* x, const Problem& P, const std::vector<float>& w, int pos) {
  const int D = P.s.D, half = P.rot / 2;
  double ss = 0;
  for (int d = 0; d < D; ++d) ss += double(x[d]) * x[d];
  const double inv = 1 / std::sqrt(ss / D + 1e-6);
  std::vector<double> y(D);
  for (int d = 0; d < D; ++d) y[d] = x[d] * inv * w[d];
  std::vector<double> out(y);
  for (int j = 0; j < half; ++j) {
    const float ang = static_cast<float>(pos) * P.inv_freq[j];
    const double c = std::cos(double(ang)), s = std::sin(double(ang));
    out[j] = y[j] * c - y[j + half] * s;
    out[j + half] = y[j + half] * c + y[j] * s;
  }
  return out;
}

// The cache rows prep must write for token t: K = bf16(norm_rope(k)) (as fp64 before
// rounding), V = v; [Hkv][D] each.
void reference_kv(const Problem& P, int t, std::vector<double>& k, std::vector<double>& v) {
  const int D = P.s.D, Hkv = P.s.Hkv;
  const float* x = &P.proj[static_cast<size_t>(t) * P.ldp + 2 * P.s.Hq * D];
  k.resize(Hkv * D), v.resize(Hkv * D);
  for (int g = 0; g < Hkv; ++g) {
    const auto kr = norm_rope(x + g * D, P, P.kn, P.pos0 + t);
    for (int d = 0; d < D; ++d) {
      k[g * D + d] = kr[d];
      v[g * D + d] = x[(Hkv + g) * D + d];
    }
  }
}

std::vector<float> to_float(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_float(b[i]);
  return f;
}

// Gated attention outputs [t1 - t0][Hq * D] of tokens t0 .. t1-1 over cache values K, V
// [ctx][Hkv][D]; queries rounded to bf16 after the 1/sqrt(D) scale when bf16_q (prefill).
std::vector<double> reference_out(const Problem& P, const std::vector<float>& K, const std::vector<float>& V, int t0,
                                  int t1, bool bf16_q) {
  const int Hq = P.s.Hq, Hkv = P.s.Hkv, D = P.s.D, G = Hq / Hkv;
  std::vector<double> out(static_cast<size_t>(t1 - t0) * Hq * D);
  parallel_for((t1 - t0) * Hq, [&](int job) {
    const int t = t0 + job / Hq, h = job % Hq, g = h / G, n = P.pos0 + t + 1;
    const float* x = &P.proj[static_cast<size_t>(t) * P.ldp];
    std::vector<double> q = norm_rope(x + h * 2 * D, P, P.qn, P.pos0 + t);
    for (double& e : q) e = bf16_q ? bf16r(e / std::sqrt(double(D))) : e / std::sqrt(double(D));
    std::vector<double> s(n), acc(D, 0.0);
    double mx = -1e300, z = 0;
    for (int j = 0; j < n; ++j) {
      const float* k = &K[(static_cast<size_t>(j) * Hkv + g) * D];
      double a0 = 0, a1 = 0, a2 = 0, a3 = 0;  // four chains: the dot product is the reference's hot loop
      for (int d = 0; d < D; d += 4) {
        a0 += q[d] * k[d], a1 += q[d + 1] * k[d + 1], a2 += q[d + 2] * k[d + 2], a3 += q[d + 3] * k[d + 3];
      }
      s[j] = (a0 + a1) + (a2 + a3);
      mx = std::max(mx, s[j]);
    }
    for (int j = 0; j < n; ++j) {
      z += s[j] = std::exp(s[j] - mx);
      const float* v = &V[(static_cast<size_t>(j) * Hkv + g) * D];
      for (int d = 0; d < D; ++d) acc[d] += s[j] * v[d];
    }
    double* o = &out[(static_cast<size_t>(job / Hq) * Hq + h) * D];
    for (int d = 0; d < D; ++d) o[d] = acc[d] / z * sigmoid(x[h * 2 * D + D + d]);
  });
  return out;
}

// bf16 outputs against fp64: max |got - want| / rms(want) after excusing slack * |want|
// (2^-8 = half a bf16 step, the output's own rounding), so what is left is accumulation
// error. NaN (an unwritten output) fails. The kernels round the softmax weights P to
// bf16 for the PV product (as FlashAttention does): relative noise up to 2^-9 per weight,
// whose worst case over 10^6 outputs is heavy-tailed: at T = 1024, D = 256 the H200
// measured 2.3e-2 (mma.sync) and 3.2e-2 (wgmma), hence kOutTol. A misplaced element or a
// skipped key tile errs by O(1); a small systematic error is caught by the RMS bound.
constexpr double kOutTol = 5e-2;

double bf16_err(const std::vector<uint16_t>& got, const std::vector<double>& want, double slack = 0x1p-8) {
  double ss = 0, worst = 0;
  for (double w : want) ss += w * w;
  const double rms = std::sqrt(ss / std::max<size_t>(want.size(), 1)) + 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = bf16_to_float(got[i]);
    if (!std::isfinite(g)) return INFINITY;
    worst = std::max(worst, std::max(0.0, std::fabs(g - want[i]) - slack * std::fabs(want[i])) / rms);
  }
  return worst;
}

// rms(got - want) / rms(want). The output's bf16 rounding alone gives ~2^-9 / sqrt(3) x
// ~0.75 (the step's average position in its binade) = 8.5e-4; with P's rounding the H200
// measured 1.6e-3 to 2.2e-3 on every case of both kernels. A systematic error (a wrong
// scale, a dropped key tile) moves it by far more than the remaining headroom.
constexpr double kOutRmsTol = 3e-3;

double bf16_rms_err(const std::vector<uint16_t>& got, const std::vector<double>& want) {
  double ss = 0, se = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = bf16_to_float(got[i]);
    if (!std::isfinite(g)) return INFINITY;
    ss += want[i] * want[i];
    se += (g - want[i]) * (g - want[i]);
  }
  return std::sqrt(se / (ss + 1e-300));
}

// Distance in bf16 steps between a stored value and the rounded reference (NaN: huge).
double ulps(uint16_t got, double want) {
  if ((got & 0x7f80) == 0x7f80) return 1e9;
  const auto ordered = [](uint16_t b) { return b & 0x8000 ? -int(b & 0x7fff) : int(b & 0x7fff); };
  return std::abs(ordered(got) - ordered(float_to_bf16(static_cast<float>(want))));
}

std::vector<double> as_double(const std::vector<uint16_t>& b) {
  std::vector<double> d(b.size());
  for (size_t i = 0; i < b.size(); ++i) d[i] = bf16_to_float(b[i]);
  return d;
}

// Sets the flash kernel the tests ask for (g_route) for a scope.
class ScopedRoute {
 public:
  explicit ScopedRoute(AttnRoute route) : saved_(g_route) { g_route = route; }
  ScopedRoute(const ScopedRoute&) = delete;
  ~ScopedRoute() { g_route = saved_; }

 private:
  AttnRoute saved_;
};

std::string label(const Problem& P) {
  char s[140];
  const char* route = g_route == AttnRoute::Mma ? "mma" : g_route == AttnRoute::Wgmma ? "wgmma" : "default";
  std::snprintf(s, sizeof s, "attention prefill %s Hq%d Hkv%d D%d, T %d at pos0 %d", route, P.s.Hq, P.s.Hkv, P.s.D,
                P.T, P.pos0);
  return s;
}

// Checks the cache after prefill of all P.T tokens: appended K rows within bf16 rounding
// of the reference relative to their RMS (an ulp count is meaningless for entries near
// zero, where RoPE's cancellation leaves fp32 noise many bf16 steps wide; the largest
// entries, ~4x RMS, sit two bf16 steps of 2^-8 relative from each other: 2.5e-2 of RMS;
// the H200 measured up to 1.6e-2), V rows exact, every other row untouched.
void check_cache(const Problem& P, const std::vector<uint16_t>& K, const std::vector<uint16_t>& V) {
  const size_t row = static_cast<size_t>(P.s.Hkv) * P.s.D, lo = P.pos0 * row, hi = (P.pos0 + P.T) * row;
  double v_ulps = 0;
  std::vector<double> kr, vr, k_want;
  std::vector<float> k_got;
  for (int t = 0; t < P.T; ++t) {
    reference_kv(P, t, kr, vr);
    for (size_t i = 0; i < row; ++i) {
      k_got.push_back(bf16_to_float(K[lo + t * row + i]));
      k_want.push_back(kr[i]);
      v_ulps = std::max(v_ulps, ulps(V[lo + t * row + i], vr[i]));
    }
  }
  report("  appended K rows (relative to RMS)", rel_err(k_got, k_want), 2.5e-2);
  report("  appended V rows (bf16 steps)", v_ulps, 0);
  bool same = true;
  for (size_t i = 0; i < K.size(); ++i)
    if ((i < lo || i >= hi) && (K[i] != P.k0[i] || V[i] != P.v0[i])) same = false;
  expect("  other cache rows untouched", same);
}

void test_prefill(Shape s, int T, int pos0, uint64_t seed) {
  Rng r(seed);
  const Problem P = make_problem(s, T, pos0, r);
  Device d(P);
  prefill(P, d, 0, T);
  const auto K = d.cache(d.k, P), V = d.cache(d.v, P);
  const auto out = from_dev(d.out, static_cast<size_t>(T) * s.Hq * s.D);
  const auto want = reference_out(P, to_float(K), to_float(V), 0, T, true);
  report(label(P) + ": output", bf16_err(out, want), kOutTol);
  report("  output RMS error", bf16_rms_err(out, want), kOutRmsTol);
  check_cache(P, K, V);
}

// Tokens 0 .. split-1, then split .. T-1 (two calls) against one call over all of them.
void test_chunked(Shape s, int T, int pos0, int split, uint64_t seed) {
  Rng r(seed);
  const Problem P = make_problem(s, T, pos0, r);
  Device one(P), two(P);
  prefill(P, one, 0, T);
  prefill(P, two, 0, split);
  prefill(P, two, split, T - split);
  const size_t n = static_cast<size_t>(T) * s.Hq * s.D;
  const auto out1 = from_dev(one.out, n), out2 = from_dev(two.out, n);
  const auto K = two.cache(two.k, P), V = two.cache(two.v, P);
  const std::string name = label(P) + " in calls of " + std::to_string(split) + " + " + std::to_string(T - split);
  report(name + ": output", bf16_err(out2, reference_out(P, to_float(K), to_float(V), 0, T, true)), kOutTol);
  report("  output vs one call (up to one bf16 step excused)", bf16_err(out2, as_double(out1), 0x1p-7), kOutTol);
  expect("  cache identical to one call", K == one.cache(one.k, P) && V == one.cache(one.v, P));
}

// Prefill of tokens 0 .. T-2, then one attention_decode step for token T-1: the cache
// must equal T decode steps bit for bit, and the decode output the fp64 reference.
void test_decode_after(Shape s, int T, int pos0, uint64_t seed) {
  Rng r(seed);
  const Problem P = make_problem(s, T, pos0, r);
  const int D = s.D, Hq = s.Hq;
  Device pre(P), dec(P);
  int* pos = dev_alloc<int>(1);
  const int max_splits = AttnArgs{}.max_splits;  // decode's default routing
  float* partial = dev_alloc<float>(attention_partial_floats(Hq, s.Hkv, D, max_splits));
  float* out = dev_alloc<float>(Hq * D);
  const auto decode = [&](const Device& d, int t) {
    AttnArgs a;
    a.qkv = d.proj + static_cast<size_t>(t) * P.ldp;
    a.q_norm = d.qn, a.k_norm = d.kn, a.inv_freq = d.inv_freq;
    a.k_cache = d.k, a.v_cache = d.v;
    a.partial = partial, a.out = out, a.pos = pos;
    a.Hq = Hq, a.Hkv = s.Hkv, a.D = D, a.rot_dim = P.rot, a.eps = 1e-6f;
    a.max_splits = max_splits;
    const int p = P.pos0 + t;
    CK(cudaMemcpy(pos, &p, 4, cudaMemcpyHostToDevice));
    attention_decode(a, nullptr, 0);
    CK(cudaGetLastError());
  };
  for (int t = 0; t < T; ++t) decode(dec, t);
  prefill(P, pre, 0, T - 1);
  decode(pre, T - 1);
  const auto got = from_dev(out, Hq * D);
  const auto K = pre.cache(pre.k, P), V = pre.cache(pre.v, P);
  const std::string name = label(P) + ": prefill " + std::to_string(T - 1) + " then decode 1";
  expect(name + ": cache equals " + std::to_string(T) + " decode steps bit for bit",
         K == dec.cache(dec.k, P) && V == dec.cache(dec.v, P));

  // Reference over the cache the model should hold: random rows, then bf16(norm_rope(k)), bf16(v).
  std::vector<float> Kr = to_float(P.k0), Vr = to_float(P.v0);
  std::vector<double> kr, vr;
  const size_t row = static_cast<size_t>(s.Hkv) * D;
  for (int t = 0; t < T; ++t) {
    reference_kv(P, t, kr, vr);
    for (size_t i = 0; i < row; ++i) {
      Kr[(P.pos0 + t) * row + i] = static_cast<float>(bf16r(kr[i]));
      Vr[(P.pos0 + t) * row + i] = static_cast<float>(bf16r(vr[i]));
    }
  }
  report("  decode output", rel_err(got, reference_out(P, Kr, Vr, T - 1, T, false)), 2e-3);
  cudaFree(pos), cudaFree(partial), cudaFree(out);
}

}  // namespace

void run_attention_prefill_tests() {
  const Shape small{4, 2, 64}, real{16, 2, 256}, single{8, 1, 128};
  uint64_t seed = 300;
  {
    const ScopedRoute mma(AttnRoute::Mma);  // D = 256 would take the wgmma kernel by default
    for (const Shape& s : {small, real, single})
      for (int pos0 : {0, 1000})
        for (int T : {1, 7, 64, 100, 257}) test_prefill(s, T, pos0, ++seed);
    test_prefill({6, 2, 64}, 100, 1000, ++seed);   // G = 3: 42 tokens, 126 of a block's 128 rows
    test_prefill({2, 2, 64}, 257, 1000, ++seed);   // G = 1: 128 tokens per block
    test_prefill({16, 1, 64}, 100, 1000, ++seed);  // G = 16: 8 tokens per block
    test_prefill(real, 1024, 0, ++seed);           // 128 blocks of 1 .. 16 key tiles, no split
    test_prefill(real, 64, 40000, ++seed);         // long cache: key splits merged by log-sum-exp
    test_chunked(real, 257, 1000, 100, ++seed);
    test_chunked(small, 100, 0, 37, ++seed);
    test_decode_after(real, 101, 1000, ++seed);
    test_decode_after(single, 65, 0, ++seed);
  }
  {
    // The default (D = 64 on mma.sync, D = 256 on wgmma) runs and is right for both head
    // dims; which kernel it picked shows in the registry's times, not here (both kernels
    // accumulate alike: their outputs can be bit for bit the same).
    const ScopedRoute by_head_dim(AttnRoute::ByHeadDim);
    test_prefill(small, 100, 1000, ++seed);
    test_prefill(real, 100, 1000, ++seed);
  }

  // The wgmma kernel (D = 256) on the same comparisons and thresholds.
  const ScopedRoute wgmma(AttnRoute::Wgmma);
  for (int pos0 : {0, 1000})
    for (int T : {1, 7, 37, 64, 100, 257}) test_prefill(real, T, pos0, ++seed);
  test_prefill({2, 2, 256}, 257, 1000, ++seed);   // G = 1: 128 tokens per block
  test_prefill({4, 2, 256}, 100, 1000, ++seed);   // G = 2
  test_prefill({6, 2, 256}, 100, 1000, ++seed);   // G = 3: 126 of a block's 128 rows
  test_prefill({16, 1, 256}, 100, 1000, ++seed);  // G = 16: 8 tokens per block
  test_prefill(real, 1024, 0, ++seed);            // 128 blocks of 1 .. 16 key tiles, no split
  test_prefill(real, 64, 40000, ++seed);          // long cache: key splits merged by log-sum-exp
  test_chunked(real, 257, 1000, 100, ++seed);
  test_decode_after(real, 101, 1000, ++seed);
  std::string refusal;
  try {
    test_prefill(small, 7, 0, ++seed);
  } catch (const std::exception& e) {
    refusal = e.what();
  }
  expect("the wgmma route refuses D = 64, naming LILY_PREFILL_ATTN ('" + refusal + "')",
         refusal.find("LILY_PREFILL_ATTN") != std::string::npos);
}

}  // namespace lily::cuda::test
