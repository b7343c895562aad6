// Standalone tests of the CUDA kernels against fp64 references (the CMake target
// lily_kernel_tests, built and run by scripts/gpu_check.sh). Usage:
//   kernel_tests [--suite NAME]
// --suite runs one suite (scripts/gpu_check.sh runs each in its own process, so a
// kernel fault in one suite does not hide the others). Kernel timings: benchmarks/ops/run.sh.
#include <cstring>

#include "test_util.h"

namespace lily::cuda::test {
void run_qmatmul_decode_tests();
void run_head_tests();
void run_qmatmul_prefill_tests();
void run_moe_prefill_tests();
void run_wgmma_tests();
void run_rows_tests();
}  // namespace lily::cuda::test

int main(int argc, char** argv) {
  using namespace lily::cuda::test;
  const char* suite = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--suite") && i + 1 < argc) suite = argv[++i];
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const struct {
    const char* name;
    void (*run)();
  } suites[] = {
      {"qmatmul_decode", run_qmatmul_decode_tests},
      {"head", run_head_tests},
      {"qmatmul_prefill", run_qmatmul_prefill_tests},
      {"moe_prefill", run_moe_prefill_tests},
      {"wgmma", run_wgmma_tests},
      {"rows", run_rows_tests},
  };
  bool found = suite == nullptr;
  try {
    for (const auto& s : suites)
      if (!suite || !std::strcmp(suite, s.name)) {
        found = true;
        s.run();
      }
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  if (!found) {
    std::printf("FAIL unknown suite %s\n", suite);
    return 1;
  }
  std::printf("\n%d failure(s)\n", g_failures);
  return g_failures ? 1 : 0;
}
