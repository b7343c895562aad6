// lily._lily.ops: the ops on numpy arrays, for tests and experiments: the CPU's, and with
// device="cuda" the CUDA kernels (src/cuda/contract) of the ops that take a device, with
// device="metal-emulator" the Metal kernels on the MSL emulator (src/metal/contract).
//
// Arrays are float32 (activations, small float weights), uint32 (quantized codes),
// uint16 (bf16 bits of scales/biases) or int32 (token and expert ids), C-contiguous.
// A quantized matrix is passed as a tuple (codes, scales, biases, group_size, bits) with
// codes [N, K*bits/32] or [E, N, K*bits/32]. Ops with state take it as an argument and
// return the updated copy; inputs are never written.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <deque>
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "cpu/check.h"
#include "cpu/layers.h"
#include "cpu/ops.h"
#ifdef LILY_HAS_CUDA
#include "contract/cuda_ops.h"
#endif
#ifdef LILY_HAS_METAL_EMULATOR
#include "contract/metal_ops.h"
#endif
#include "error.h"
#include "executor.h"
#include "threadpool.h"

namespace nb = nanobind;

namespace lily {
namespace {

template <typename T>
using In = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <typename T>
using Out = nb::ndarray<nb::numpy, T>;

// A fresh numpy array for an op's output and its data pointer, poisoned (NaN, or -1 for
// ids) so that an element the op leaves unwritten fails its test.
template <typename T>
std::pair<Out<T>, T*> new_array(const std::vector<size_t>& shape) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  T* data = new T[std::max<size_t>(n, 1)];
  std::fill(data, data + std::max<size_t>(n, 1),
            std::is_floating_point_v<T> ? std::numeric_limits<T>::quiet_NaN() : static_cast<T>(-1));
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return {Out<T>(data, shape.size(), shape.data(), owner), data};
}

template <typename T>
std::vector<size_t> shape_of(const In<T>& a) {
  std::vector<size_t> s(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) s[i] = a.shape(i);
  return s;
}

template <typename T>
void need(const In<T>& a, const std::vector<int64_t>& shape, const char* op, const char* name) {
  bool ok = a.ndim() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || static_cast<int64_t>(a.shape(i)) == shape[i];
  if (ok) return;
  std::string want, got;
  for (int64_t s : shape) want += (want.empty() ? "" : ", ") + (s < 0 ? std::string("*") : std::to_string(s));
  for (size_t s : shape_of(a)) got += (got.empty() ? "" : ", ") + std::to_string(s);
  fail(op, ": ", name, " has shape [", got, "], expected [", want, "]");
}

// A quantized matrix (or stack) from (codes, scales, biases, group_size, bits); the
// arrays stay referenced for the duration of the call.
struct PyQWeight {
  In<uint32_t> codes;
  In<uint16_t> scales, biases;
  QWeight w;

