#include "contract/metal_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cpu/check.h"
#include "emulator/runtime.h"
#include "error.h"

namespace lily::metal_ops {
namespace {

using metal_emu::Size3;

void poison(float* y, size_t n) { std::fill(y, y + n, std::numeric_limits<float>::quiet_NaN()); }

// A buffer argument: the kernels only read what their signature declares const.
template <class T>
void* buf(const T* p) {
  return const_cast<T*>(p);
}

// Threads of a norm's threadgroup: about 4 values a thread, whole simdgroups, at most 1024.
uint32_t norm_threads(int64_t dim) {
  return static_cast<uint32_t>(std::clamp<int64_t>((dim + 4 * 32 - 1) / (4 * 32) * 32, 32, 1024));
}

void need(bool ok, const char* op, const std::string& what) {
  if (!ok) fail(op, " (metal-emulator): ", what);
}

}  // namespace

void rmsnorm(const ops::RmsNorm& a) {
  need(a.dim > 0 && a.dim <= UINT32_MAX && a.rows <= UINT32_MAX, "rmsnorm", "dim must be in [1, 2^32)");
  poison(a.y, static_cast<size_t>(a.rows) * a.dim);
  const uint32_t dim = static_cast<uint32_t>(a.dim);
  void* const b[] = {buf(a.x), buf(a.w), a.y, buf(&dim), buf(&a.eps)};
  if (a.rows) metal_emu::dispatch("rmsnorm", {static_cast<uint32_t>(a.rows)}, {norm_threads(a.dim)}, b);
}

void gated_rmsnorm(const ops::GatedRmsNorm& a) {
  need(a.dim > 0 && a.dim <= UINT32_MAX && a.rows <= UINT32_MAX, "gated_rmsnorm", "dim must be in [1, 2^32)");
  poison(a.y, static_cast<size_t>(a.rows) * a.dim);
  const uint32_t dim = static_cast<uint32_t>(a.dim);
  void* const b[] = {buf(a.x), buf(a.z), buf(a.w), a.y, buf(&dim), buf(&a.eps)};
  if (a.rows) metal_emu::dispatch("gated_rmsnorm", {static_cast<uint32_t>(a.rows)}, {norm_threads(a.dim)}, b);
}

void l2norm(const ops::L2Norm& a) {
  need(a.dim > 0 && a.dim <= UINT32_MAX && a.rows <= UINT32_MAX, "l2norm", "dim must be in [1, 2^32)");
  const uint32_t dim = static_cast<uint32_t>(a.dim);
  const float eps_scale[2] = {a.eps, a.scale};
  void* const b[] = {a.x, a.x, buf(&dim), buf(eps_scale)};  // in place
  if (a.rows) metal_emu::dispatch("l2norm", {static_cast<uint32_t>(a.rows)}, {norm_threads(a.dim)}, b);
}

void gated_delta_conv(const ops::GatedDeltaConv& a) {
  need(a.Kc >= 1 && a.Kc <= 8, "gated_delta_conv", "has a kernel for 1 to 8 taps, not " + std::to_string(a.Kc));
  need(a.C > 0 && a.C <= UINT32_MAX && a.T >= 0 && a.T <= UINT32_MAX, "gated_delta_conv", "shape too large");
  need(a.T == 0 || a.x != a.y, "gated_delta_conv", "the output must not alias the input");
  // The kernel reads the state from a copy and writes every element of the poisoned original.
  const size_t n_state = static_cast<size_t>(a.Kc - 1) * a.C;
  const std::vector<float> state_in(a.state, a.state + n_state);
  poison(a.state, n_state);
  poison(a.y, static_cast<size_t>(a.T) * a.C);
  const uint32_t dims[3] = {static_cast<uint32_t>(a.T), static_cast<uint32_t>(a.C), static_cast<uint32_t>(a.Kc)};
  void* const b[] = {buf(a.x), buf(a.w), buf(state_in.data()), a.y, a.state, buf(dims)};
  metal_emu::dispatch("gated_delta_conv", {(dims[1] + 255) / 256}, {256}, b);
}

void gated_delta_gates(const ops::GatedDeltaGates& a) {
  need(a.Hv > 0 && a.T >= 0 && a.T * a.Hv <= UINT32_MAX, "gated_delta_gates", "shape too large");
  const size_t n = static_cast<size_t>(a.T) * a.Hv;
  poison(a.g, n);
  poison(a.beta, n);
  const uint32_t dims[2] = {static_cast<uint32_t>(n), static_cast<uint32_t>(a.Hv)};
  void* const b[] = {buf(a.a), buf(a.b), buf(a.A_log), buf(a.dt_bias), a.g, a.beta, buf(dims)};
  if (n) metal_emu::dispatch("gated_delta_gates", {static_cast<uint32_t>((n + 255) / 256)}, {256}, b);
}

void qmatmul(const ops::QMatmul& a) {
  const QWeight& w = a.w;
  need(w.experts == 1, "qmatmul", "takes one matrix, not a stack");
  need(w.bits == 4 || w.bits == 8, "qmatmul", "has 4- and 8-bit kernels, not " + std::to_string(w.bits) + "-bit");
  need(w.group_size % 32 == 0, "qmatmul", "group size must be a multiple of 32");
  need(w.rows <= UINT32_MAX && w.cols <= UINT32_MAX && a.T <= 65535, "qmatmul", "shape too large");
  poison(a.y, static_cast<size_t>(a.T) * w.rows);
  const uint32_t N = static_cast<uint32_t>(w.rows), K = static_cast<uint32_t>(w.cols);
  const uint32_t gs = static_cast<uint32_t>(w.group_size);
  void* const b[] = {buf(a.x), buf(w.codes), buf(w.scales), buf(w.biases), a.y, buf(&N), buf(&K), buf(&gs)};
  const Size3 groups{(N + 7) / 8, static_cast<uint32_t>(a.T)};  // 8 output rows a threadgroup
  if (a.T && N) metal_emu::dispatch(w.bits == 4 ? "qmatmul_decode_4bit" : "qmatmul_decode_8bit", groups, {64}, b);
}

void embedding(const ops::Embedding& a) {
  const QWeight& t = a.table;
  need(t.bits == 4 || t.bits == 8, "embedding", "has 4- and 8-bit kernels, not " + std::to_string(t.bits) + "-bit");
  need(t.group_size % (32 / t.bits) == 0 && t.cols <= UINT32_MAX && a.T <= 65535, "embedding", "shape unsupported");
  for (int64_t i = 0; i < a.T; ++i)
    if (a.ids[i] < 0 || a.ids[i] >= t.rows)
      fail("embedding (metal-emulator): token id ", std::to_string(a.ids[i]), " at index ", std::to_string(i),
           " is outside [0, ", std::to_string(t.rows), ")");
  poison(a.out, static_cast<size_t>(a.T) * t.cols);
  const uint32_t dims[3] = {static_cast<uint32_t>(t.cols), static_cast<uint32_t>(t.group_size), static_cast<uint32_t>(t.bits)};
  const uint32_t words = static_cast<uint32_t>(t.words_per_row());
  void* const b[] = {buf(a.ids), buf(t.codes), buf(t.scales), buf(t.biases), a.out, buf(dims)};
  if (a.T) metal_emu::dispatch("embedding", {(words + 63) / 64, static_cast<uint32_t>(a.T)}, {64}, b);
}

void rope(const ops::Rope& a) {
  need(a.rotary_dim > 0 && a.rotary_dim % 2 == 0 && a.rotary_dim <= a.head_dim, "rope",
       "rotary_dim must be even and in (0, head_dim]");
  need(a.T >= 0 && a.heads > 0 && a.pos0 >= 0 && a.pos0 + a.T <= (1 << 24) && a.T * a.heads * a.rotary_dim <= UINT32_MAX,
       "rope", "positions up to 2^24 (exact in fp32)");
  std::vector<float> inv_freq(a.rotary_dim / 2);  // as the CPU's: fp32 of the fp64 power
  for (size_t j = 0; j < inv_freq.size(); ++j)
    inv_freq[j] = static_cast<float>(std::pow(a.theta, -2.0 * static_cast<double>(j) / static_cast<double>(a.rotary_dim)));
  const uint32_t dims[4] = {static_cast<uint32_t>(a.T), static_cast<uint32_t>(a.heads), static_cast<uint32_t>(a.head_dim),
                            static_cast<uint32_t>(a.rotary_dim)};
  const uint32_t pos0 = static_cast<uint32_t>(a.pos0), n = dims[0] * dims[1] * dims[3] / 2;
  void* const b[] = {a.x, inv_freq.data(), buf(dims), buf(&pos0)};
  if (n) metal_emu::dispatch("rope", {(n + 255) / 256}, {256}, b);
}

void gated_delta(const ops::GatedDelta& a) {
  need(a.Hk > 0 && a.Hv % a.Hk == 0, "gated_delta", "value heads must be a multiple of key heads");
  need(a.Dk % 4 == 0 && a.Dk >= 4 && a.Dk <= 128, "gated_delta", "Dk must be a multiple of 4 up to 128");
  need(a.Dv > 0 && a.T >= 0 && a.T <= UINT32_MAX && a.Hv <= 65535 && a.Hv * a.Dk * a.Dv <= UINT32_MAX, "gated_delta",
       "shape too large");
  // The kernel reads the state from a copy and writes every element of the poisoned original.
  const size_t n_state = static_cast<size_t>(a.Hv) * a.Dk * a.Dv;
  const std::vector<float> state_in(a.state, a.state + n_state);
  poison(a.state, n_state);
  poison(a.o, static_cast<size_t>(a.T) * a.Hv * a.Dv);
  const uint32_t T = static_cast<uint32_t>(a.T), Hk = static_cast<uint32_t>(a.Hk), Hv = static_cast<uint32_t>(a.Hv);
  const uint32_t Dk = static_cast<uint32_t>(a.Dk), Dv = static_cast<uint32_t>(a.Dv);
  void* const b[] = {buf(a.q), buf(a.k), buf(a.v), buf(a.g), buf(a.beta), buf(state_in.data()), a.state, a.o,
                     buf(&T), buf(&Hk), buf(&Hv), buf(&Dk), buf(&Dv)};
  // A quad per value column, whole simdgroups: 8 to 32 columns (32 to 128 threads) a threadgroup.
  const uint32_t cols = std::clamp<uint32_t>((Dv + 7) / 8 * 8, 8, 32);
  const char* kernel = Dk <= 32 ? "gated_delta_dk32" : Dk <= 64 ? "gated_delta_dk64" : "gated_delta_dk128";
  metal_emu::dispatch(kernel, {(Dv + cols - 1) / cols, Hv}, {4 * cols}, b);
}

void gated_delta_step(const ops::GatedDeltaStep& a) {
  need(!a.state_rows && !a.conv_rows, "gated_delta_step", "keeps no state per token (keep_rows)");
  const int64_t T = a.T, C = 2 * a.Hk * a.Dk + a.Hv * a.Dv, kd = a.Hk * a.Dk, vd = a.Hv * a.Dv;
  std::vector<float> c(T * C), q(T * kd), k(T * kd), v(T * vd), g(T * a.Hv), beta(T * a.Hv), o(T * vd);
  gated_delta_conv({a.mixed, T, C, a.conv_w, a.Kc, a.conv_state, c.data()});
  for (int64_t t = 0; t < T; ++t) {  // the conv's rows split into q | k | v
    const float* row = c.data() + t * C;
    std::copy_n(row, kd, q.data() + t * kd);
    std::copy_n(row + kd, kd, k.data() + t * kd);
    std::copy_n(row + 2 * kd, vd, v.data() + t * vd);
  }
  l2norm({q.data(), T * a.Hk, a.Dk, 1e-6f, 1.0f / std::sqrt(static_cast<float>(a.Dk))});
  l2norm({k.data(), T * a.Hk, a.Dk, 1e-6f, 1.0f});
  gated_delta_gates({a.a, a.b, T, a.Hv, a.A_log, a.dt_bias, g.data(), beta.data()});
  gated_delta({q.data(), k.data(), v.data(), g.data(), beta.data(), T, a.Hk, a.Hv, a.Dk, a.Dv, a.state, o.data()});
  gated_rmsnorm({o.data(), a.z, T * a.Hv, a.Dv, a.norm, a.eps, a.out});
}

void attention(const ops::Attention& a) {
  need(a.Hkv > 0 && a.Hq % a.Hkv == 0 && a.Hq / a.Hkv <= 32, "attention",
       "query heads must be a multiple of KV heads by at most 32 (a simdgroup each)");
  need(a.D % 4 == 0 && a.D >= 4 && a.D <= 256, "attention", "D must be a multiple of 4 up to 256");
  need(a.T >= 0 && a.pos0 >= 0 && (a.pos0 + a.T) * a.Hq * a.D <= UINT32_MAX, "attention", "shape too large");
  poison(a.out, static_cast<size_t>(a.T) * a.Hq * a.D);
  const uint32_t pos0 = static_cast<uint32_t>(a.pos0), Hq = static_cast<uint32_t>(a.Hq);
  const uint32_t Hkv = static_cast<uint32_t>(a.Hkv), D = static_cast<uint32_t>(a.D);
  void* const b[] = {buf(a.q), buf(a.k), buf(a.v), a.out, buf(&pos0), buf(&Hq), buf(&Hkv), buf(&D), buf(&a.scale)};
  const char* kernel = D <= 64 ? "attention_d64" : D <= 128 ? "attention_d128" : "attention_d256";
  // A threadgroup per (token, KV head), a simdgroup per query head of it.
  if (a.T) metal_emu::dispatch(kernel, {static_cast<uint32_t>(a.T), Hkv}, {32 * (Hq / Hkv)}, b);
}

void moe_router(const ops::MoeRouter& a) {
  need(a.E > 0 && a.E <= 512 && a.K > 0 && a.K <= a.E && a.T >= 0 && a.T <= UINT32_MAX, "moe_router",
       "needs 0 < K <= E <= 512");
  poison(a.weights, static_cast<size_t>(a.T) * a.K);
  std::fill(a.experts, a.experts + a.T * a.K, -1);
  const uint32_t E = static_cast<uint32_t>(a.E), K = static_cast<uint32_t>(a.K), renorm = a.renormalize;
  void* const b[] = {buf(a.logits), a.experts, a.weights, buf(&E), buf(&K), buf(&renorm)};
  if (a.T) metal_emu::dispatch("moe_router_topk", {static_cast<uint32_t>(a.T)}, {32}, b);
}

namespace {

// The MLX stacks the expert kernels take: one width; gate and up of one group size.
void check_experts(const char* op, const QWeight& gate, const QWeight& up, const QWeight& down) {
  need(gate.bits == 4 || gate.bits == 8, op, "has 4- and 8-bit expert kernels, not " + std::to_string(gate.bits) + "-bit");
  need(up.bits == gate.bits && down.bits == gate.bits, op, "expert matrices of one width");
  need(up.group_size == gate.group_size && gate.group_size % 32 == 0 && down.group_size % 32 == 0, op,
       "group sizes must be multiples of 32, gate's and up's the same");
  need(gate.rows == up.rows && gate.cols == up.cols && down.cols == gate.rows, op, "gate/up [I, H] and down [H, I]");
}

// act [slots, I] = silu(x gate^T) * (x up^T) for slot s of token s / S, expert ids[s].
void gate_up(const QWeight& gate, const QWeight& up, const float* x, const int32_t* ids, int64_t slots, uint32_t S, float* act) {
  const uint32_t I = static_cast<uint32_t>(gate.rows), H = static_cast<uint32_t>(gate.cols), bits = gate.bits;
  const uint32_t dims[4] = {I, H, static_cast<uint32_t>(gate.group_size), S};
  poison(act, static_cast<size_t>(slots) * I);
  void* const b[] = {buf(x), buf(ids), buf(gate.codes), buf(gate.scales), buf(gate.biases), buf(up.codes),
                     buf(up.scales), buf(up.biases), act, buf(dims), buf(&bits)};
  if (slots) metal_emu::dispatch("moe_gate_up", {(I + 7) / 8, static_cast<uint32_t>(slots)}, {64}, b);
}

// The routed and shared experts of moe_down (shared: nullptr for none).
struct DownArgs {
  const QWeight& down;
  const float* act;
  const int32_t* ids;
  const float* w;
  uint32_t S;
  const QWeight* shared_down = nullptr;
  const float* act_shared = nullptr;
  const float* shared_logit = nullptr;
  const float* residual = nullptr;
};

void down(const DownArgs& d, int64_t T, float* y) {
  const QWeight& sd = d.shared_down ? *d.shared_down : d.down;
  const uint32_t H = static_cast<uint32_t>(d.down.rows), I = static_cast<uint32_t>(d.down.cols);
  const uint32_t dims[4] = {H, I, static_cast<uint32_t>(sd.cols), d.S};
  const uint32_t params[4] = {static_cast<uint32_t>(d.down.group_size), static_cast<uint32_t>(sd.group_size),
                              static_cast<uint32_t>(d.down.bits), (d.shared_down ? 1u : 0u) | (d.residual ? 2u : 0u)};
  poison(y, static_cast<size_t>(T) * H);
  void* const b[] = {buf(d.act), buf(d.ids), buf(d.w), buf(d.down.codes), buf(d.down.scales), buf(d.down.biases),
                     buf(d.act_shared ? d.act_shared : d.act), buf(sd.codes), buf(sd.scales), buf(sd.biases),
                     buf(d.shared_logit ? d.shared_logit : d.w), buf(d.residual ? d.residual : d.w), y, buf(dims),
                     buf(params)};
  if (T) metal_emu::dispatch("moe_down", {(H + 7) / 8, static_cast<uint32_t>(T)}, {64}, b);
}

}  // namespace

void moe_experts(const ops::MoeExpert& a) {
  check_experts("moe_experts", a.gate, a.up, a.down);
  need(a.gate.experts == 1 && a.down.experts == 1 && a.T <= UINT32_MAX, "moe_experts", "one expert's matrices");
  const std::vector<int32_t> ids(a.T, 0);
  const std::vector<float> ones(a.T, 1.0f);  // the routing weight: y is the expert's output exactly
  std::vector<float> act(static_cast<size_t>(a.T) * a.gate.rows);
  gate_up(a.gate, a.up, a.x, ids.data(), a.T, 1, act.data());
  down({a.down, act.data(), ids.data(), ones.data(), 1}, a.T, a.y);
}

void moe_block(const MoeWeights& w, int top_k, bool norm_topk_prob, const float* x, int64_t T, float* y,
               const float* norm, float eps, bool residual) {
  const char* op = "moe_block";
  check_experts(op, w.gate_proj, w.up_proj, w.down_proj);
  check_experts(op, w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj);
  need(w.shared_down_proj.bits == w.down_proj.bits, op, "routed and shared experts of one width");
  need(T <= UINT32_MAX / std::max(top_k, 1), op, "too many tokens");
  const int64_t H = w.router.cols, E = w.router.rows, I = w.gate_proj.rows, Is = w.shared_gate_proj.rows;
  std::vector<float> xn(norm ? T * H : 0), logits(T * E), shared_logit(T), weights(T * top_k);
  std::vector<int32_t> ids(T * top_k), shared_ids(T, 0);
  std::vector<float> act(T * top_k * I), act_shared(T * Is);
  const float* xin = x;
  if (norm) rmsnorm({x, T, H, norm, eps, xn.data()}), xin = xn.data();
  qmatmul({xin, T, w.router, logits.data()});
  qmatmul({xin, T, w.shared_expert_gate, shared_logit.data()});
  moe_router({logits.data(), T, E, top_k, norm_topk_prob, ids.data(), weights.data()});
  gate_up(w.gate_proj, w.up_proj, xin, ids.data(), T * top_k, static_cast<uint32_t>(top_k), act.data());
  gate_up(w.shared_gate_proj, w.shared_up_proj, xin, shared_ids.data(), T, 1, act_shared.data());
  down({w.down_proj, act.data(), ids.data(), weights.data(), static_cast<uint32_t>(top_k), &w.shared_down_proj,
        act_shared.data(), shared_logit.data(), residual ? x : nullptr},
       T, y);
}

void gated_attention(const ops::GatedAttention& a) {
  const int64_t T = a.T, Hq = a.Hq, Hkv = a.Hkv, D = a.D, kv = Hkv * D;
  std::vector<float> q_raw(T * Hq * D), q(T * Hq * D), k(T * kv);
  for (int64_t th = 0; th < T * Hq; ++th) std::copy_n(a.qg + th * 2 * D, D, q_raw.data() + th * D);  // the query halves
  rmsnorm({q_raw.data(), T * Hq, D, a.q_norm, a.eps, q.data()});  // (its output is poisoned first: not in place)
  rmsnorm({a.k, T * Hkv, D, a.k_norm, a.eps, k.data()});
  rope({q.data(), T, Hq, D, a.rotary_dim, a.pos0, a.theta});
  rope({k.data(), T, Hkv, D, a.rotary_dim, a.pos0, a.theta});
  std::copy(k.begin(), k.end(), a.k_cache + a.pos0 * kv);  // the chunk's cache rows (v may be there already)
  if (a.v != a.v_cache + a.pos0 * kv) std::copy_n(a.v, T * kv, a.v_cache + a.pos0 * kv);
  attention({q.data(), a.k_cache, a.v_cache, T, a.pos0, Hq, Hkv, D, 1.0f / std::sqrt(static_cast<float>(D)), a.out});
  const uint32_t dims[3] = {static_cast<uint32_t>(T), static_cast<uint32_t>(Hq), static_cast<uint32_t>(D)};
  const uint32_t n = dims[0] * dims[1] * dims[2];
  void* const b[] = {a.out, buf(a.qg), buf(dims)};
  if (n) metal_emu::dispatch("attention_gate", {(n + 255) / 256}, {256}, b);
}

const ops::HostOps& host_ops() {
  static const ops::HostOps ops{
      .device = "metal-emulator",
      .embedding = embedding,
      .rmsnorm = rmsnorm,
      .qmatmul = qmatmul,
      .qmatmul_batch =
          [](std::span<const ops::QMatmul> products) {
            for (const ops::QMatmul& p : products) qmatmul(p);
          },
      .gated_delta_step = gated_delta_step,
      .gated_attention = gated_attention,
      .moe_block =
          [](const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, float* out) {
            cpu::check_moe_weights(w, c);
            moe_block(w, static_cast<int>(c.num_experts_per_tok), c.norm_topk_prob, x, T, out, nullptr, c.rms_norm_eps,
                      false);
          },
      .keeps_rows = false};
  return ops;
}

}  // namespace lily::metal_ops
