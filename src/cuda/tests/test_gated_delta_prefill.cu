// Gated DeltaNet prefill (conv + gates, recurrence, gated norm) against an fp64 reference
// that runs gated_delta_decode's maths token by token, conv ring included: chunk lengths around
// the kernels' tiles (32-token runs and stages, 64-token chunks), chunked prefill
// continuing from an earlier chunk's ring and state, and gated_delta_decode continuing after a
// prefill (the ring and state layouts agree). The recurrence is run by each of its two
// kernels: gated_delta_scan_prefill (sequential) and gated_delta_chunked_prefill (chunked WY form).
// Timings of the kernels at the 35B-A3B shape, T = 4096.
#include <algorithm>
#include <numeric>

#include "gated_delta/gated_delta_chunked_prefill.h"
#include "gated_delta/gated_delta_conv_prefill.h"
#include "gated_delta/gated_delta_decode.h"
#include "gated_delta/gated_rmsnorm_prefill.h"
#include "gated_delta/gated_delta_scan_prefill.h"
#include "test_util.h"

namespace lily::cuda::test {
namespace {

struct Shape {
  int Hk, Hv, Dk, Dv;
  int conv_dim() const { return 2 * Hk * Dk + Hv * Dv; }
  int n_proj() const { return conv_dim() + Hv * Dv + 2 * Hv; }  // q|k|v | z | b | a
  size_t state_size() const { return static_cast<size_t>(Hv) * Dk * Dv; }
};

struct Weights {
  std::vector<float> conv_w, dt_bias, neg_A, norm_w;
};

// Decays of every kind: heads cycle through fast (scale folded every few tokens), slow
// (near 1, never folded) and exactly zero.
Weights random_weights(const Shape& sh, Rng& r) {
  Weights w{randn(static_cast<size_t>(sh.conv_dim()) * 4, r, 0.5), randn(sh.Hv, r, 0.5), std::vector<float>(sh.Hv),
            randn(sh.Dv, r, 0.2)};
  for (int h = 0; h < sh.Hv; ++h)
    w.neg_A[h] = static_cast<float>(h % 4 == 3 ? -1e4 : h % 2 ? -0.01 * (1 + r.uniform()) : -(1 + 15 * r.uniform()));
  for (float& v : w.norm_w) v += 1.0f;
  return w;
}

// The reference: gated_delta_decode's maths in fp64, one token at a time.
struct Ref {
  Shape sh;
  const Weights& w;
  std::vector<double> S;    // [h][k][v]
  std::vector<float> ring;  // [kGdnRingRows][conv_dim] pre-conv rows by position
  // Outputs of the tokens stepped so far: q, k [t][Hk][Dk], v, o [t][Hv][Dv], beta, decay [t][Hv].
  std::vector<double> q, k, v, beta, decay, o;

  void clear_outputs() { q.clear(), k.clear(), v.clear(), beta.clear(), decay.clear(), o.clear(); }

