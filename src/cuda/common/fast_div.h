// Division by a divisor fixed at launch, as a multiply-high, an add and a shift: a runtime
// integer division is ~25 instructions, which the decode kernels' per-tile bookkeeping paid
// once a tile (perf-log §20). For d >= 1 and n < 2^31 (Granlund and Montgomery's round-up
// method with s = ceil(log2 d)): n / d = (umulhi(n, m) + n) >> s, m = 2^32 (2^s - d) / d + 1.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define LILY_HD __host__ __device__ __forceinline__
#else
#define LILY_HD inline
#endif

namespace lily::cuda {

struct FastDiv {
  uint32_t d = 1, m = 1, s = 0;

  FastDiv() = default;
  explicit FastDiv(int divisor) {
    if (divisor < 1) throw std::invalid_argument("FastDiv: divisor " + std::to_string(divisor) + " is not positive");
    d = static_cast<uint32_t>(divisor);
    while ((uint64_t{1} << s) < d) ++s;
    m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << s) - d)) / d + 1);
  }

  // n / d and n % d for 0 <= n < 2^31.
  LILY_HD int div(int n) const {
    const uint32_t u = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(u, m);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(u) * m) >> 32);
#endif
    return static_cast<int>((hi + u) >> s);
  }
  LILY_HD int mod(int n, int q) const { return n - q * static_cast<int>(d); }
};

}  // namespace lily::cuda

#undef LILY_HD
