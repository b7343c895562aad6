// The MSL subset of docs/metal.md as C++20, so that src/metal's .metal files compile
// unmodified with g++ (through include/metal_stdlib): scalar and vector types, the metal::
// functions the kernels use, SIMD ops and barriers as rendezvous of the emulator's fibers
// (runtime.h), and last the address-space and function qualifiers defined away.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <type_traits>

#include "runtime.h"

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using half = _Float16;  // IEEE binary16; conversions round to nearest even

// bfloat: the high half of a float; from float by round to nearest even (NaN kept quiet).
struct bfloat {
  uint16_t bits = 0;
  bfloat() = default;
  explicit bfloat(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    bits = std::isnan(f) ? static_cast<uint16_t>((u >> 16) | 0x40) : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  explicit operator float() const { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
};

// vec<T, N>: float2..4, half2..4, int2..4, uint2..4 with .x .y .z .w, [i], elementwise
// arithmetic with vectors and scalars, and conversion between element types.
template <class T, int N> struct vec_storage;
template <class T> struct vec_storage<T, 2> { T x, y; };
template <class T> struct vec_storage<T, 3> { T x, y, z; };
template <class T> struct vec_storage<T, 4> { T x, y, z, w; };

template <class T, int N>
struct vec : vec_storage<T, N> {
  vec() : vec_storage<T, N>{} {}
  vec(T s) { for (int i = 0; i < N; ++i) (*this)[i] = s; }  // implicit: MSL broadcasts a scalar
  template <class... A, class = std::enable_if_t<sizeof...(A) == N && (N > 1)>>
  vec(A... a) : vec_storage<T, N>{static_cast<T>(a)...} {}
  template <class U>
  explicit vec(const vec<U, N>& o) { for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]); }
  T& operator[](int i) { return (&this->x)[i]; }
  const T& operator[](int i) const { return (&this->x)[i]; }
};

#define LILY_MSL_VEC_OP(op)                                                               \
  template <class T, int N> vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) {      \
    for (int i = 0; i < N; ++i) a[i] = a[i] op b[i];                                      \
    return a;                                                                             \
  }                                                                                       \
  template <class T, int N> vec<T, N> operator op(vec<T, N> a, T b) { return a op vec<T, N>(b); } \
  template <class T, int N> vec<T, N> operator op(T a, const vec<T, N>& b) { return vec<T, N>(a) op b; } \
  template <class T, int N, class B> vec<T, N>& operator op##=(vec<T, N>& a, const B& b) { return a = a op b; }
LILY_MSL_VEC_OP(+)
LILY_MSL_VEC_OP(-)
LILY_MSL_VEC_OP(*)
LILY_MSL_VEC_OP(/)
#undef LILY_MSL_VEC_OP

using float2 = vec<float, 2>;
using float3 = vec<float, 3>;
using float4 = vec<float, 4>;
using half2 = vec<half, 2>;
using half4 = vec<half, 4>;
using int2 = vec<int, 2>;
using int3 = vec<int, 3>;
using int4 = vec<int, 4>;
using uint2 = vec<uint, 2>;
using uint3 = vec<uint, 3>;
using uint4 = vec<uint, 4>;

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

template <class T> T min(T a, T b) { return b < a ? b : a; }
template <class T> T max(T a, T b) { return a < b ? b : a; }
template <class T> T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
inline float abs(float x) { return std::fabs(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float cos(float x) { return std::cos(x); }
inline float sin(float x) { return std::sin(x); }
template <class T, int N> T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; ++i) s += a[i] * b[i];
  return s;
}
// Metal's fast:: and precise:: variants; here both are the precise functions (the
// accuracy of Apple's fast-math versions is one of the things only a Mac checks).
namespace fast { using metal::exp, metal::log, metal::rsqrt, metal::sqrt, metal::cos, metal::sin; }
namespace precise { using metal::exp, metal::log, metal::rsqrt, metal::sqrt, metal::cos, metal::sin; }

template <class T, class U> T as_type(const U& v) {
  static_assert(sizeof(T) == sizeof(U), "as_type: types of different sizes");
  T t;
  std::memcpy(&t, &v, sizeof(T));
  return t;
}

// ---- SIMD ops: rendezvous of the simdgroup's lanes (runtime.h) ---------------------------

