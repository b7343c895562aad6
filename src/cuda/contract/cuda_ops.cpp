#include "contract/cuda_ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention/attention_decode.h"
#include "attention/attention_decode_tc.h"
#include "attention/attention_prefill.h"
#include "bf16.h"
#include "common/cuda_check.h"
#include "common/device_buffer.h"
#include "gated_delta/gated_delta_chunked_prefill.h"
#include "gated_delta/gated_delta_conv_prefill.h"
#include "gated_delta/gated_delta_decode.h"
#include "gated_delta/gated_delta_scan_prefill.h"
#include "gated_delta/gated_rmsnorm_prefill.h"
#include "moe/moe_experts_decode.h"
#include "moe/moe_router_decode.h"
#include "norm/embedding_prefill.h"
#include "norm/rmsnorm_prefill.h"
#include "qmatmul/qmatmul_decode.h"
#include "qmatmul/qmatmul_prefill.h"
#include "step/cuda_weights.h"
#include "step/prefill_step.h"

namespace lily::cuda_ops {
namespace {

using cuda::DeviceBuffer;
using cuda::QMat;
using cuda::check;

// n values of host `src` in a fresh device buffer.
template <typename T>
DeviceBuffer upload(const T* src, size_t n, const char* what) {
  DeviceBuffer d(std::max<size_t>(n, 1) * sizeof(T), what);
  if (n) check(cudaMemcpy(d.as<T>(), src, n * sizeof(T), cudaMemcpyHostToDevice), what);
  return d;
}

// A device output of n values, every byte 0xff: NaN as float, so what a kernel leaves
// unwritten shows.
template <typename T>
DeviceBuffer poisoned(size_t n, const char* what) {
  DeviceBuffer d(std::max<size_t>(n, 1) * sizeof(T), what);
  check(cudaMemset(d.as<void>(), 0xff, d.bytes()), what);
  return d;
}

template <typename T>
void download(const DeviceBuffer& d, T* dst, size_t n, const char* what) {
  check(cudaDeviceSynchronize(), what);
  if (n) check(cudaMemcpy(dst, d.as<T>(), n * sizeof(T), cudaMemcpyDeviceToHost), what);
}

void need(bool ok, const char* op, const char* what) {
  if (!ok) fail(op, " (cuda): ", what);
}

}  // namespace

void rmsnorm(const ops::RmsNorm& a) {
  need(a.dim % 4 == 0, "rmsnorm", "dim must be a multiple of 4");
  const size_t n = static_cast<size_t>(a.rows) * a.dim;
  DeviceBuffer x = upload(a.x, n, "rmsnorm x"), w = upload(a.w, a.dim, "rmsnorm w");
  DeviceBuffer xb = poisoned<uint16_t>(n, "rmsnorm bf16 out"), y = poisoned<float>(n, "rmsnorm out");
  if (a.rows)
    cuda::rmsnorm_prefill(x.as<float>(), w.as<float>(), static_cast<int>(a.rows), static_cast<int>(a.dim), a.eps,
                          xb.as<uint16_t>(), y.as<float>(), nullptr);
  download(y, a.y, n, "rmsnorm");
}

void gated_rmsnorm(const ops::GatedRmsNorm& a) {
  need(a.dim % 16 == 0 && a.dim <= 128, "gated_rmsnorm", "dim must be a multiple of 16 up to 128");
  const size_t n = static_cast<size_t>(a.rows) * a.dim;
  DeviceBuffer o = upload(a.x, n, "gated_rmsnorm x"), z = upload(a.z, n, "gated_rmsnorm z");
  DeviceBuffer w = upload(a.w, a.dim, "gated_rmsnorm w"), out = poisoned<uint16_t>(n, "gated_rmsnorm out");
  cuda::GdnGatedNormArgs g;
  g.o = o.as<float>();
  g.z = z.as<float>();
  g.ldz = static_cast<int>(a.dim);  // one row of dim a "token" of one head
  g.w = w.as<float>();
  g.eps = a.eps;
  g.out = out.as<uint16_t>();
  g.T = static_cast<int>(a.rows);
  g.Hv = 1;
  g.Dv = static_cast<int>(a.dim);
  if (a.rows) cuda::gated_rmsnorm_prefill(g, nullptr);
  std::vector<uint16_t> bits(n);
  download(out, bits.data(), n, "gated_rmsnorm");
  for (size_t i = 0; i < n; ++i) a.y[i] = bf16_to_float(bits[i]);
}

// Calls f(reference index, kernel index) for every element of a [Hv, Dk, Dv] state.
template <typename F>
void for_state(int Hv, int Dk, int Dv, F f) {
  for (int h = 0; h < Hv; ++h)
    for (int k = 0; k < Dk; ++k)
      for (int v = 0; v < Dv; ++v)
        f((static_cast<size_t>(h) * Dk + k) * Dv + v, cuda::gated_delta_state_index(Hv, Dk, Dv, h, k, v));
}

void gated_delta(const ops::GatedDelta& a, bool chunked) {
  const int T = static_cast<int>(a.T), Hk = static_cast<int>(a.Hk), Hv = static_cast<int>(a.Hv);
  const int Dk = static_cast<int>(a.Dk), Dv = static_cast<int>(a.Dv);
  need(Dk % 16 == 0 && Dk <= 128 && Dv % 16 == 0 && Dv <= 128, "gated_delta",
       "Dk and Dv must be multiples of 16 up to 128");
  need(Hk > 0 && Hv % Hk == 0, "gated_delta", "value heads must be a multiple of key heads");
  const size_t nq = static_cast<size_t>(T) * Hk * Dk, nv = static_cast<size_t>(T) * Hv * Dv;
  const size_t ng = static_cast<size_t>(T) * Hv, ns = static_cast<size_t>(Hv) * Dk * Dv;
  // The kernels take the decay itself, and the state in gated_delta_decode's layout.
  std::vector<float> decay(ng), state(ns);
  for (size_t i = 0; i < ng; ++i) decay[i] = std::exp(a.g[i]);
  for_state(Hv, Dk, Dv, [&](size_t ref, size_t dev) { state[dev] = a.state[ref]; });
  DeviceBuffer q = upload(a.q, nq, "gated_delta q"), k = upload(a.k, nq, "gated_delta k");
  DeviceBuffer v = upload(a.v, nv, "gated_delta v"), beta = upload(a.beta, ng, "gated_delta beta");
  DeviceBuffer dec = upload(decay.data(), ng, "gated_delta decay"), s = upload(state.data(), ns, "gated_delta state");
  DeviceBuffer o = poisoned<float>(nv, "gated_delta o");
  cuda::GdnChunkedPrefillArgs g;
  g.q = q.as<float>();
  g.k = k.as<float>();
  g.v = v.as<float>();
  g.beta = beta.as<float>();
  g.decay = dec.as<float>();
  g.state = s.as<float>();
  g.o = o.as<float>();
  g.T = T, g.Hk = Hk, g.Hv = Hv, g.Dk = Dk, g.Dv = Dv;
  DeviceBuffer scratch;
  if (T > 0 && chunked) {
    g.scratch_bytes = cuda::gated_delta_chunked_prefill_scratch_bytes(T, Hv, Dk, Dv);
    scratch = DeviceBuffer(g.scratch_bytes, "gated_delta chunk scratch");
    g.scratch = scratch.as<void>();
    cuda::gated_delta_chunked_prefill(g, nullptr);
  } else if (T > 0) {
    cuda::gated_delta_scan_prefill(g, nullptr);
  }
  download(o, a.o, nv, "gated_delta o");
  download(s, state.data(), ns, "gated_delta state");
  for_state(Hv, Dk, Dv, [&](size_t ref, size_t dev) { a.state[ref] = state[dev]; });
}

// gated_delta_step's inputs as its kernels take them: a projection row per token,
// [C (q | k | v) | Hv Dv (z) | Hv (b) | Hv (a)] at stride ldp (any padding NaN: never read);
// the conv ring, which holds pre-conv rows by position mod kGdnRingRows, with the carried
// state's 3 rows just before the first token's position kFirst (so the positions wrap the
// ring); -exp(A_log); the state in the kernels' layout.
struct StepInputs {
  static constexpr int R = cuda::kGdnRingRows, kFirst = R - 2;
  static size_t row_of(const ops::GatedDeltaStep& a) { return 2 * a.Hk * a.Dk + 2 * a.Hv * a.Dv + 2 * a.Hv; }
  size_t C, vd, row, ldp, ns;
  std::vector<float> ring, state;
  DeviceBuffer proj, dring, conv_w, norm, dt_bias, neg_A;

