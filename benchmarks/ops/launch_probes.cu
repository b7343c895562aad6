// Probes of the fixed cost of one dependent decode kernel (docs/perf-log.md P4: every
// decode kernel costs ~5-7 µs whatever it reads). Read the "warm" column: a graph of
// back-to-back launches with PDL, the way a decode step chains its kernels.
//   empty          griddepcontrol.wait + launch_dependents: the launch-to-launch floor
//   stage x        + RMSNorm of the hidden state staged for the tensor cores, as every
//                  gemv does after its wait (an L2 read of h, a block reduction, the norm weights)
//   gemv, k row blocks per block: + k serial 16-row tiles of 2048 columns per block (one ahead)
#include "bench.h"
#include "device_common.cuh"
#include "gemv.h"
#include "qmma.cuh"
#include "shapes.h"

namespace lily::bench {
namespace {

using namespace lily::cuda;

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) empty_kernel(float* sink) {
  pdl_wait();
  if (threadIdx.x == 0 && blockIdx.x == 0) sink[0] += 1.0f;
  pdl_trigger();
}

__global__ void __launch_bounds__(kThreads) stage_kernel(XSpec X, int cols, float* sink) {
  extern __shared__ uint4 smem_u4[];
  const auto [xf, xsum, raw] = mma_stage(smem_u4, cols);
  pdl_wait();
  stage_x_mma(X, cols, xf, xsum, raw, raw + cols);
  if (threadIdx.x == 0) sink[blockIdx.x] = xsum[0];
  pdl_trigger();
}

int probe_grid() { return 2 * sm_count(); }  // the decode GEMVs' grid: two blocks per multiprocessor

}  // namespace

void add_probe_ops(std::vector<Op>& ops) {
  ops.push_back({"probe: empty dependent kernel", std::to_string(kThreads) + " threads x 2 per SM", 0, 0,
                 [](Arena& A) -> Launch {
                   float* sink = A.zeros<float>(1);
                   return [=](cudaStream_t s) {
                     launch("probe empty", empty_kernel, dim3(probe_grid()), dim3(kThreads), 0, s, sink);
                   };
                 }});
  ops.push_back({"probe: stage x (RMSNorm, tensor-core layout)", dims(1, kH), kH * 8.0, 0, [](Arena& A) -> Launch {
                   const XSpec X = rmsnorm_of(A, A.normal(kH));
                   float* sink = A.zeros<float>(probe_grid());
                   return [=](cudaStream_t s) {
                     launch("probe stage", stage_kernel, dim3(probe_grid()), dim3(kThreads), stage_mma_bytes(kH), s, X,
                            kH, sink);
                   };
                 }});
  for (int per_block : {1, 2, 3}) {
    const int rows = 16 * per_block * 264;  // an H200's decode grid; other cards get other splits
    ops.push_back({"probe: gemv +rmsnorm, " + std::to_string(per_block) + " row block(s) per block", dims(rows, kH),
                   qbytes(rows, kH, 4) + kH * 8.0 + rows * 4.0, 2.0 * rows * kH, [=](Arena& A) -> Launch {
                     const XSpec X = rmsnorm_of(A, A.normal(kH));
                     const QMat W = A.qmat(rows, kH, 4, true);
                     const YSpec Y{YMode::Store, A.normal(rows)};
                     return [=](cudaStream_t s) { gemv(W, X, Y, nullptr, s); };
                   }});
  }
}

}  // namespace lily::bench