  void step(const float* p, int pos) {
    const int cd = sh.conv_dim(), kd = sh.Hk * sh.Dk;
    std::vector<double> c(cd);
    for (int ch = 0; ch < cd; ++ch) {
      double y = w.conv_w[ch * 4 + 3] * double(p[ch]);
      for (int j = 0; j < 3; ++j) y += w.conv_w[ch * 4 + j] * double(ring[((pos - 3 + j) & (kGdnRingRows - 1)) * cd + ch]);
      c[ch] = silu(y);
    }
    std::copy(p, p + cd, ring.begin() + (pos & (kGdnRingRows - 1)) * cd);
    for (int hk = 0; hk < sh.Hk; ++hk) {
      double sq = 0, sk = 0;
      for (int i = 0; i < sh.Dk; ++i) sq += c[hk * sh.Dk + i] * c[hk * sh.Dk + i], sk += c[kd + hk * sh.Dk + i] * c[kd + hk * sh.Dk + i];
      const double qs = 1 / std::sqrt(sq + 1e-6) / std::sqrt(double(sh.Dk)), ks = 1 / std::sqrt(sk + 1e-6);
      for (int i = 0; i < sh.Dk; ++i) q.push_back(c[hk * sh.Dk + i] * qs);
      for (int i = 0; i < sh.Dk; ++i) k.push_back(c[kd + hk * sh.Dk + i] * ks);
    }
    const double* qt = &q[q.size() - kd];
    const double* kt = &k[k.size() - kd];
    for (int h = 0; h < sh.Hv; ++h) {
      const double* vh = &c[2 * kd + h * sh.Dv];
      v.insert(v.end(), vh, vh + sh.Dv);
      const double b = sigmoid(p[cd + sh.Hv * sh.Dv + h]);
      const double ar = double(p[cd + sh.Hv * sh.Dv + sh.Hv + h]) + w.dt_bias[h];
      const double d = std::exp(w.neg_A[h] * (ar > 20 ? ar : std::log1p(std::exp(ar))));
      beta.push_back(b);
      decay.push_back(d);
      const double* qh = qt + (h / (sh.Hv / sh.Hk)) * sh.Dk;
      const double* kh = kt + (h / (sh.Hv / sh.Hk)) * sh.Dk;
      double* Sh = &S[static_cast<size_t>(h) * sh.Dk * sh.Dv];
      for (int j = 0; j < sh.Dv; ++j) {
        double kv = 0;
        for (int i = 0; i < sh.Dk; ++i) kv += (Sh[i * sh.Dv + j] *= d) * kh[i];
        const double delta = (vh[j] - kv) * b;
        double acc = 0;
        for (int i = 0; i < sh.Dk; ++i) acc += (Sh[i * sh.Dv + j] += kh[i] * delta) * qh[i];
        o.push_back(acc);
      }
    }
  }
};

// Recurrent state [h][k][v] <-> gated_delta_decode's layout.
std::vector<float> to_decode_layout(const Shape& sh, const std::vector<double>& S) {
  std::vector<float> out(sh.state_size());
  for (int h = 0; h < sh.Hv; ++h)
    for (int k = 0; k < sh.Dk; ++k)
      for (int v = 0; v < sh.Dv; ++v)
        out[gated_delta_state_index(sh.Hv, sh.Dk, sh.Dv, h, k, v)] = static_cast<float>(S[(static_cast<size_t>(h) * sh.Dk + k) * sh.Dv + v]);
  return out;
}
std::vector<float> from_decode_layout(const Shape& sh, const std::vector<float>& dev) {
  std::vector<float> out(sh.state_size());
  for (int h = 0; h < sh.Hv; ++h)
    for (int k = 0; k < sh.Dk; ++k)
      for (int v = 0; v < sh.Dv; ++v)
        out[(static_cast<size_t>(h) * sh.Dk + k) * sh.Dv + v] = dev[gated_delta_state_index(sh.Hv, sh.Dk, sh.Dv, h, k, v)];
  return out;
}

// max |got - want| / (|want| + 1e-3 rms): bf16 rounding alone gives <= 2^-8; NaN fails.
double bf16_err(const std::vector<uint16_t>& got, const std::vector<double>& want) {
  double ss = 0, worst = 0;
  for (double w : want) ss += w * w;
  const double floor = 1e-3 * std::sqrt(ss / std::max<size_t>(want.size(), 1)) + 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = bf16_to_float(got[i]);
    if (!std::isfinite(g)) return INFINITY;
    worst = std::max(worst, std::fabs(g - want[i]) / (std::fabs(want[i]) + floor));
  }
  return worst;
}

// Whether `n` values of device memory at p are still the NaN poison (all bytes 0xFF).
template <typename T>
bool untouched(const T* p, size_t n) {
  const auto h = from_dev(p, n);
  return std::all_of(reinterpret_cast<const unsigned char*>(h.data()), reinterpret_cast<const unsigned char*>(h.data() + n),
                     [](unsigned char b) { return b == 0xFF; });
}

enum class Recurrence { Scan, Chunked };

// Prefill of chunks[0], chunks[1], ... tokens from position pos0 (a zero ring at 0, a
// random history otherwise) and a random state, then one gated_delta_decode step; every output
// of every kernel against the reference.
void test_prefill(const Shape& sh, const std::vector<int>& chunks, int pos0, uint64_t seed, Recurrence rec) {
  Rng r(seed);
  const int cd = sh.conv_dim(), np = sh.n_proj(), ldp = (np + 4 + 3) / 4 * 4;  // padded, a multiple of 4
  const int total = std::accumulate(chunks.begin(), chunks.end(), 0), tmax = *std::max_element(chunks.begin(), chunks.end());
  std::vector<float> proj(static_cast<size_t>(total + 1) * ldp, NAN);  // the padding columns must never be read
  for (int t = 0; t <= total; ++t)
    for (int c = 0; c < np; ++c) proj[static_cast<size_t>(t) * ldp + c] = static_cast<float>(r.normal());
  const Weights w = random_weights(sh, r);
  Ref ref{sh, w, {}, std::vector<float>(kGdnRingRows * cd, 0.0f), {}, {}, {}, {}, {}, {}};
  ref.S.resize(sh.state_size());
  for (double& s : ref.S) s = 0.5 * r.normal();
  if (pos0 > 0)
    for (float& x : ref.ring) x = static_cast<float>(r.normal());

  float* d_proj = to_dev(proj);
  float* d_conv_w = to_dev(w.conv_w);
  float* d_dt_bias = to_dev(w.dt_bias);
  float* d_neg_A = to_dev(w.neg_A);
  float* d_norm_w = to_dev(w.norm_w);
  float* d_ring = to_dev(ref.ring);
  float* d_state = to_dev(to_decode_layout(sh, ref.S));
  const size_t kd = static_cast<size_t>(sh.Hk) * sh.Dk, vd = static_cast<size_t>(sh.Hv) * sh.Dv, rows = tmax + 1;
  float *d_q = dev_alloc<float>(rows * kd), *d_k = dev_alloc<float>(rows * kd), *d_v = dev_alloc<float>(rows * vd);
  float *d_beta = dev_alloc<float>(rows * sh.Hv), *d_decay = dev_alloc<float>(rows * sh.Hv), *d_o = dev_alloc<float>(rows * vd);
  uint16_t* d_out = dev_alloc<uint16_t>(rows * vd);
  const size_t scratch_bytes = gated_delta_chunked_prefill_scratch_bytes(tmax, sh.Hv, sh.Dk, sh.Dv);
  float* d_scratch = dev_alloc<float>(scratch_bytes / sizeof(float));

  double conv_err = 0, o_err = 0, norm_err = 0;
  bool tail_ok = true;
  int t0 = 0;
  for (const int T : chunks) {
    // Poison the outputs again: every chunk must write all of its rows, and no more.
    for (float* p : {d_q, d_k}) CK(cudaMemset(p, 0xFF, rows * kd * sizeof(float)));
    for (float* p : {d_v, d_o}) CK(cudaMemset(p, 0xFF, rows * vd * sizeof(float)));
    for (float* p : {d_beta, d_decay}) CK(cudaMemset(p, 0xFF, rows * sh.Hv * sizeof(float)));
    CK(cudaMemset(d_out, 0xFF, rows * vd * sizeof(uint16_t)));
    const float* chunk_proj = d_proj + static_cast<size_t>(t0) * ldp;
    GdnConvPrefillArgs ca;
    ca.proj = chunk_proj, ca.ldp = ldp, ca.conv_w = d_conv_w, ca.ring = d_ring, ca.dt_bias = d_dt_bias, ca.neg_A = d_neg_A;
    ca.q = d_q, ca.k = d_k, ca.v = d_v, ca.beta = d_beta, ca.decay = d_decay;
    ca.T = T, ca.pos0 = pos0 + t0, ca.Hk = sh.Hk, ca.Hv = sh.Hv, ca.Dk = sh.Dk, ca.Dv = sh.Dv;
    gated_delta_conv_prefill(ca, 0);
    if (rec == Recurrence::Scan) {
      GdnScanPrefillArgs sa;
      sa.q = d_q, sa.k = d_k, sa.v = d_v, sa.beta = d_beta, sa.decay = d_decay, sa.state = d_state, sa.o = d_o;
      sa.T = T, sa.Hk = sh.Hk, sa.Hv = sh.Hv, sa.Dk = sh.Dk, sa.Dv = sh.Dv;
      gated_delta_scan_prefill(sa, 0);
    } else {
      GdnChunkedPrefillArgs xa;
      xa.q = d_q, xa.k = d_k, xa.v = d_v, xa.beta = d_beta, xa.decay = d_decay, xa.state = d_state, xa.o = d_o;
      xa.scratch = d_scratch, xa.scratch_bytes = scratch_bytes;
      xa.T = T, xa.Hk = sh.Hk, xa.Hv = sh.Hv, xa.Dk = sh.Dk, xa.Dv = sh.Dv;
      gated_delta_chunked_prefill(xa, 0);
    }
    GdnGatedNormArgs na;
    na.o = d_o, na.z = chunk_proj + cd, na.ldz = ldp, na.w = d_norm_w, na.eps = 1e-6f, na.out = d_out;
    na.T = T, na.Hv = sh.Hv, na.Dv = sh.Dv;
    gated_rmsnorm_prefill(na, 0);
    CK(cudaGetLastError());

    ref.clear_outputs();
    for (int t = 0; t < T; ++t) ref.step(&proj[static_cast<size_t>(t0 + t) * ldp], pos0 + t0 + t);
    conv_err = std::max({conv_err, rel_err(from_dev(d_q, T * kd), ref.q), rel_err(from_dev(d_k, T * kd), ref.k),
                         rel_err(from_dev(d_v, T * vd), ref.v), rel_err(from_dev(d_beta, T * sh.Hv), ref.beta),
                         rel_err(from_dev(d_decay, T * sh.Hv), ref.decay)});
    const auto o = from_dev(d_o, T * vd);
    o_err = std::max(o_err, rel_err(o, ref.o));
    std::vector<double> x;  // the gated norm of the kernel's own o
    for (int t = 0; t < T; ++t) {
      const auto xt = gated_norm(&o[static_cast<size_t>(t) * vd], &proj[static_cast<size_t>(t0 + t) * ldp + cd], sh.Hv,
                                 sh.Dv, w.norm_w);
      x.insert(x.end(), xt.begin(), xt.end());
    }
    norm_err = std::max(norm_err, bf16_err(from_dev(d_out, T * vd), x));
    tail_ok = tail_ok && untouched(d_q + T * kd, kd) && untouched(d_k + T * kd, kd) && untouched(d_v + T * vd, vd) &&
              untouched(d_beta + T * sh.Hv, sh.Hv) && untouched(d_decay + T * sh.Hv, sh.Hv) &&
              untouched(d_o + T * vd, vd) && untouched(d_out + T * vd, vd);
    t0 += T;
  }

  std::string name = std::string(rec == Recurrence::Scan ? "gdn prefill (scan)" : "gdn prefill (chunked)") + " Hk" +
                     std::to_string(sh.Hk) + " Hv" + std::to_string(sh.Hv) + " Dk" + std::to_string(sh.Dk) + " Dv" +
                     std::to_string(sh.Dv) + ", T ";
  for (size_t i = 0; i < chunks.size(); ++i) name += (i ? "+" : "") + std::to_string(chunks[i]);
  name += " from pos " + std::to_string(pos0);
  std::printf("%s\n", name.c_str());
  report("  conv: q, k, v, beta, decay", conv_err, 1e-5);
  report(rec == Recurrence::Scan ? "  scan: o" : "  chunked (3xTF32): o", o_err, 1e-4);
  report("  gated norm (bf16, vs the kernel's o)", norm_err, 1e-2);
  expect("  nothing written past row T", tail_ok);
  report("  state after the chunks", rel_err(from_decode_layout(sh, from_dev(d_state, sh.state_size())), ref.S), 1e-4);
  report("  conv ring after the chunks (exact)", rel_err(from_dev(d_ring, kGdnRingRows * cd), std::vector<double>(ref.ring.begin(), ref.ring.end())), 0);

  // gated_delta_decode continues: token `total` at position pos0 + total.
  GdnArgs da;
  da.proj = d_proj + static_cast<size_t>(total) * ldp;
  da.conv_w = d_conv_w, da.ring = d_ring, da.dt_bias = d_dt_bias, da.neg_A = d_neg_A, da.norm_w = d_norm_w;
  da.state_in = d_state;
  float* d_state2 = dev_alloc<float>(sh.state_size());
  da.state_out = d_state2;
  da.out = dev_alloc<float>(vd);
  int* d_pos = to_dev(std::vector<int>{pos0 + total});
  da.pos = d_pos;
  da.Hk = sh.Hk, da.Hv = sh.Hv, da.Dk = sh.Dk, da.Dv = sh.Dv;
  gated_delta_decode(da, nullptr, 0);
  CK(cudaGetLastError());
  ref.clear_outputs();
  ref.step(&proj[static_cast<size_t>(total) * ldp], pos0 + total);
  const float* z = &proj[static_cast<size_t>(total) * ldp + cd];
  report("  then gated_delta_decode: gated-norm output", rel_err(from_dev(da.out, vd), gated_norm(ref.o.data(), z, sh.Hv, sh.Dv, w.norm_w)),
         1e-4);
  report("  then gated_delta_decode: state", rel_err(from_decode_layout(sh, from_dev(d_state2, sh.state_size())), ref.S), 1e-4);

  for (float* p : {d_proj, d_conv_w, d_dt_bias, d_neg_A, d_norm_w, d_ring, d_state, d_state2, d_q, d_k, d_v, d_beta, d_decay, d_o, da.out,
                   d_scratch})
    cudaFree(p);
  cudaFree(d_out), cudaFree(d_pos);
}

// The kernels at the 35B-A3B shape over one 4096-token chunk (no reference: the outputs
// must only be finite); prints the time per kernel and per token.
void time_prefill() {
  const Shape sh{16, 32, 128, 128};
  const int T = 4096, cd = sh.conv_dim(), ldp = sh.n_proj();
  Rng r(77);
  const Weights w = random_weights(sh, r);
  float* d_proj = to_dev(randn(static_cast<size_t>(T) * ldp, r));
  float* d_conv_w = to_dev(w.conv_w);
  float* d_dt_bias = to_dev(w.dt_bias);
  float* d_neg_A = to_dev(w.neg_A);
  float* d_norm_w = to_dev(w.norm_w);
  float* d_ring = dev_alloc<float>(kGdnRingRows * cd, false);
  float* d_state = dev_alloc<float>(sh.state_size(), false);
  const size_t kd = static_cast<size_t>(sh.Hk) * sh.Dk, vd = static_cast<size_t>(sh.Hv) * sh.Dv;
  float *d_q = dev_alloc<float>(T * kd), *d_k = dev_alloc<float>(T * kd), *d_v = dev_alloc<float>(T * vd);
  float *d_beta = dev_alloc<float>(T * sh.Hv), *d_decay = dev_alloc<float>(T * sh.Hv), *d_o = dev_alloc<float>(T * vd);
  uint16_t* d_out = dev_alloc<uint16_t>(T * vd);
  GdnConvPrefillArgs ca;
  ca.proj = d_proj, ca.ldp = ldp, ca.conv_w = d_conv_w, ca.ring = d_ring, ca.dt_bias = d_dt_bias, ca.neg_A = d_neg_A;
  ca.q = d_q, ca.k = d_k, ca.v = d_v, ca.beta = d_beta, ca.decay = d_decay;
  ca.T = T, ca.Hk = sh.Hk, ca.Hv = sh.Hv, ca.Dk = sh.Dk, ca.Dv = sh.Dv;
  GdnScanPrefillArgs sa;
  sa.q = d_q, sa.k = d_k, sa.v = d_v, sa.beta = d_beta, sa.decay = d_decay, sa.state = d_state, sa.o = d_o;
  sa.T = T, sa.Hk = sh.Hk, sa.Hv = sh.Hv, sa.Dk = sh.Dk, sa.Dv = sh.Dv;
  GdnChunkedPrefillArgs xa;
  xa.q = d_q, xa.k = d_k, xa.v = d_v, xa.beta = d_beta, xa.decay = d_decay, xa.state = d_state, xa.o = d_o;
  xa.scratch_bytes = gated_delta_chunked_prefill_scratch_bytes(T, sh.Hv, sh.Dk, sh.Dv);
  float* d_scratch = dev_alloc<float>(xa.scratch_bytes / sizeof(float), false);
  xa.scratch = d_scratch;
  xa.T = T, xa.Hk = sh.Hk, xa.Hv = sh.Hv, xa.Dk = sh.Dk, xa.Dv = sh.Dv;
  GdnGatedNormArgs na;
  na.o = d_o, na.z = d_proj + cd, na.ldz = ldp, na.w = d_norm_w, na.out = d_out, na.T = T, na.Hv = sh.Hv, na.Dv = sh.Dv;

  cudaEvent_t ev[5];
  for (auto& e : ev) CK(cudaEventCreate(&e));
  float ms[4] = {0, 0, 0, 0};
  const int reps = 5;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
    CK(cudaEventRecord(ev[0]));
    gated_delta_conv_prefill(ca, 0);
    CK(cudaEventRecord(ev[1]));
    gated_delta_scan_prefill(sa, 0);
    CK(cudaEventRecord(ev[2]));
    gated_delta_chunked_prefill(xa, 0);  // the alternative to the scan (it continues from the scan's state)
    CK(cudaEventRecord(ev[3]));
    gated_rmsnorm_prefill(na, 0);
    CK(cudaEventRecord(ev[4]));
    CK(cudaEventSynchronize(ev[4]));
    for (int i = 0; i < 4 && rep > 0; ++i) {
      float t = 0;
      CK(cudaEventElapsedTime(&t, ev[i], ev[i + 1]));
      ms[i] += t / reps;
    }
  }
  const auto o = from_dev(d_o, T * vd);
  expect("gdn prefill timing run: o finite", std::all_of(o.begin(), o.end(), [](float v) { return std::isfinite(v); }));
  const char* names[4] = {"conv + gates", "scan", "chunked", "gated norm"};
  for (int i = 0; i < 4; ++i)
    std::printf("time gdn %-12s Hk16 Hv32 Dk128 Dv128, T %d: %8.1f us (%.3f us/token)\n", names[i], T, ms[i] * 1e3,
                ms[i] * 1e3 / T);
  for (auto& e : ev) cudaEventDestroy(e);
  for (float* p : {d_proj, d_conv_w, d_dt_bias, d_neg_A, d_norm_w, d_ring, d_state, d_q, d_k, d_v, d_beta, d_decay, d_o, d_scratch})
    cudaFree(p);
  cudaFree(d_out);
}

}  // namespace

void run_gated_delta_prefill_tests() {
  const Shape tiny{2, 4, 32, 32}, wide{2, 4, 128, 128}, real{16, 32, 128, 128}, odd{1, 3, 48, 80};
  for (const Recurrence rec : {Recurrence::Scan, Recurrence::Chunked}) {
    int seed = 1;
    for (const Shape& sh : {tiny, wide, real})
      for (const int T : {1, 2, 3, 5, 64, 65, 257})
        for (const int pos0 : {0, 6}) test_prefill(sh, {T}, pos0, seed++, rec);
    test_prefill(tiny, {100, 3, 61}, 0, 100, rec);  // chunked ...
    test_prefill(tiny, {164}, 0, 100, rec);          // ... and the same tokens in one chunk
    test_prefill(real, {100, 3, 61}, 0, 101, rec);
    test_prefill(real, {164}, 0, 101, rec);
    test_prefill(odd, {7, 33, 1}, 2, 102, rec);  // Dk 48 (rows per lane 3), Dv 80 (16-column blocks)
    if (rec == Recurrence::Chunked) test_prefill(real, {4096}, 0, 103, rec);  // the state carried over 64 chunks
  }
  time_prefill();
}

}  // namespace lily::cuda::test