namespace detail {
using lily::metal_emu::LaneArgs;
template <class T> const T& in(const LaneArgs& l) { return *static_cast<const T*>(l.in); }
template <class T> T& out(const LaneArgs& l) { return *static_cast<T*>(l.out); }

// op's result on every lane: reduce folds the operands in lane order; shuffles read lane
// src(lane, arg), keeping their own value where `keep` says so (shuffle_up/down edges).
template <class T, class F>
T simd_reduce(const char* op, T v, std::source_location where, F) {
  T r;
  lily::metal_emu::simd_rendezvous(op, where, {&v, &r, 0}, [](const LaneArgs* l, int n) {
    T acc = in<T>(l[0]);
    for (int i = 1; i < n; ++i) acc = F{}(acc, in<T>(l[i]));
    for (int i = 0; i < n; ++i) out<T>(l[i]) = acc;
    return -1;
  });
  return r;
}
template <class T, class Src>
T simd_move(const char* op, T v, uint arg, std::source_location where, Src) {
  T r;
  lily::metal_emu::simd_rendezvous(op, where, {&v, &r, arg}, [](const LaneArgs* l, int n) {
    for (int i = 0; i < n; ++i) {
      const int s = Src{}(i, static_cast<int>(l[i].arg), n);
      if (s < 0 || s >= n) return i;
      out<T>(l[i]) = in<T>(l[s]);
    }
    return -1;
  });
  return r;
}
struct Sum { template <class T> T operator()(T a, T b) const { return a + b; } };
struct Max { template <class T> T operator()(T a, T b) const { return metal::max(a, b); } };
struct Min { template <class T> T operator()(T a, T b) const { return metal::min(a, b); } };
struct Lane { int operator()(int, int a, int) const { return a; } };
struct Xor { int operator()(int i, int a, int) const { return i ^ a; } };
struct Down { int operator()(int i, int a, int n) const { return i + a < n ? i + a : i; } };
struct Up { int operator()(int i, int a, int) const { return i - a >= 0 ? i - a : i; } };
}  // namespace detail

using Where = std::source_location;
template <class T> T simd_sum(T v, Where w = Where::current()) { return detail::simd_reduce("simd_sum", v, w, detail::Sum{}); }
template <class T> T simd_max(T v, Where w = Where::current()) { return detail::simd_reduce("simd_max", v, w, detail::Max{}); }
template <class T> T simd_min(T v, Where w = Where::current()) { return detail::simd_reduce("simd_min", v, w, detail::Min{}); }
template <class T> T simd_broadcast(T v, ushort lane, Where w = Where::current()) {
  return detail::simd_move("simd_broadcast", v, lane, w, detail::Lane{});
}
template <class T> T simd_shuffle(T v, ushort lane, Where w = Where::current()) {
  return detail::simd_move("simd_shuffle", v, lane, w, detail::Lane{});
}
template <class T> T simd_shuffle_xor(T v, ushort mask, Where w = Where::current()) {
  return detail::simd_move("simd_shuffle_xor", v, mask, w, detail::Xor{});
}
template <class T> T simd_shuffle_down(T v, ushort delta, Where w = Where::current()) {
  return detail::simd_move("simd_shuffle_down", v, delta, w, detail::Down{});
}
template <class T> T simd_shuffle_up(T v, ushort delta, Where w = Where::current()) {
  return detail::simd_move("simd_shuffle_up", v, delta, w, detail::Up{});
}

inline void threadgroup_barrier(mem_flags, Where w = Where::current()) { lily::metal_emu::barrier_rendezvous(w); }

}  // namespace metal

namespace lily::metal_emu {

// What msl_to_cpp.py turns `threadgroup T name[N];` into: the group's shared T[N].
template <class T> T& threadgroup_var(size_t index) {
  return *static_cast<T*>(threadgroup_alloc(index, sizeof(T), alignof(T)));
}

// A builtin parameter of type T from its 3-vector: uint/ushort take .x, uint2 .x .y.
template <class T> T builtin_as(Size3 v) {
  if constexpr (std::is_arithmetic_v<T>) return static_cast<T>(v.x);
  else if constexpr (sizeof(T) == 2 * sizeof(v.x)) return T(v.x, v.y);
  else return T(v.x, v.y, v.z);
}
template <class T> T builtin_as(uint32_t v) { return static_cast<T>(v); }

// A [[buffer(k)]] parameter of type T (a pointer, or a reference to one value).
template <class T> T buffer_as(void* p) {
  if constexpr (std::is_pointer_v<T>) return static_cast<T>(p);
  else return *static_cast<std::remove_reference_t<T>*>(p);
}

}  // namespace lily::metal_emu

// The address spaces mean nothing on a CPU; `kernel` marks what msl_to_cpp.py registers.
#define device
#define constant
#define thread
#define threadgroup
#define kernel