  StepInputs(const ops::GatedDeltaStep& a, size_t ldp_)
      : C(2 * a.Hk * a.Dk + a.Hv * a.Dv), vd(a.Hv * a.Dv), row(C + vd + 2 * a.Hv), ldp(ldp_), ns(vd * a.Dk),
        ring(R * C, 0.0f), state(ns) {
    const int Hv = static_cast<int>(a.Hv);
    std::vector<float> p(a.T * ldp, NAN), nA(Hv);
    for (int64_t t = 0; t < a.T; ++t) {
      float* r = p.data() + t * ldp;
      std::copy_n(a.mixed + t * C, C, r);
      std::copy_n(a.z + t * vd, vd, r + C);
      std::copy_n(a.b + t * Hv, Hv, r + C + vd);
      std::copy_n(a.a + t * Hv, Hv, r + C + vd + Hv);
    }
    for (int j = 0; j < 3; ++j) std::copy_n(a.conv_state + j * C, C, ring.data() + ((kFirst - 3 + j) & (R - 1)) * C);
    for (int h = 0; h < Hv; ++h) nA[h] = -std::exp(a.A_log[h]);
    for_state(Hv, static_cast<int>(a.Dk), static_cast<int>(a.Dv), [&](size_t ref, size_t dev) { state[dev] = a.state[ref]; });
    proj = upload(p.data(), p.size(), "gated_delta_step projections");
    dring = upload(ring.data(), ring.size(), "gated_delta_step conv ring");
    conv_w = upload(a.conv_w, C * 4, "gated_delta_step conv_w");
    norm = upload(a.norm, a.Dv, "gated_delta_step norm");
    dt_bias = upload(a.dt_bias, Hv, "gated_delta_step dt_bias");
    neg_A = upload(nA.data(), Hv, "gated_delta_step A");
  }
  // The conv state after the token at position p: the ring's rows of positions p - 2 .. p
  // (the host copy, downloaded first).
  void conv_state_at(int p, float* dst) const {
    for (int j = 0; j < 3; ++j) std::copy_n(ring.data() + ((p - 2 + j) & (R - 1)) * C, C, dst + j * C);
  }
  void download_ring() { download(dring, ring.data(), ring.size(), "gated_delta_step conv ring"); }
};

void gated_delta_step(const ops::GatedDeltaStep& a, int rows_per_launch) {
  const int T = static_cast<int>(a.T), Hv = static_cast<int>(a.Hv), Dk = static_cast<int>(a.Dk), Dv = static_cast<int>(a.Dv);
  need(a.Kc == 4, "gated_delta_step", "the decode kernel's conv has 4 taps");
  need(rows_per_launch >= 1 && rows_per_launch <= cuda::kMaxStepRows, "gated_delta_step", "1 to 4 rows a launch");
  if (T == 0) return;
  StepInputs in(a, StepInputs::row_of(a));  // gated_delta_decode takes consecutive rows
  const size_t ns = in.ns, rows_out = in.vd;
  DeviceBuffer s0 = upload(in.state.data(), ns, "gated_delta_step state"), s1 = poisoned<float>(ns, "gated_delta_step state");
  DeviceBuffer srows = poisoned<float>((cuda::kMaxStepRows - 1) * ns, "gated_delta_step state rows");
  DeviceBuffer out = poisoned<float>(T * rows_out, "gated_delta_step out"), pos(sizeof(int), "gated_delta_step pos");
  cuda::GdnArgs g;
  g.norm_w = in.norm.as<float>(), g.conv_w = in.conv_w.as<float>(), g.ring = in.dring.as<float>();
  g.dt_bias = in.dt_bias.as<float>(), g.neg_A = in.neg_A.as<float>(), g.state_rows = srows.as<float>(), g.pos = pos.as<int>();
  g.Hk = static_cast<int>(a.Hk), g.Hv = Hv, g.Dk = Dk, g.Dv = Dv, g.eps = a.eps;
  DeviceBuffer* cur = &s0;
  DeviceBuffer* next = &s1;
  std::vector<float> kept(cuda::kMaxStepRows * ns);  // a launch's states after each of its tokens
  for (int t = 0; t < T; t += rows_per_launch) {
    const int rows = std::min(rows_per_launch, T - t), at = StepInputs::kFirst + t;
    check(cudaMemcpy(pos.as<int>(), &at, sizeof(int), cudaMemcpyHostToDevice), "gated_delta_step pos");
    g.proj = in.proj.as<float>() + t * in.ldp;
    g.out = out.as<float>() + t * rows_out;
    g.state_in = cur->as<float>();
    g.state_out = next->as<float>();
    cuda::gated_delta_decode(g, nullptr, nullptr, rows);
    std::swap(cur, next);
    if (!a.state_rows) continue;
    // The states after tokens t .. t + rows - 2 (state_rows), then after t + rows - 1 (state_out).
    in.download_ring();
    download(srows, kept.data(), (rows - 1) * ns, "gated_delta_step state rows");
    if (t + rows < T) download(*cur, kept.data() + (rows - 1) * ns, ns, "gated_delta_step state");
    for (int r = 0; r < rows && t + r + 1 < T; ++r) {
      const float* src = kept.data() + r * ns;
      float* dst = a.state_rows + (t + r) * ns;
      for_state(Hv, Dk, Dv, [&](size_t ref, size_t dev) { dst[ref] = src[dev]; });
      in.conv_state_at(at + r, a.conv_rows + (t + r) * 3 * in.C);
    }
  }
  download(out, a.out, T * rows_out, "gated_delta_step out");
  download(*cur, in.state.data(), ns, "gated_delta_step state");
  for_state(Hv, Dk, Dv, [&](size_t ref, size_t dev) { a.state[ref] = in.state[dev]; });
  in.download_ring();
  in.conv_state_at(StepInputs::kFirst + T - 1, a.conv_state);
}

// True when the n values of d from value `from` on are still the poison (every byte 0xff).
template <typename T>
bool still_poisoned(const DeviceBuffer& d, size_t from, size_t n) {
  std::vector<T> h(n);
  check(cudaMemcpy(h.data(), d.as<T>() + from, n * sizeof(T), cudaMemcpyDeviceToHost), "poison check");
  const auto* b = reinterpret_cast<const unsigned char*>(h.data());
  return std::all_of(b, b + n * sizeof(T), [](unsigned char c) { return c == 0xff; });
}

void gated_delta_step_prefill(const ops::GatedDeltaStep& a, bool chunked) {
  const int T = static_cast<int>(a.T), Hk = static_cast<int>(a.Hk), Hv = static_cast<int>(a.Hv);
  const int Dk = static_cast<int>(a.Dk), Dv = static_cast<int>(a.Dv);
  need(a.Kc == 4, "gated_delta_step", "the prefill kernels' conv has 4 taps");
  need(!a.state_rows, "gated_delta_step", "the prefill kernels keep no state per token (keep_rows is the decode routes')");
  if (T == 0) return;
  // Rows padded past the projection, NaN there: the kernels must step by ldp and read a row's columns only.
  StepInputs in(a, (StepInputs::row_of(a) + 4 + 3) / 4 * 4);
  const size_t kd = static_cast<size_t>(Hk) * Dk, vd = in.vd, ns = in.ns;
  // One row past T of every output stays poisoned: a kernel writes the chunk's rows, no more.
  DeviceBuffer q = poisoned<float>((T + 1) * kd, "gated_delta_step q"), k = poisoned<float>((T + 1) * kd, "gated_delta_step k");
  DeviceBuffer v = poisoned<float>((T + 1) * vd, "gated_delta_step v"), o = poisoned<float>((T + 1) * vd, "gated_delta_step o");
  DeviceBuffer beta = poisoned<float>((T + 1) * Hv, "gated_delta_step beta");
  DeviceBuffer decay = poisoned<float>((T + 1) * Hv, "gated_delta_step decay");
  DeviceBuffer out = poisoned<uint16_t>((T + 1) * vd, "gated_delta_step out");
  DeviceBuffer s = upload(in.state.data(), ns, "gated_delta_step state");
  cuda::GdnConvPrefillArgs c;
  c.proj = in.proj.as<float>(), c.ldp = static_cast<int>(in.ldp), c.conv_w = in.conv_w.as<float>();
  c.ring = in.dring.as<float>(), c.dt_bias = in.dt_bias.as<float>(), c.neg_A = in.neg_A.as<float>();
  c.q = q.as<float>(), c.k = k.as<float>(), c.v = v.as<float>(), c.beta = beta.as<float>(), c.decay = decay.as<float>();
  c.T = T, c.pos0 = StepInputs::kFirst, c.Hk = Hk, c.Hv = Hv, c.Dk = Dk, c.Dv = Dv;
  cuda::gated_delta_conv_prefill(c, nullptr);
  cuda::GdnChunkedPrefillArgs g;
  g.q = q.as<float>(), g.k = k.as<float>(), g.v = v.as<float>(), g.beta = beta.as<float>(), g.decay = decay.as<float>();
  g.state = s.as<float>(), g.o = o.as<float>();
  g.T = T, g.Hk = Hk, g.Hv = Hv, g.Dk = Dk, g.Dv = Dv;
  DeviceBuffer scratch;
  if (chunked) {
    g.scratch_bytes = cuda::gated_delta_chunked_prefill_scratch_bytes(T, Hv, Dk, Dv);
    scratch = DeviceBuffer(g.scratch_bytes, "gated_delta_step chunk scratch");
    g.scratch = scratch.as<void>();
    cuda::gated_delta_chunked_prefill(g, nullptr);
  } else {
    cuda::gated_delta_scan_prefill(g, nullptr);
  }
  cuda::GdnGatedNormArgs n;
  n.o = o.as<float>(), n.z = in.proj.as<float>() + in.C, n.ldz = static_cast<int>(in.ldp), n.w = in.norm.as<float>();
  n.eps = a.eps, n.out = out.as<uint16_t>(), n.T = T, n.Hv = Hv, n.Dv = Dv;
  cuda::gated_rmsnorm_prefill(n, nullptr);
  check(cudaGetLastError(), "gated_delta_step prefill");
  const bool tail = still_poisoned<float>(q, T * kd, kd) && still_poisoned<float>(k, T * kd, kd) &&
                    still_poisoned<float>(v, T * vd, vd) && still_poisoned<float>(o, T * vd, vd) &&
                    still_poisoned<float>(beta, T * Hv, Hv) && still_poisoned<float>(decay, T * Hv, Hv) &&
                    still_poisoned<uint16_t>(out, T * vd, vd);
  if (!tail) fail("gated_delta_step (cuda prefill): a kernel wrote past the chunk's ", std::to_string(T), " rows");
  std::vector<uint16_t> bits(T * vd);
  download(out, bits.data(), bits.size(), "gated_delta_step out");
  for (size_t i = 0; i < bits.size(); ++i) a.out[i] = bf16_to_float(bits[i]);
  download(s, in.state.data(), ns, "gated_delta_step state");
  for_state(Hv, Dk, Dv, [&](size_t ref, size_t dev) { a.state[ref] = in.state[dev]; });
  in.download_ring();
  in.conv_state_at(StepInputs::kFirst + T - 1, a.conv_state);
}

void qmatmul(const ops::QMatmul& a, QMatmulRoute route) {
  const int T = static_cast<int>(a.T), N = static_cast<int>(a.w.rows), K = static_cast<int>(a.w.cols);
  const bool tiles = route != QMatmulRoute::Decode;
  need(a.w.experts == 1, "qmatmul", "takes one matrix, not a stack");
  need(!tiles || (a.w.bits == 4 && a.w.group_size == 64 && K % 64 == 0), "qmatmul",
       "tensor-core tiles need 4-bit group-64 weights, K a multiple of 64");
  std::vector<DeviceBuffer> owned;
  const QMat W = cuda::upload_qmat({a.w}, "qmatmul weight", tiles ? cuda::Layout::Tiles : cuda::Layout::Mlx, 0, owned);
  const size_t nx = static_cast<size_t>(T) * K, ny = static_cast<size_t>(T) * N;
  DeviceBuffer y = poisoned<float>(ny, "qmatmul y");
  if (route == QMatmulRoute::Prefill || route == QMatmulRoute::PrefillBf16w || route == QMatmulRoute::PrefillWgmma) {
    std::vector<uint16_t> xb(nx);
    for (size_t i = 0; i < nx; ++i) xb[i] = float_to_bf16(a.x[i]);
    DeviceBuffer x = upload(xb.data(), nx, "qmatmul x");
    cuda::GemmArgs g;
    g.W = W;
    g.x = x.as<uint16_t>();
    g.ldx = K;
    g.M = T;
    g.y = y.as<float>();
    g.ldy = N;
    g.weights_bf16 = route != QMatmulRoute::Prefill;
    g.wgmma = route == QMatmulRoute::PrefillWgmma;
    // Any tile size computes the same sums; the wgmma kernel's large chunks take 128 rows.
    cuda::qmatmul_prefill(g, g.wgmma ? 128 : 64, nullptr);
    download(y, a.y, ny, "qmatmul");
    return;
  }
  DeviceBuffer x = upload(a.x, nx, "qmatmul x");
  const int step = tiles ? cuda::kMaxStepRows : 1;  // rows a launch
  for (int t = 0; t < T; t += step) {
    cuda::XSpec X;
    X.x = x.as<float>() + static_cast<size_t>(t) * K;
    cuda::YSpec Y;
    Y.y = y.as<float>() + static_cast<size_t>(t) * N;
    cuda::qmatmul_decode(W, X, Y, nullptr, nullptr, std::min(step, T - t));
  }
  download(y, a.y, ny, "qmatmul");
}

void embedding(const ops::Embedding& a) {
  const int T = static_cast<int>(a.T), H = static_cast<int>(a.table.cols);
  for (int t = 0; t < T; ++t)  // the gather trusts its ids (the executor checks prompts)
    if (a.ids[t] < 0 || a.ids[t] >= a.table.rows)
      fail("embedding: token id ", std::to_string(a.ids[t]), " at index ", std::to_string(t), " is outside [0, ",
           std::to_string(a.table.rows), ")");
  std::vector<DeviceBuffer> owned;
  const QMat E = cuda::upload_qmat({a.table}, "embedding table", cuda::Layout::Mlx, 0, owned);
  DeviceBuffer ids = upload(a.ids, a.T, "embedding ids");
  DeviceBuffer out = poisoned<float>(static_cast<size_t>(T) * H, "embedding out");
  if (T) cuda::embedding_prefill(E, ids.as<int>(), T, out.as<float>(), nullptr);
  download(out, a.out, static_cast<size_t>(T) * H, "embedding");
}

void gated_attention(const ops::GatedAttention& a, AttentionRoute route, AttentionSplits splits) {
  const int T = static_cast<int>(a.T), pos0 = static_cast<int>(a.pos0), ctx = pos0 + T;
  const int Hq = static_cast<int>(a.Hq), Hkv = static_cast<int>(a.Hkv), D = static_cast<int>(a.D);
  need(D == 64 || D == 128 || D == 256, "gated_attention", "head dim must be 64, 128 or 256");
  need(Hkv > 0 && Hq % Hkv == 0, "gated_attention", "query heads must be a multiple of KV heads");
  if (T == 0) return;
  // The kernels' projection rows: per token [Hq x (D query, D gate) | Hkv x D k | Hkv x D v].
  const size_t row = static_cast<size_t>(2 * Hq + 2 * Hkv) * D, kv = static_cast<size_t>(Hkv) * D;
  std::vector<float> proj(T * row);
  for (int t = 0; t < T; ++t) {
    float* p = proj.data() + t * row;
    std::copy_n(a.qg + t * 2 * Hq * D, 2 * Hq * D, p);
    std::copy_n(a.k + t * kv, kv, p + 2 * Hq * D);
    std::copy_n(a.v + t * kv, kv, p + 2 * Hq * D + kv);
  }
  // The cache rows before pos0 as bf16; the chunk's rows and kSpareRows past it poisoned
  // (0xffff: a bf16 NaN), so a write outside the chunk is seen after the launches.
  constexpr int kSpareRows = 4;
  std::vector<uint16_t> kb((ctx + kSpareRows) * kv, 0xffff), vb((ctx + kSpareRows) * kv, 0xffff);
  for (size_t i = 0; i < pos0 * kv; ++i) kb[i] = float_to_bf16(a.k_cache[i]), vb[i] = float_to_bf16(a.v_cache[i]);
  DeviceBuffer dproj = upload(proj.data(), proj.size(), "gated_attention projections");
  DeviceBuffer kc = upload(kb.data(), kb.size(), "gated_attention k cache");
  DeviceBuffer vc = upload(vb.data(), vb.size(), "gated_attention v cache");
  DeviceBuffer qn = upload(a.q_norm, D, "gated_attention q_norm"), kn = upload(a.k_norm, D, "gated_attention k_norm");
  const std::vector<float> inv_freq = cuda::rope_inv_freq(a.theta, static_cast<int>(a.rotary_dim));
  DeviceBuffer freq = upload(inv_freq.data(), inv_freq.size(), "gated_attention rope");
  const size_t n_out = static_cast<size_t>(T) * Hq * D;
  std::vector<float> out(n_out);

  if (route == AttentionRoute::Prefill || route == AttentionRoute::PrefillMma || route == AttentionRoute::PrefillWgmma) {
    DeviceBuffer ob = poisoned<uint16_t>(n_out, "gated_attention out");
    const size_t scratch_bytes = cuda::attention_prefill_scratch_bytes(T, Hq, D);
    DeviceBuffer scratch(scratch_bytes, "gated_attention scratch");
    const cuda::AttnPrefillArgs p{.proj = dproj.as<float>(), .ldp = static_cast<int>(row), .q_norm = qn.as<float>(),
                                  .k_norm = kn.as<float>(), .inv_freq = freq.as<float>(), .k_cache = kc.as<uint16_t>(),
                                  .v_cache = vc.as<uint16_t>(), .out = ob.as<uint16_t>(), .scratch = scratch.as<void>(),
                                  .scratch_bytes = scratch_bytes, .T = T, .pos0 = pos0, .ctx = ctx, .Hq = Hq, .Hkv = Hkv,
                                  .D = D, .rot_dim = static_cast<int>(a.rotary_dim), .eps = a.eps,
                                  .route = route == AttentionRoute::PrefillMma     ? AttnRoute::Mma
                                           : route == AttentionRoute::PrefillWgmma ? AttnRoute::Wgmma
                                                                                   : AttnRoute::ByHeadDim};
    cuda::attention_prefill(p, nullptr);
    std::vector<uint16_t> bits(n_out);
    download(ob, bits.data(), n_out, "gated_attention out");
    for (size_t i = 0; i < n_out; ++i) out[i] = bf16_to_float(bits[i]);
  } else {
    const int step = route == AttentionRoute::Decode ? 1 : cuda::kMaxStepRows;  // rows a launch
    cuda::AttnArgs d;
    if (splits.max_splits) d.max_splits = splits.max_splits;
    if (splits.min_chunk) d.min_chunk = splits.min_chunk;
    DeviceBuffer partial = poisoned<float>(step * cuda::attention_partial_floats(Hq, Hkv, D, d.max_splits),
                                           "gated_attention splits");
    DeviceBuffer dout = poisoned<float>(n_out, "gated_attention out"), pos(sizeof(int), "gated_attention pos");
    d.q_norm = qn.as<float>(), d.k_norm = kn.as<float>(), d.inv_freq = freq.as<float>();
    d.k_cache = kc.as<uint16_t>(), d.v_cache = vc.as<uint16_t>(), d.partial = partial.as<float>(), d.pos = pos.as<int>();
    d.Hq = Hq, d.Hkv = Hkv, d.D = D, d.rot_dim = static_cast<int>(a.rotary_dim), d.eps = a.eps;
    for (int t = 0; t < T; t += step) {
      const int at = pos0 + t;
      check(cudaMemcpy(pos.as<int>(), &at, sizeof(int), cudaMemcpyHostToDevice), "gated_attention pos");
      d.qkv = dproj.as<float>() + t * row;
      d.out = dout.as<float>() + static_cast<size_t>(t) * Hq * D;
      if (route == AttentionRoute::Decode) cuda::attention_decode(d, nullptr, nullptr);
      else cuda::attention_decode_tc(d, nullptr, nullptr, std::min(step, T - t));
    }
    download(dout, out.data(), n_out, "gated_attention out");
  }
  std::copy(out.begin(), out.end(), a.out);
  download(kc, kb.data(), kb.size(), "gated_attention k cache");
  download(vc, vb.data(), vb.size(), "gated_attention v cache");
  for (size_t i = 0; i < kb.size(); ++i) {
    if (i >= pos0 * kv && i < ctx * kv) continue;  // the chunk's rows
    const bool before = i < pos0 * kv;
    if (kb[i] != (before ? float_to_bf16(a.k_cache[i]) : 0xffff) || vb[i] != (before ? float_to_bf16(a.v_cache[i]) : 0xffff))
      fail("gated_attention (cuda): a kernel wrote cache row ", std::to_string(i / kv), " outside the chunk's rows [",
           std::to_string(pos0), ", ", std::to_string(ctx), ")");
  }
  for (size_t i = pos0 * kv; i < ctx * kv; ++i) a.k_cache[i] = bf16_to_float(kb[i]), a.v_cache[i] = bf16_to_float(vb[i]);
}

void moe_block(const MoeWeights& w, int top_k, bool norm_topk_prob, const float* x, int64_t T64, float* y, MoeRoute route,
               int router_cluster, const MoeSublayer& sub) {
  const int T = static_cast<int>(T64), H = static_cast<int>(w.router.cols), E = static_cast<int>(w.router.rows);
  const int I = static_cast<int>(w.gate_proj.rows), Is = static_cast<int>(w.shared_gate_proj.rows);
  const bool tiles = route != MoeRoute::Decode;
  need(w.gate_proj.experts == E && w.down_proj.experts == E, "moe_block", "the expert stacks must hold the router's experts");
  need(route != MoeRoute::Prefill || (sub.norm && sub.residual), "moe_block",
       "the prefill route runs the block as a layer does: pass norm and residual=True");
  if (T == 0) return;
  // The executor's layouts (cuda_weights.cpp): the router with the shared gate as its last row;
  // per expert I gate rows then I up rows.
  std::vector<DeviceBuffer> owned;
  const QMat router = cuda::upload_qmat({w.router, w.shared_expert_gate}, "moe_block router", cuda::Layout::Mlx, 0, owned);
  std::vector<QWeight> gate_up;
  for (int e = 0; e < E; ++e) {
    gate_up.push_back(w.gate_proj.expert(e));
    gate_up.push_back(w.up_proj.expert(e));
  }
  const cuda::Layout gu = tiles ? cuda::Layout::GateUpTiles : cuda::Layout::Mlx, rows = tiles ? cuda::Layout::Tiles : cuda::Layout::Mlx;
  cuda::MoeExperts m;
  m.gate_up = cuda::upload_qmat(gate_up, "moe_block gate_up", gu, I, owned);
  m.down = cuda::upload_qmat({w.down_proj}, "moe_block down", rows, 0, owned);
  m.shared_gate_up = cuda::upload_qmat({w.shared_gate_proj, w.shared_up_proj}, "moe_block shared gate_up", gu, Is, owned);
  m.shared_down = cuda::upload_qmat({w.shared_down_proj}, "moe_block shared down", rows, 0, owned);
  m.n_experts = E, m.inter = I, m.shared_inter = Is;
  if (route == MoeRoute::Prefill) {
    ModelConfig c;
    c.hidden_size = H, c.num_experts = E, c.num_experts_per_tok = top_k, c.norm_topk_prob = norm_topk_prob;
    c.moe_intermediate_size = I, c.shared_expert_intermediate_size = Is, c.rms_norm_eps = sub.eps;
    const cuda::PrefillOptions opt;  // the executor's defaults
    cuda::PrefillWorkspace ws(c, T, opt, false);
    DeviceBuffer dnorm = upload(sub.norm, H, "moe_block norm");
    cuda::DeviceLayer L;
    L.post_norm = dnorm.as<float>(), L.router = router, L.experts = m;
    check(cudaMemcpy(ws.h, x, static_cast<size_t>(T) * H * sizeof(float), cudaMemcpyHostToDevice), "moe_block x");
    cuda::enqueue_moe_prefill(c, L, ws, opt, T, nullptr);
    check(cudaMemcpy(y, ws.h, static_cast<size_t>(T) * H * sizeof(float), cudaMemcpyDeviceToHost), "moe_block y");
    return;
  }
  const int step = tiles ? cuda::kMaxStepRows : 1;  // tokens a launch
  DeviceBuffer dx = upload(x, static_cast<size_t>(T) * H, "moe_block x");
  DeviceBuffer dnorm = sub.norm ? upload(sub.norm, H, "moe_block norm") : DeviceBuffer();
  DeviceBuffer dy;  // down adds into it: the residual x, or zeros
  if (sub.residual) {
    dy = upload(x, static_cast<size_t>(T) * H, "moe_block y");
  } else {
    dy = DeviceBuffer(static_cast<size_t>(T) * H * sizeof(float), "moe_block y");
    check(cudaMemset(dy.as<void>(), 0, dy.bytes()), "moe_block y");
  }
  DeviceBuffer ids = poisoned<int>(step * top_k, "moe_block ids"), weights = poisoned<float>(step * top_k, "moe_block weights");
  DeviceBuffer gate = poisoned<float>(step, "moe_block shared gate");
  DeviceBuffer act = poisoned<float>(static_cast<size_t>(step) * (top_k * I + Is), "moe_block activations");
  const int cluster = router_cluster ? router_cluster : cuda::kRouterMaxCluster;
  for (int t = 0; t < T; t += step) {
    const int r = std::min(step, T - t);
    cuda::XSpec X;
    X.x = dx.as<float>() + static_cast<size_t>(t) * H;
    if (sub.norm) X.mode = cuda::XMode::RmsNorm, X.w = dnorm.as<float>(), X.eps = sub.eps;
    cuda::moe_router_decode(router, X, E, top_k, norm_topk_prob, {nullptr, ids.as<int>(), weights.as<float>(), gate.as<float>()},
                            nullptr, nullptr, cluster, r);
    cuda::moe_gate_up_decode(m, X, ids.as<int>(), top_k, act.as<float>(), nullptr, nullptr, r);
    cuda::moe_down_decode(m, act.as<float>(), ids.as<int>(), weights.as<float>(), gate.as<float>(), top_k,
                          dy.as<float>() + static_cast<size_t>(t) * H, nullptr, nullptr, nullptr, r);
  }
  download(dy, y, static_cast<size_t>(T) * H, "moe_block y");
}

}  // namespace lily::cuda_ops
