// The op registry of the benchmark binary: one entry per kernel x shape, each with the
// bytes it must move and the FLOPs it must do, and a setup that fills random inputs and
// returns the launch. The harness (harness.h) times every entry with a cold L2 and as a
// graph of back-to-back launches, against ceilings measured in the same run.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/kernel_types.h"

namespace lily::bench {

// All launches of one op on `stream` (the op's own kernels only; no synchronisation).
using Launch = std::function<void(cudaStream_t stream)>;

// Device memory of one entry, freed when the entry is done. Inputs are random (never
// zeros or NaN); zeros() is for counters that must start at zero.
class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena();

  float* normal(size_t n, float scale = 1.0f);        // fp32 N(0, scale^2)
  float* near_one(size_t n);                          // fp32 1 + N(0, 0.1^2): norm weights
  uint16_t* normal_bf16(size_t n, float scale = 1.0f);
  uint32_t* words(size_t n);                          // uniform random 32-bit words
  // A random affine matrix [rows, cols] (group 64): random codes, signed scales and
  // biases chosen so W x stays O(1) for x of RMS 1. tiled: the tensor-core tile order
  // (4-bit only; the codes are random, so no re-packing is needed).
  cuda::QMat qmat(int rows, int cols, int bits, bool tiled);
  template <typename T>
  T* zeros(size_t n) {
    return static_cast<T*>(raw(n * sizeof(T), true));
  }
  template <typename T>
  T* upload(const std::vector<T>& v) {
    T* p = static_cast<T*>(raw(v.size() * sizeof(T), false));
    copy_in(p, v.data(), v.size() * sizeof(T));
    return p;
  }

 private:
  std::vector<void*> owned_;
  uint64_t seed_ = 1;
  void* raw(size_t bytes, bool zero);
  void copy_in(void* dst, const void* src, size_t bytes);
};

struct Op {
  std::string name;   // kernel and call pattern, e.g. "qmatmul_decode gdn in_proj +rmsnorm"
  std::string shape;  // e.g. "12352x2048"
  double bytes = 0;   // each input read once + each output written once (scratch not counted)
  double flops = 0;
  std::function<Launch(Arena&)> setup;
};

// Bytes of an affine matrix [rows, cols], group 64: codes + one bf16 scale|bias pair per group.
inline double qbytes(double rows, double cols, int bits) { return rows * cols * bits / 8 + rows * (cols / 64) * 4; }

// The entries, in table order.
void add_decode_ops(std::vector<Op>& ops);        // decode_ops.cu
void add_prefill_ops(std::vector<Op>& ops);       // prefill_ops.cu
void add_prefill_gemm_ops(std::vector<Op>& ops);  // prefill_gemm_ops.cu
void add_probe_ops(std::vector<Op>& ops);         // launch_probes.cu
void add_phase_probe_ops(std::vector<Op>& ops);   // phase_probes.cu
void add_release_probe_ops(std::vector<Op>& ops); // release_probes.cu

}  // namespace lily::bench
