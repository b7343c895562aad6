// _lily.quantize / _lily.dequantize: numpy access to the MLX affine quantizer (quant.h).
// Used by lily.quant, the synthetic checkpoint writer, and the tests that compare lily's
// quantizer with mx.quantize bit for bit. bf16 scales/biases travel as float32 arrays
// holding bf16 values, so callers need nothing beyond numpy.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/tuple.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "bf16.h"
#include "bindings.h"
#include "error.h"
#include "quant.h"

namespace nb = nanobind;

namespace lily {
namespace {

using InArray = nb::ndarray<nb::ro>;
template <typename T>
using OutArray = nb::ndarray<nb::numpy, T>;

std::string shape_str(const InArray& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

template <typename T>
const char* type_name() {
  return std::is_same_v<T, float> ? "float32" : "uint32";
}

// Checks that `a` is a C-contiguous CPU array of T with at least one dimension.
template <typename T>
void check_array(const InArray& a, const char* param) {
  if (a.device_type() != nb::device::cpu::value) fail(param, " must be a CPU array");
  if (a.dtype() != nb::dtype<T>()) fail(param, " must have dtype ", type_name<T>());
  if (a.ndim() < 1) fail(param, " must have at least one dimension");
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) fail(param, " must be C-contiguous");
    expected *= static_cast<int64_t>(a.shape(i));
  }
}

void check_spec(int group_size, int bits) {
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8, got ", std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    fail("group_size must be 32, 64 or 128, got ", std::to_string(group_size));
}

std::vector<size_t> shape_of(const InArray& a) { return {a.shape_ptr(), a.shape_ptr() + a.ndim()}; }

// Shape of `a` with the last dimension replaced by `last`.
std::vector<size_t> with_last(const InArray& a, size_t last) {
  std::vector<size_t> s = shape_of(a);
  s.back() = last;
  return s;
}

size_t leading_rows(const InArray& a) {
  size_t n = 1;
  for (size_t i = 0; i + 1 < a.ndim(); ++i) n *= a.shape(i);
  return n;
}

// A new numpy array that owns its buffer; `data` points at it for filling.
template <typename T>
OutArray<T> new_array(const std::vector<size_t>& shape, T*& data) {
  size_t n = 1;
  for (size_t d : shape) n *= d;
  std::unique_ptr<T[]> buf(new T[n ? n : 1]);
  nb::capsule owner(buf.get(), [](void* p) noexcept { delete[] static_cast<T*>(p); });
  data = buf.release();
  return OutArray<T>(data, shape.size(), shape.data(), owner);
}

nb::tuple quantize(const InArray& w, int group_size, int bits) {
  check_spec(group_size, bits);
  check_array<float>(w, "w");
  const size_t K = w.shape(w.ndim() - 1), rows = leading_rows(w);
  if (K == 0 || K % group_size)
    fail("w's last dimension (", std::to_string(K), ") must be a positive multiple of group_size (",
         std::to_string(group_size), ")");
  const size_t groups = K / group_size, words = K * bits / 32;

  uint32_t* codes;
  float *scales, *biases;
  OutArray<uint32_t> codes_arr = new_array(with_last(w, words), codes);
  OutArray<float> scales_arr = new_array(with_last(w, groups), scales);
  OutArray<float> biases_arr = new_array(with_last(w, groups), biases);

  const float* src = static_cast<const float*>(w.data());
  std::vector<float> rounded(rows * K);
  std::vector<uint16_t> scales_bf16(rows * groups), biases_bf16(rows * groups);
  {
    nb::gil_scoped_release release;
    // mx.quantize sees bf16 weights; a value that is not finite in bf16 has no code.
    for (size_t i = 0; i < rounded.size(); ++i) {
      rounded[i] = round_bf16(src[i]);
      if (!std::isfinite(rounded[i]))
        fail("w holds a value that is not finite in bfloat16 (", std::to_string(src[i]), " at flat index ",
             std::to_string(i), ")");
    }
    affine_quantize(rounded.data(), rows, K, group_size, bits, codes, scales_bf16.data(), biases_bf16.data());
    for (size_t i = 0; i < scales_bf16.size(); ++i) {
      scales[i] = bf16_to_float(scales_bf16[i]);
      biases[i] = bf16_to_float(biases_bf16[i]);
    }
  }
  return nb::make_tuple(codes_arr, scales_arr, biases_arr);
}

OutArray<float> dequantize(const InArray& codes, const InArray& scales, const InArray& biases, int group_size,
                           int bits) {
  check_spec(group_size, bits);
  check_array<uint32_t>(codes, "codes");
  check_array<float>(scales, "scales");
  check_array<float>(biases, "biases");
  if (scales.ndim() != codes.ndim())
    fail("scales has shape ", shape_str(scales), " but codes has shape ", shape_str(codes),
         "; they must have the same number of dimensions");
  for (size_t i = 0; i + 1 < codes.ndim(); ++i)
    if (scales.shape(i) != codes.shape(i))
      fail("scales has shape ", shape_str(scales), " but codes has shape ", shape_str(codes),
           "; all but the last dimension must agree");
  if (shape_of(biases) != shape_of(scales))
    fail("biases has shape ", shape_str(biases), " but scales has shape ", shape_str(scales), "; they must match");
  const size_t words = codes.shape(codes.ndim() - 1), groups = scales.shape(scales.ndim() - 1);
  const size_t K = groups * group_size;
  if (words * 32 != K * bits)
    fail("codes' last dimension (", std::to_string(words), ") does not fit scales' last dimension (",
         std::to_string(groups), "): expected ", std::to_string(K * bits / 32), " words for ", std::to_string(K),
         " values at ", std::to_string(bits), " bits, group_size ", std::to_string(group_size));

  float* out;
  OutArray<float> out_arr = new_array(with_last(codes, K), out);
  const size_t rows = leading_rows(codes);
  const auto* q = static_cast<const uint32_t*>(codes.data());
  const auto* s = static_cast<const float*>(scales.data());
  const auto* b = static_cast<const float*>(biases.data());
  {
    nb::gil_scoped_release release;
    // mx.dequantize on bf16 scales computes in bf16: the product scale*q is rounded to
    // bf16 before the bias is added, and the sum is rounded again. Matching that (not a
    // single fp32 rounding) is what makes the result bit-identical.
    const uint32_t mask = (1u << bits) - 1;
    const size_t per_word = 32 / bits;
    for (size_t r = 0; r < rows; ++r)
      for (size_t k = 0; k < K; ++k) {
        const size_t g = r * groups + k / group_size;
        const uint32_t code = (q[r * words + k / per_word] >> (bits * (k % per_word))) & mask;
        const float product = round_bf16(round_bf16(s[g]) * static_cast<float>(code));
        out[r * K + k] = round_bf16(product + round_bf16(b[g]));
      }
  }
  return out_arr;
}

}  // namespace

void register_quant(nb::module_& m) {
  m.def("quantize", &quantize, nb::arg("w"), nb::arg("group_size") = 64, nb::arg("bits") = 4,
        "MLX affine quantization of w (float32 [..., K], rounded to bf16 first).\n"
        "Returns (codes uint32 [..., K*bits/32], scales float32 [..., K/group_size], biases float32);\n"
        "scales and biases hold bf16 values. Bit-identical to mx.quantize on bf16 input.");
  m.def("dequantize", &dequantize, nb::arg("codes"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size") = 64, nb::arg("bits") = 4,
        "Inverse of quantize: float32 [..., K] holding the bf16 values mx.dequantize returns\n"
        "for bf16 scales and biases (scales/biases are rounded to bf16 first).");
}

}  // namespace lily
