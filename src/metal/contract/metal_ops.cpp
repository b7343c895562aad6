#include "contract/metal_ops.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

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

}  // namespace lily::metal_ops
