// Standalone tests of the CUDA kernels against fp64 references (built and run by
// scripts/gpu_check.sh; CMake does not build this folder). Usage:
//   kernel_tests [--long] [--bench]   (--long: attention at position 262,143)
#include <cstring>

#include "test_util.h"

namespace lily::cuda::test {
void run_gemv_moe_tests();
void run_sequence_tests(bool long_context);
void run_head_tests();
void run_kernel_bench();
}  // namespace lily::cuda::test

int main(int argc, char** argv) {
  using namespace lily::cuda::test;
  bool bench = false, long_context = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--bench")) bench = true;
    if (!std::strcmp(argv[i], "--long")) long_context = true;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  try {
    run_gemv_moe_tests();
    run_sequence_tests(long_context);
    run_head_tests();
    if (bench) run_kernel_bench();
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  std::printf("\n%d failure(s)\n", g_failures);
  return g_failures ? 1 : 0;
}