  PyQWeight(nb::handle t, const char* op, const char* name) {
    auto tup = nb::cast<nb::tuple>(t);
    if (tup.size() != 5) fail(op, ": ", name, " must be (codes, scales, biases, group_size, bits)");
    codes = nb::cast<In<uint32_t>>(tup[0]);
    scales = nb::cast<In<uint16_t>>(tup[1]);
    biases = nb::cast<In<uint16_t>>(tup[2]);
    w.group_size = nb::cast<int>(tup[3]);
    w.bits = nb::cast<int>(tup[4]);
    const size_t nd = codes.ndim();
    if ((nd != 2 && nd != 3) || scales.ndim() != nd || biases.ndim() != nd)
      fail(op, ": ", name, " codes/scales/biases must all be 2-D or all 3-D");
    if (w.bits <= 0 || 32 % w.bits != 0) fail(op, ": ", name, " has ", std::to_string(w.bits), " bits");
    w.experts = nd == 3 ? static_cast<int64_t>(codes.shape(0)) : 1;
    w.rows = static_cast<int64_t>(codes.shape(nd - 2));
    w.cols = static_cast<int64_t>(codes.shape(nd - 1)) * 32 / w.bits;
    for (size_t i = 0; i + 1 < nd; ++i)
      if (scales.shape(i) != codes.shape(i) || biases.shape(i) != codes.shape(i))
        fail(op, ": ", name, " scales/biases do not match the codes' leading dims");
    if (w.group_size <= 0 || static_cast<int64_t>(scales.shape(nd - 1)) * w.group_size != w.cols ||
        biases.shape(nd - 1) != scales.shape(nd - 1))
      fail(op, ": ", name, " scales/biases have ", std::to_string(scales.shape(nd - 1)), " groups per row; ",
           std::to_string(w.cols), " columns at group size ", std::to_string(w.group_size), " need ",
           std::to_string(w.cols / std::max(1, w.group_size)));
    w.codes = codes.data();
    w.scales = scales.data();
    w.biases = biases.data();
  }
};

Dense dense_from(const nb::dict& d, const char* key, const char* op) {
  if (!d.contains(key)) fail(op, ": weights have no '", key, "'");
  auto a = nb::cast<In<float>>(d[key]);
  Dense out;
  out.values.assign(a.data(), a.data() + a.size());
  for (size_t s : shape_of(a)) out.shape.push_back(static_cast<int64_t>(s));
  return out;
}

PyQWeight qweight_from(const nb::dict& d, const char* key, const char* op) {
  if (!d.contains(key)) fail(op, ": weights have no '", key, "'");
  return PyQWeight(d[key], op, key);
}

// A block's quantized matrices from a weights dict, held with the arrays they point into.
struct PyMatrices {
  std::deque<PyQWeight> held;
  const QWeight& get(const nb::dict& d, const char* key, const char* op) {
    return held.emplace_back(qweight_from(d, key, op)).w;
  }
};

AttnWeights attn_weights_from(const nb::dict& d, PyMatrices& m, const char* op) {
  return {m.get(d, "q_proj", op), m.get(d, "k_proj", op), m.get(d, "v_proj", op), m.get(d, "o_proj", op),
          dense_from(d, "q_norm", op), dense_from(d, "k_norm", op)};
}

MoeWeights moe_weights_from(const nb::dict& d, PyMatrices& m, const char* op) {
  return {m.get(d, "router", op),           m.get(d, "gate_proj", op),        m.get(d, "up_proj", op),
          m.get(d, "down_proj", op),        m.get(d, "shared_gate_proj", op), m.get(d, "shared_up_proj", op),
          m.get(d, "shared_down_proj", op), m.get(d, "shared_expert_gate", op)};
}

// The config fields an attention layer and a MoE block read, from their weights and arguments.
void set_attention_config(ModelConfig& c, const AttnWeights& w, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, double partial_rotary_factor, double rope_theta, float eps) {
  c.hidden_size = w.q_proj.cols;
  c.num_attention_heads = num_heads;
  c.num_key_value_heads = num_kv_heads;
  c.head_dim = head_dim;
  c.partial_rotary_factor = partial_rotary_factor;
  c.rope_theta = rope_theta;
  c.rms_norm_eps = eps;
}

void set_moe_config(ModelConfig& c, const MoeWeights& w, int64_t top_k, bool norm_topk_prob) {
  c.hidden_size = w.router.cols;
  c.num_experts = w.router.rows;
  c.num_experts_per_tok = top_k;
  c.moe_intermediate_size = w.gate_proj.rows;
  c.shared_expert_intermediate_size = w.shared_gate_proj.rows;
  c.norm_topk_prob = norm_topk_prob;
}

// A KV cache [pos0, Hkv, D] each from numpy, checked against the config.
cpu::KvCache kv_cache_from(In<float> k_cache, In<float> v_cache, const ModelConfig& c, const char* op) {
  need(k_cache, {-1, c.num_key_value_heads, c.head_dim}, op, "k_cache [pos0, Hkv, D]");
  need(v_cache, {static_cast<int64_t>(k_cache.shape(0)), c.num_key_value_heads, c.head_dim}, op, "v_cache");
  cpu::KvCache cache;
  cache.k.assign(k_cache.data(), k_cache.data() + k_cache.size());
  cache.v.assign(v_cache.data(), v_cache.data() + v_cache.size());
  return cache;
}

// The cache's [positions, Hkv, D] arrays.
std::tuple<Out<float>, Out<float>> kv_cache_out(const cpu::KvCache& cache, const ModelConfig& c) {
  const size_t row = static_cast<size_t>(c.num_key_value_heads * c.head_dim);
  const std::vector<size_t> shape{cache.k.size() / row, static_cast<size_t>(c.num_key_value_heads),
                                  static_cast<size_t>(c.head_dim)};
  auto [k, kp] = new_array<float>(shape);
  auto [v, vp] = new_array<float>(shape);
  std::copy(cache.k.begin(), cache.k.end(), kp);
  std::copy(cache.v.begin(), cache.v.end(), vp);
  return {k, v};
}

// Extent of dim i, signed like the op contracts' sizes.
template <typename T>
int64_t dim_of(const In<T>& a, size_t i) {
  return static_cast<int64_t>(a.shape(i));
}
// Extent of the last dim (0 for a scalar).
template <typename T>
int64_t last_dim(const In<T>& a) {
  return a.ndim() ? dim_of(a, a.ndim() - 1) : 0;
}
// Rows of the leading dims of a [..., dim] array.
template <typename T>
int64_t rows_of(const In<T>& a) {
  const int64_t D = last_dim(a);
  return D == 0 ? 0 : static_cast<int64_t>(a.size()) / D;
}

template <typename T>
void copy_into(const In<T>& a, T* dst) {
  std::copy(a.data(), a.data() + a.size(), dst);
}

// The backend an op runs on: "cpu"; for the ops that take a device "cuda" (src/cuda/contract,
// when this build has the CUDA executor) or, for those with a Metal kernel (`metal`),
// "metal-emulator" (src/metal/contract, when this build has the MSL emulator).
enum class Backend { Cpu, Cuda, MetalEmulator };
Backend backend_of(const std::string& device, const char* op) {
  if (device == "cpu") return Backend::Cpu;
  if (device == "cuda") return Backend::Cuda;
  if (device == "metal-emulator") return Backend::MetalEmulator;
  fail(op, ": device must be 'cpu', 'cuda' or 'metal-emulator', got '", device, "'");
}

// Refuses a route other than '' (the backend's default kernel) or, on CUDA, one of cuda_routes,
// naming those a route may be there.
void check_route(const char* op, Backend b, const std::string& device, const std::string& route,
                 std::initializer_list<const char*> cuda_routes) {
  if (route.empty() || (b == Backend::Cuda && std::find(cuda_routes.begin(), cuda_routes.end(), route) != cuda_routes.end()))
    return;
  std::string allowed = "''";
  if (b == Backend::Cuda)
    for (const char* r : cuda_routes) allowed += std::string(", '") + r + "'";
  else
    allowed += " (" + device + ")";
  fail(op, ": route '", route, "' is not one of ", allowed);
}

// A backend's kernel of an op as run_on takes it: a callable (which may refuse by name, as the
// ops CUDA fuses into others do), or NotBuilt (this build lacks the backend).
struct NotBuilt {};
#ifdef LILY_HAS_CUDA
#define LILY_ON_CUDA(call) [&] { call; }
#else
#define LILY_ON_CUDA(call) NotBuilt{}
#endif
#ifdef LILY_HAS_METAL_EMULATOR
#define LILY_ON_METAL(call) [&] { call; }
#else
#define LILY_ON_METAL(call) NotBuilt{}
#endif

// Runs the op's kernel on backend b with the GIL released, or refuses naming what is missing.
template <class Cpu, class Cuda, class Metal>
void run_on(Backend b, const char* op, Cpu cpu, Cuda cuda, Metal metal) {
  auto go = [op](auto kernel, const char* not_built) {
    if constexpr (std::is_same_v<decltype(kernel), NotBuilt>) {
      fail(op, not_built);
    } else {
      nb::gil_scoped_release nogil;
      kernel();
    }
  };
  if (b == Backend::Cpu) go(cpu, "");
  else if (b == Backend::Cuda) go(cuda, ": this build has no CUDA executor");
  else go(metal, ": this build has no MSL emulator (LILY_METAL_EMULATOR=OFF)");
}

#ifdef LILY_HAS_CUDA
// The kernel a (checked) route name picks: its entry in names, else the default.
template <class R>
R route_named(const std::string& r, std::initializer_list<std::pair<const char*, R>> names, R otherwise) {
  for (const auto& [name, value] : names)
    if (r == name) return value;
  return otherwise;
}

// qmatmul's CUDA kernels by route name ('': the decode kernel on MLX-order weights).
cuda_ops::QMatmulRoute cuda_qmatmul_route(const std::string& r) {
  using R = cuda_ops::QMatmulRoute;
  return route_named(r, {{"decode_tiles", R::DecodeTiles}, {"prefill", R::Prefill}, {"prefill_bf16w", R::PrefillBf16w},
                         {"prefill_wgmma", R::PrefillWgmma}}, R::Decode);
}
#endif

Out<float> qmatmul(In<float> x, nb::handle weight, const std::string& device, const std::string& route) {
  PyQWeight q(weight, "qmatmul", "weight");
  need(x, {-1, q.w.cols}, "qmatmul", "x");
  const Backend b = backend_of(device, "qmatmul");
  check_route("qmatmul", b, device, route, {"decode", "decode_tiles", "prefill", "prefill_bf16w", "prefill_wgmma"});
  const int64_t T = x.shape(0);
  auto [y, yp] = new_array<float>({static_cast<size_t>(T), static_cast<size_t>(q.w.rows)});
  const ops::QMatmul args{x.data(), T, q.w, yp};
  run_on(b, "qmatmul", [&] { cpu::qmatmul(args); },
         LILY_ON_CUDA(cuda_ops::qmatmul(args, cuda_qmatmul_route(route))),
         LILY_ON_METAL(metal_ops::qmatmul(args)));
  return y;
}

Out<float> embedding(In<int32_t> ids, nb::handle table, const std::string& device) {
  PyQWeight q(table, "embedding", "table");
  need(ids, {-1}, "embedding", "ids");
  const Backend b = backend_of(device, "embedding");
  const int64_t T = ids.shape(0);
  auto [y, yp] = new_array<float>({static_cast<size_t>(T), static_cast<size_t>(q.w.cols)});
  const ops::Embedding args{q.w, ids.data(), T, yp};
  run_on(b, "embedding", [&] { cpu::embedding(args); }, LILY_ON_CUDA(cuda_ops::embedding(args)),
         LILY_ON_METAL(metal_ops::embedding(args)));
  return y;
}

Out<float> rmsnorm(In<float> x, In<float> w, float eps, const std::string& device) {
  const int64_t D = last_dim(x);
  need(w, {D}, "rmsnorm", "w");
  const Backend b = backend_of(device, "rmsnorm");
  auto [y, yp] = new_array<float>(shape_of(x));
  const ops::RmsNorm args{x.data(), rows_of(x), D, w.data(), eps, yp};
  run_on(b, "rmsnorm", [&] { cpu::rmsnorm(args); }, LILY_ON_CUDA(cuda_ops::rmsnorm(args)),
         LILY_ON_METAL(metal_ops::rmsnorm(args)));
  return y;
}

Out<float> gated_rmsnorm(In<float> x, In<float> z, In<float> w, float eps, const std::string& device) {
  const int64_t D = last_dim(x);
  need(w, {D}, "gated_rmsnorm", "w");
  if (shape_of(z) != shape_of(x)) fail("gated_rmsnorm: z must have the shape of x");
  const Backend b = backend_of(device, "gated_rmsnorm");
  auto [y, yp] = new_array<float>(shape_of(x));
  const ops::GatedRmsNorm args{x.data(), z.data(), rows_of(x), D, w.data(), eps, yp};
  run_on(b, "gated_rmsnorm", [&] { cpu::gated_rmsnorm(args); }, LILY_ON_CUDA(cuda_ops::gated_rmsnorm(args)),
         LILY_ON_METAL(metal_ops::gated_rmsnorm(args)));
  return y;
}

Out<float> l2norm(In<float> x, float eps, float scale, const std::string& device) {
  const Backend b = backend_of(device, "l2norm");
  auto [y, yp] = new_array<float>(shape_of(x));
  copy_into(x, yp);
  const ops::L2Norm args{yp, rows_of(x), last_dim(x), eps, scale};
  run_on(b, "l2norm", [&] { cpu::l2norm(args); },
         LILY_ON_CUDA(fail("l2norm (cuda): CUDA fuses it into gated_delta_step's kernels")),
         LILY_ON_METAL(metal_ops::l2norm(args)));
  return y;
}

Out<float> rope(In<float> x, int64_t rotary_dim, int64_t pos0, double theta, const std::string& device) {
  need(x, {-1, -1, -1}, "rope", "x [T, heads, head_dim]");
  const Backend b = backend_of(device, "rope");
  auto [y, yp] = new_array<float>(shape_of(x));
  copy_into(x, yp);
  const ops::Rope args{yp, dim_of(x, 0), dim_of(x, 1), dim_of(x, 2), rotary_dim, pos0, theta};
  run_on(b, "rope", [&] { cpu::rope(args); },
         LILY_ON_CUDA(fail("rope (cuda): CUDA fuses it with the q/k norms and the cache write: run gated_attention")),
         LILY_ON_METAL(metal_ops::rope(args)));
  return y;
}

std::tuple<Out<float>, Out<float>> gated_delta_conv(In<float> x, In<float> w, In<float> state, const std::string& device) {
  need(x, {-1, -1}, "gated_delta_conv", "x [T, C]");
  const int64_t T = x.shape(0), C = x.shape(1);
  need(w, {C, -1}, "gated_delta_conv", "w [C, Kc]");
  const int64_t Kc = w.shape(1);
  need(state, {Kc - 1, C}, "gated_delta_conv", "state [Kc-1, C]");
  const Backend b = backend_of(device, "gated_delta_conv");
  auto [y, yp] = new_array<float>(shape_of(x));
  auto [s, sp] = new_array<float>(shape_of(state));
  copy_into(state, sp);
  const ops::GatedDeltaConv args{x.data(), T, C, w.data(), Kc, sp, yp};
  run_on(b, "gated_delta_conv", [&] { cpu::gated_delta_conv(args); },
         LILY_ON_CUDA(fail("gated_delta_conv (cuda): CUDA fuses it into gated_delta_step's kernels")),
         LILY_ON_METAL(metal_ops::gated_delta_conv(args)));
  return {y, s};
}

std::tuple<Out<float>, Out<float>> gated_delta_gates(In<float> a, In<float> b, In<float> A_log, In<float> dt_bias,
                                                     const std::string& device) {
  need(a, {-1, -1}, "gated_delta_gates", "a [T, Hv]");
  const int64_t T = a.shape(0), Hv = a.shape(1);
  need(b, {T, Hv}, "gated_delta_gates", "b");
  need(A_log, {Hv}, "gated_delta_gates", "A_log");
  need(dt_bias, {Hv}, "gated_delta_gates", "dt_bias");
  const Backend be = backend_of(device, "gated_delta_gates");
  auto [g, gp] = new_array<float>(shape_of(a));
  auto [beta, bp] = new_array<float>(shape_of(a));
  const ops::GatedDeltaGates args{a.data(), b.data(), T, Hv, A_log.data(), dt_bias.data(), gp, bp};
  run_on(be, "gated_delta_gates", [&] { cpu::gated_delta_gates(args); },
         LILY_ON_CUDA(fail("gated_delta_gates (cuda): CUDA fuses it into gated_delta_step's kernels")),
         LILY_ON_METAL(metal_ops::gated_delta_gates(args)));
  return {g, beta};
}

std::tuple<Out<float>, Out<float>> gated_delta(In<float> q, In<float> k, In<float> v, In<float> g, In<float> beta,
                                               In<float> state, const std::string& device, const std::string& route) {
  need(q, {-1, -1, -1}, "gated_delta", "q [T, Hk, Dk]");
  const int64_t T = q.shape(0), Hk = q.shape(1), Dk = q.shape(2);
  need(k, {T, Hk, Dk}, "gated_delta", "k");
  need(v, {T, -1, -1}, "gated_delta", "v [T, Hv, Dv]");
  const int64_t Hv = v.shape(1), Dv = v.shape(2);
  need(g, {T, Hv}, "gated_delta", "g");
  need(beta, {T, Hv}, "gated_delta", "beta");
  need(state, {Hv, Dk, Dv}, "gated_delta", "state");
  const Backend b = backend_of(device, "gated_delta");
  check_route("gated_delta", b, device, route, {"scan", "chunked"});
  auto [o, op] = new_array<float>(shape_of(v));
  auto [s, sp] = new_array<float>(shape_of(state));
  copy_into(state, sp);
  const ops::GatedDelta args{q.data(), k.data(), v.data(), g.data(), beta.data(), T, Hk, Hv, Dk, Dv, sp, op};
  run_on(b, "gated_delta", [&] { cpu::gated_delta(args); },
         LILY_ON_CUDA(cuda_ops::gated_delta(args, route != "scan")),  // the prefill's default: chunked
         LILY_ON_METAL(metal_ops::gated_delta(args)));
  return {o, s};
}

// (out [T, Hv, Dv], conv_state, state, conv_rows [T-1, Kc-1, C], state_rows [T-1, Hv, Dk, Dv]);
// the rows are empty ([0, ...]) unless keep_rows.
using StepOuts = std::tuple<Out<float>, Out<float>, Out<float>, Out<float>, Out<float>>;
StepOuts gated_delta_step(In<float> mixed, In<float> z, In<float> b, In<float> a, In<float> conv_w,
                          In<float> conv_state, In<float> A_log, In<float> dt_bias, In<float> norm, In<float> state,
                          int64_t num_key_heads, float eps, bool keep_rows, const std::string& device,
                          const std::string& route) {
  const char* op = "gated_delta_step";
  need(z, {-1, -1, -1}, op, "z [T, Hv, Dv]");
  const int64_t T = z.shape(0), Hv = z.shape(1), Dv = z.shape(2), Hk = num_key_heads;
  need(state, {Hv, -1, Dv}, op, "state [Hv, Dk, Dv]");
  const int64_t Dk = state.shape(1), C = 2 * Hk * Dk + Hv * Dv;
  if (Hk <= 0 || Hv % Hk) fail(op, ": value heads (", std::to_string(Hv), ") must be a multiple of key heads (",
                               std::to_string(Hk), ")");
  need(mixed, {T, C}, op, "mixed [T, 2 Hk Dk + Hv Dv]");
  need(b, {T, Hv}, op, "b");
  need(a, {T, Hv}, op, "a");
  need(conv_w, {C, -1}, op, "conv_w [C, Kc]");
  const int64_t Kc = conv_w.shape(1);
  need(conv_state, {Kc - 1, C}, op, "conv_state [Kc-1, C]");
  need(A_log, {Hv}, op, "A_log");
  need(dt_bias, {Hv}, op, "dt_bias");
  need(norm, {Dv}, op, "norm");
  const Backend be = backend_of(device, op);
  check_route(op, be, device, route, {"decode", "decode_rows", "prefill_scan", "prefill_chunked"});
  const bool prefill = route == "prefill_scan" || route == "prefill_chunked";
  auto [o, op_out] = new_array<float>(shape_of(z));
  auto [cs, csp] = new_array<float>(shape_of(conv_state));
  auto [st, stp] = new_array<float>(shape_of(state));
  copy_into(conv_state, csp);
  copy_into(state, stp);
  const size_t kept = keep_rows ? static_cast<size_t>(std::max<int64_t>(T - 1, 0)) : 0;
  auto [cr, crp] = new_array<float>({kept, static_cast<size_t>(Kc - 1), static_cast<size_t>(C)});
  auto [sr, srp] = new_array<float>({kept, static_cast<size_t>(Hv), static_cast<size_t>(Dk), static_cast<size_t>(Dv)});
  const ops::GatedDeltaStep args{mixed.data(), z.data(), b.data(), a.data(), conv_w.data(), A_log.data(),
                                 dt_bias.data(), norm.data(), T, Hk, Hv, Dk, Dv, Kc, eps, csp, stp, op_out,
                                 keep_rows ? crp : nullptr, keep_rows ? srp : nullptr};
  run_on(be, op, [&] { cpu::gated_delta_step(args); }, LILY_ON_CUDA(prefill ? cuda_ops::gated_delta_step_prefill(args, route == "prefill_chunked")
                                      : cuda_ops::gated_delta_step(args, route == "decode" ? 1 : 4)),
         LILY_ON_METAL(metal_ops::gated_delta_step(args)));
  return {o, cs, st, cr, sr};
}

Out<float> attention(In<float> q, In<float> k, In<float> v, float scale, const std::string& device) {
  need(q, {-1, -1, -1}, "attention", "q [T, Hq, D]");
  const int64_t T = q.shape(0), Hq = q.shape(1), D = q.shape(2);
  need(k, {-1, -1, D}, "attention", "k [L, Hkv, D]");
  const int64_t L = k.shape(0), Hkv = k.shape(1);
  need(v, {L, Hkv, D}, "attention", "v");
  if (L < T) fail("attention: the cache holds ", std::to_string(L), " positions, fewer than T = ", std::to_string(T));
  const Backend b = backend_of(device, "attention");
  auto [o, op] = new_array<float>(shape_of(q));
  const ops::Attention args{q.data(), k.data(), v.data(), T, L - T, Hq, Hkv, D, scale, op};
  run_on(b, "attention", [&] { cpu::attention(args); },
         LILY_ON_CUDA(fail("attention (cuda): CUDA fuses it with the q/k norms, RoPE and gate: run gated_attention")),
         LILY_ON_METAL(metal_ops::attention(args)));
  return o;
}

#ifdef LILY_HAS_CUDA
// gated_attention's CUDA kernels by route name ('': the decode step's tensor-core kernel).
cuda_ops::AttentionRoute cuda_attention_route(const std::string& r) {
  using R = cuda_ops::AttentionRoute;
  return route_named(r, {{"decode", R::Decode}, {"prefill", R::Prefill}, {"prefill_mma", R::PrefillMma},
                         {"prefill_wgmma", R::PrefillWgmma}}, R::DecodeTensorCores);
}
#endif

// (out [T, Hq, D], k_cache, v_cache [pos0 + T, Hkv, D]): the caches with the chunk appended.
std::tuple<Out<float>, Out<float>, Out<float>> gated_attention(In<float> qg, In<float> k, In<float> v,
                                                               In<float> q_norm, In<float> k_norm, In<float> k_cache,
                                                               In<float> v_cache, int64_t rotary_dim, double theta,
                                                               float eps, const std::string& device,
                                                               const std::string& route, int max_splits,
                                                               int min_chunk) {
  const char* op = "gated_attention";
  need(qg, {-1, -1, -1}, op, "qg [T, Hq, 2D]");
  const int64_t T = qg.shape(0), Hq = qg.shape(1), D = qg.shape(2) / 2;
  if (qg.shape(2) % 2) fail(op, ": qg's last dim must be 2D (D query values, then D gate values)");
  need(k, {T, -1, D}, op, "k [T, Hkv, D]");
  const int64_t Hkv = k.shape(1);
  need(v, {T, Hkv, D}, op, "v");
  need(q_norm, {D}, op, "q_norm");
  need(k_norm, {D}, op, "k_norm");
  need(k_cache, {-1, Hkv, D}, op, "k_cache [pos0, Hkv, D]");
  const int64_t pos0 = k_cache.shape(0);
  need(v_cache, {pos0, Hkv, D}, op, "v_cache");
  const Backend b = backend_of(device, op);
  check_route(op, b, device, route, {"decode", "decode_tc", "prefill", "prefill_mma", "prefill_wgmma"});
  const bool decode_route = route.empty() || route.rfind("decode", 0) == 0;
  if ((max_splits || min_chunk) && !(b == Backend::Cuda && decode_route))
    fail(op, ": max_splits and min_chunk route CUDA's decode kernels (route 'decode' or 'decode_tc')");
  if (max_splits < 0 || min_chunk < 0) fail(op, ": max_splits and min_chunk must be >= 0 (0: the kernels' defaults)");
  const std::vector<size_t> cache_shape{static_cast<size_t>(pos0 + T), static_cast<size_t>(Hkv), static_cast<size_t>(D)};
  auto [kc, kcp] = new_array<float>(cache_shape);
  auto [vc, vcp] = new_array<float>(cache_shape);
  copy_into(k_cache, kcp);
  copy_into(v_cache, vcp);
  auto [o, outp] = new_array<float>({static_cast<size_t>(T), static_cast<size_t>(Hq), static_cast<size_t>(D)});
  const ops::GatedAttention args{qg.data(), k.data(), v.data(), q_norm.data(), k_norm.data(), kcp, vcp,
                                 T, pos0, Hq, Hkv, D, rotary_dim, theta, eps, outp};
  run_on(b, op, [&] { cpu::gated_attention(args); },
         LILY_ON_CUDA(cuda_ops::gated_attention(args, cuda_attention_route(route), {max_splits, min_chunk})),
         LILY_ON_METAL(metal_ops::gated_attention(args)));
  return {o, kc, vc};
}

std::tuple<Out<int32_t>, Out<float>> moe_router(In<float> logits, int64_t top_k, bool renormalize,
                                                const std::string& device) {
  need(logits, {-1, -1}, "moe_router", "logits [T, E]");
  const int64_t T = logits.shape(0), E = logits.shape(1);
  const Backend b = backend_of(device, "moe_router");
  const std::vector<size_t> shape{static_cast<size_t>(T), static_cast<size_t>(std::max<int64_t>(top_k, 0))};
  auto [ids, ip] = new_array<int32_t>(shape);
  auto [w, wp] = new_array<float>(shape);
  const ops::MoeRouter args{logits.data(), T, E, top_k, renormalize, ip, wp};
  run_on(b, "moe_router", [&] { cpu::moe_router(args); },
         LILY_ON_CUDA(fail("moe_router (cuda): CUDA fuses it with the router matmul: run moe_block")),
         LILY_ON_METAL(metal_ops::moe_router(args)));
  return {ids, w};
}

Out<float> moe_experts(In<float> x, nb::handle gate, nb::handle up, nb::handle down, const std::string& device) {
  PyQWeight g(gate, "moe_experts", "gate"), u(up, "moe_experts", "up"), d(down, "moe_experts", "down");
  need(x, {-1, g.w.cols}, "moe_experts", "x");
  const Backend b = backend_of(device, "moe_experts");
  const int64_t T = x.shape(0);
  auto [y, yp] = new_array<float>({static_cast<size_t>(T), static_cast<size_t>(d.w.rows)});
  const ops::MoeExpert expert{x.data(), T, g.w, u.w, d.w, yp};
  run_on(b, "moe_experts", [&] {
    std::vector<float> scratch;
    cpu::moe_experts({&expert, 1}, scratch);
  }, LILY_ON_CUDA(fail("moe_experts (cuda): CUDA runs the experts of a block: run moe_block")),
         LILY_ON_METAL(metal_ops::moe_experts(expert)));
  return y;
}

Out<float> moe_block(In<float> x, nb::dict weights, int64_t top_k, bool norm_topk_prob, const std::string& device,
                     const std::string& route, int router_cluster, std::optional<In<float>> norm, float eps,
                     bool residual) {
  const char* op = "moe_block";
  PyMatrices m;
  const MoeWeights w = moe_weights_from(weights, m, op);
  ModelConfig c;
  set_moe_config(c, w, top_k, norm_topk_prob);
  cpu::check_moe_weights(w, c);  // before any backend reads them
  need(x, {-1, c.hidden_size}, op, "x");
  const Backend b = backend_of(device, op);
  check_route(op, b, device, route, {"decode", "decode_tiles", "prefill"});
  if (router_cluster && !(b == Backend::Cuda && route != "prefill")) fail(op, ": router_cluster sizes CUDA's decode router");
  if (router_cluster < 0) fail(op, ": router_cluster must be >= 0 (0: the executor's)");
  if (norm) need(*norm, {c.hidden_size}, op, "norm [H]");
  const int64_t T = x.shape(0), H = c.hidden_size;
  const float* norm_w = norm ? norm->data() : nullptr;
  auto [y, yp] = new_array<float>(shape_of(x));
  run_on(b, op, [&] {
    std::vector<float> xn(norm_w ? T * H : 0);  // the sublayer: y = (x +) moe(rmsnorm(x))
    if (norm_w) cpu::rmsnorm({x.data(), T, H, norm_w, eps, xn.data()});
    cpu::MoeBuffers buf;
    cpu::moe_block(w, c, norm_w ? xn.data() : x.data(), T, buf, yp);
    if (residual)
      for (int64_t i = 0; i < T * H; ++i) yp[i] += x.data()[i];
  }, LILY_ON_CUDA(cuda_ops::moe_block(w, static_cast<int>(top_k), norm_topk_prob, x.data(), T, yp,
                                      route == "decode"    ? cuda_ops::MoeRoute::Decode
                                      : route == "prefill" ? cuda_ops::MoeRoute::Prefill
                                                           : cuda_ops::MoeRoute::DecodeTiles,
                                      router_cluster, {norm_w, eps, residual})),
         LILY_ON_METAL(metal_ops::moe_block(w, static_cast<int>(top_k), norm_topk_prob, x.data(), T, yp, norm_w, eps,
                                            residual)));
  return y;
}

std::tuple<Out<float>, Out<float>, Out<float>> gated_delta_mixer(In<float> x, nb::dict weights,
                                                                 In<float> conv_state, In<float> recurrent_state,
                                                                 int64_t num_key_heads, int64_t num_value_heads,
                                                                 int64_t key_head_dim, int64_t value_head_dim,
                                                                 float eps) {
  const char* op = "gated_delta_mixer";
  PyMatrices m;
  const GdnWeights w{m.get(weights, "in_proj_qkv", op), m.get(weights, "in_proj_z", op),
                     m.get(weights, "in_proj_b", op),   m.get(weights, "in_proj_a", op),
                     m.get(weights, "out_proj", op),    dense_from(weights, "conv1d", op),
                     dense_from(weights, "dt_bias", op), dense_from(weights, "A_log", op),
                     dense_from(weights, "norm", op)};
  ModelConfig c;
  c.hidden_size = w.in_proj_qkv.cols;
  c.linear_num_key_heads = num_key_heads;
  c.linear_num_value_heads = num_value_heads;
  c.linear_key_head_dim = key_head_dim;
  c.linear_value_head_dim = value_head_dim;
  c.rms_norm_eps = eps;
  if (w.conv1d.shape.size() != 2 || w.conv1d.shape[0] != c.gdn_conv_dim())
    fail(op, ": conv1d must be [conv_dim = ", std::to_string(c.gdn_conv_dim()), ", Kc]");
  c.linear_conv_kernel_dim = w.conv1d.shape[1];
  need(x, {-1, c.hidden_size}, op, "x");
  need(conv_state, {c.linear_conv_kernel_dim - 1, c.gdn_conv_dim()}, op, "conv_state");
  need(recurrent_state, {num_value_heads, key_head_dim, value_head_dim}, op, "recurrent_state");
  const int64_t T = x.shape(0);
  auto [y, yp] = new_array<float>(shape_of(x));
  auto [cs, csp] = new_array<float>(shape_of(conv_state));
  auto [rs, rsp] = new_array<float>(shape_of(recurrent_state));
  cpu::GdnState state;
  state.conv.assign(conv_state.data(), conv_state.data() + conv_state.size());
  state.recurrent.assign(recurrent_state.data(), recurrent_state.data() + recurrent_state.size());
  {
    nb::gil_scoped_release nogil;
    cpu::GdnBuffers buf;
    cpu::gated_delta_mixer(w, c, x.data(), T, state, buf, yp);
  }
  std::copy(state.conv.begin(), state.conv.end(), csp);
  std::copy(state.recurrent.begin(), state.recurrent.end(), rsp);
  return {y, cs, rs};
}

std::tuple<Out<float>, Out<float>, Out<float>> attention_mixer(In<float> x, nb::dict weights, In<float> k_cache,
                                                               In<float> v_cache, int64_t num_heads,
                                                               int64_t num_kv_heads, int64_t head_dim,
                                                               double partial_rotary_factor, double rope_theta,
                                                               float eps) {
  const char* op = "attention_mixer";
  PyMatrices m;
  const AttnWeights w = attn_weights_from(weights, m, op);
  ModelConfig c;
  set_attention_config(c, w, num_heads, num_kv_heads, head_dim, partial_rotary_factor, rope_theta, eps);
  need(x, {-1, c.hidden_size}, op, "x");
  cpu::KvCache cache = kv_cache_from(k_cache, v_cache, c, op);
  const int64_t T = x.shape(0), pos0 = k_cache.shape(0);
  auto [y, yp] = new_array<float>(shape_of(x));
  {
    nb::gil_scoped_release nogil;
    cpu::AttnBuffers buf;
    cpu::attention_mixer(w, c, x.data(), T, pos0, cache, buf, yp);
  }
  auto [kc, vc] = kv_cache_out(cache, c);
  return {y, kc, vc};
}

std::tuple<Out<float>, Out<float>, Out<float>> mtp_head(In<float> hidden, In<int32_t> next, nb::dict weights,
                                                        In<float> k_cache, In<float> v_cache, int64_t num_heads,
                                                        int64_t num_kv_heads, int64_t head_dim,
                                                        double partial_rotary_factor, double rope_theta, float eps,
                                                        int64_t top_k, bool norm_topk_prob) {
  const char* op = "mtp_head";
  PyMatrices m;
  ModelWeights w;
  w.has_mtp = true;
  w.embed = m.get(weights, "embed_tokens", op);
  w.mtp.fc = m.get(weights, "fc", op);
  w.mtp.pre_fc_norm_embedding = dense_from(weights, "pre_fc_norm_embedding", op);
  w.mtp.pre_fc_norm_hidden = dense_from(weights, "pre_fc_norm_hidden", op);
  w.mtp.norm = dense_from(weights, "norm", op);
  LayerWeights& L = w.mtp.layer;
  L.kind = LayerKind::Full;
  L.input_norm = dense_from(weights, "input_layernorm", op);
  L.post_norm = dense_from(weights, "post_attention_layernorm", op);
  L.attn = attn_weights_from(weights, m, op);
  L.moe = moe_weights_from(weights, m, op);
  ModelConfig& c = w.config;
  set_attention_config(c, L.attn, num_heads, num_kv_heads, head_dim, partial_rotary_factor, rope_theta, eps);
  set_moe_config(c, L.moe, top_k, norm_topk_prob);
  c.vocab_size = w.embed.rows;
  const int64_t H = c.hidden_size;
  if (w.mtp.fc.rows != H || w.mtp.fc.cols != 2 * H) fail(op, ": fc must be [H, 2H] with H = ", std::to_string(H));
  need(hidden, {-1, H}, op, "hidden [R, H]");
  const int64_t R = hidden.shape(0);
  need(next, {R}, op, "next [R]");
  check_tokens(c, next.data(), R);
  cpu::KvCache cache = kv_cache_from(k_cache, v_cache, c, op);
  auto [y, yp] = new_array<float>(shape_of(hidden));
  {
    nb::gil_scoped_release nogil;
    cpu::MtpBuffers buf;
    cpu::mtp_head(w, hidden.data(), next.data(), R, k_cache.shape(0), cache, buf, yp);
  }
  auto [kc, vc] = kv_cache_out(cache, c);
  return {y, kc, vc};
}

// The ranges one parallel_for over n items hands out, sorted, each with whether the
// calling thread ran it: shows how the pool splits a loop.
std::vector<std::tuple<int64_t, int64_t, bool>> parallel_ranges(int64_t n, int64_t item_work) {
  std::mutex mu;
  std::vector<std::tuple<int64_t, int64_t, bool>> ranges;
  const auto caller = std::this_thread::get_id();
  parallel_for(n, item_work, [&](int64_t begin, int64_t end) {
    std::lock_guard<std::mutex> lk(mu);
    ranges.emplace_back(begin, end, std::this_thread::get_id() == caller);
  });
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

}  // namespace

void register_ops(nb::module_& m) {
  nb::module_ ops = m.def_submodule("ops", "lily's ops on numpy arrays, for tests: the CPU's, and with device='cuda' "
                                           "or 'metal-emulator' the CUDA or Metal kernels of those that take one");
  ops.def("qmatmul", &qmatmul, nb::arg("x"), nb::arg("weight"), nb::arg("device") = "cpu", nb::arg("route") = "",
          "y[T, N] = x[T, K] @ dequant(weight)^T; weight = (codes, scales, biases, group_size, bits); on cuda\n"
          "route 'decode' (the default), 'decode_tiles', or the prefill GEMM: 'prefill' (exact weights),\n"
          "'prefill_bf16w' (bf16 weights), 'prefill_wgmma' (the same on warpgroup MMA)");
  ops.def("embedding", &embedding, nb::arg("ids"), nb::arg("table"), nb::arg("device") = "cpu",
          "rows ids of the quantized table [V, H]");
  ops.def("rmsnorm", &rmsnorm, nb::arg("x"), nb::arg("w"), nb::arg("eps"), nb::arg("device") = "cpu",
          "x * rsqrt(mean(x^2) + eps) * w");
  ops.def("gated_rmsnorm", &gated_rmsnorm, nb::arg("x"), nb::arg("z"), nb::arg("w"), nb::arg("eps"),
          nb::arg("device") = "cpu",
          "rmsnorm(x) * w * silu(z)");
  ops.def("l2norm", &l2norm, nb::arg("x"), nb::arg("eps"), nb::arg("scale"), nb::arg("device") = "cpu",
          "x * rsqrt(sum(x^2) + eps) * scale");
  ops.def("rope", &rope, nb::arg("x"), nb::arg("rotary_dim"), nb::arg("pos0"), nb::arg("theta"), nb::arg("device") = "cpu",
          "partial NeoX RoPE of x [T, heads, head_dim] at positions pos0..");
  ops.def("gated_delta_conv", &gated_delta_conv, nb::arg("x"), nb::arg("w"), nb::arg("state"), nb::arg("device") = "cpu",
          "(silu(causal depthwise conv of x [T, C]), new state [Kc-1, C])");
  ops.def("gated_delta_gates", &gated_delta_gates, nb::arg("a"), nb::arg("b"), nb::arg("A_log"), nb::arg("dt_bias"),
          nb::arg("device") = "cpu", "(g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b))");
  ops.def("gated_delta", &gated_delta, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"),
          nb::arg("beta"), nb::arg("state"), nb::arg("device") = "cpu", nb::arg("route") = "",
          "(o [T, Hv, Dv], new state [Hv, Dk, Dv]); on cuda route 'scan' or 'chunked' (the default)");
  ops.def("gated_delta_step", &gated_delta_step, nb::arg("mixed"), nb::arg("z"), nb::arg("b"), nb::arg("a"),
          nb::arg("conv_w"), nb::arg("conv_state"), nb::arg("A_log"), nb::arg("dt_bias"), nb::arg("norm"),
          nb::arg("state"), nb::arg("num_key_heads"), nb::arg("eps"), nb::arg("keep_rows") = false,
          nb::arg("device") = "cpu", nb::arg("route") = "",
          "(out [T, Hv, Dv], conv_state, state, conv_rows, state_rows) of the Gated DeltaNet mixer between its\n"
          "projections: conv + SiLU, l2-normed q/k, gates, delta rule, gated RMSNorm; with keep_rows the states\n"
          "after each token but the last (a verify step's), else empty rows; on cuda route 'decode' (a launch a\n"
          "token), 'decode_rows' (4 tokens a launch, as verify steps; the default), or the prefill's kernels over\n"
          "the chunk, 'prefill_scan' or 'prefill_chunked' (bf16 out, no keep_rows)");
  ops.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
          nb::arg("device") = "cpu",
          "causal GQA of q [T, Hq, D] over k, v [L, Hkv, D]; the queries are the last T positions");
  ops.def("gated_attention", &gated_attention, nb::arg("qg"), nb::arg("k"), nb::arg("v"), nb::arg("q_norm"),
          nb::arg("k_norm"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("rotary_dim"), nb::arg("theta"),
          nb::arg("eps"), nb::arg("device") = "cpu", nb::arg("route") = "", nb::arg("max_splits") = 0,
          nb::arg("min_chunk") = 0,
          "(out [T, Hq, D], k_cache, v_cache) of the attention mixer between its projections: q/k norms, partial\n"
          "RoPE, causal GQA over the cache with the chunk appended, the sigmoid gate; on cuda route 'decode',\n"
          "'decode_tc' (the default), 'prefill' (its flash kernel by head dim), 'prefill_mma' or 'prefill_wgmma',\n"
          "the decode routes splitting the keys by max_splits and min_chunk (0: the executor's defaults)");
  ops.def("moe_router", &moe_router, nb::arg("logits"), nb::arg("top_k"), nb::arg("renormalize"),
          nb::arg("device") = "cpu", "(experts int32 [T, K], weights [T, K]) from router logits [T, E]");
  ops.def("moe_experts", &moe_experts, nb::arg("x"), nb::arg("gate"), nb::arg("up"), nb::arg("down"),
          nb::arg("device") = "cpu", "one expert's SwiGLU MLP: down(silu(x gate^T) * (x up^T))");
  ops.def("moe_block", &moe_block, nb::arg("x"), nb::arg("weights"), nb::arg("top_k"), nb::arg("norm_topk_prob"),
          nb::arg("device") = "cpu", nb::arg("route") = "", nb::arg("router_cluster") = 0,
          nb::arg("norm") = nb::none(), nb::arg("eps") = 1e-6f, nb::arg("residual") = false,
          "sparse MoE + gated shared expert; weights: router, gate_proj, up_proj, down_proj, shared_gate_proj,\n"
          "shared_up_proj, shared_down_proj, shared_expert_gate; on cuda route 'decode' (MLX-order weights, a\n"
          "token a launch), 'decode_tiles' (tensor-core tiles, 4 tokens a launch; the default) or 'prefill' (the\n"
          "prefill's kernels over the chunk; needs norm and residual), router_cluster capping the decode router's\n"
          "cluster (0: the executor's). As a layer runs it: norm [H] normalises x first (rmsnorm with eps) and\n"
          "residual adds x to the result");
  ops.def("gated_delta_mixer", &gated_delta_mixer, nb::arg("x"), nb::arg("weights"), nb::arg("conv_state"),
          nb::arg("recurrent_state"), nb::arg("num_key_heads"), nb::arg("num_value_heads"), nb::arg("key_head_dim"),
          nb::arg("value_head_dim"), nb::arg("eps"),
          "(out, conv_state, recurrent_state) of one Gated DeltaNet mixer; weights: in_proj_qkv, in_proj_z, "
          "in_proj_b, in_proj_a, out_proj (quantized), conv1d [conv_dim, Kc], dt_bias, A_log, norm");
  ops.def("attention_mixer", &attention_mixer, nb::arg("x"), nb::arg("weights"), nb::arg("k_cache"),
          nb::arg("v_cache"), nb::arg("num_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
          nb::arg("partial_rotary_factor"), nb::arg("rope_theta"), nb::arg("eps"),
          "(out, k_cache, v_cache) of one gated attention mixer; weights: q_proj, k_proj, v_proj, o_proj "
          "(quantized), q_norm, k_norm");
  ops.def("mtp_head", &mtp_head, nb::arg("hidden"), nb::arg("next"), nb::arg("weights"), nb::arg("k_cache"),
          nb::arg("v_cache"), nb::arg("num_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
          nb::arg("partial_rotary_factor"), nb::arg("rope_theta"), nb::arg("eps"), nb::arg("top_k"),
          nb::arg("norm_topk_prob"),
          "(out [R, H] after mtp.norm, k_cache, v_cache) of the MTP head over rows of the trunk's normed hidden\n"
          "state and the next token; weights: embed_tokens, fc (quantized), pre_fc_norm_embedding,\n"
          "pre_fc_norm_hidden, norm, input_layernorm, post_attention_layernorm, and attention_mixer's and\n"
          "moe_block's");
  ops.def("parallel_ranges", &parallel_ranges, nb::arg("n"), nb::arg("item_work"),
          "the sorted (begin, end, on_calling_thread) ranges of one parallel_for over n items");
  ops.def("parallel_chunks", &parallel_chunks, nb::arg("n"), nb::arg("item_work"),
          "chunks a parallel_for over n items of item_work units is cut into (1: inline)");
  ops.def("parallel_jobs", &parallel_jobs, "loops handed to the worker threads so far");
  ops.attr("min_chunk_work") = kMinChunkWork;
}

}  // namespace lily
