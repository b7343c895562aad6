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

}  // namespace lily::metal_ops
