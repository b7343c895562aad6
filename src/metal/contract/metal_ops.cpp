#include "contract/metal_ops.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

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

}  // namespace lily::metal_ops
