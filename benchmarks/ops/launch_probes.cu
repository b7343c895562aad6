// Probes of the fixed cost of one dependent decode kernel (docs/perf-log.md P4: every
// decode kernel costs ~5-7 µs whatever it reads). Read the "warm" column: a graph of
// back-to-back launches with PDL, the way a decode step chains its kernels.
//   empty          griddepcontrol.wait + launch_dependents: the launch-to-launch floor
//   stage x        + RMSNorm of the hidden state staged for the tensor cores, as every
//                  qmatmul_decode does after its wait (an L2 read of h, a block reduction, the norm weights);
//                  then its loads and block sum alone, its loads alone, and the staging a
//                  kernel would do if its producer had written x already in the fragment
//                  layout with per-16-row partial group sums and sums of squares (perf-log 9):
//                  8 KB into shared memory, the group sums, 1/rms per warp, one barrier
//   qmatmul_decode, k row blocks per block: + k serial 16-row tiles of 2048 columns per block (one ahead)
//   chain of 21 gemvs, released by griddepcontrol.wait / by a counter: 21 dependent
//                  gemvs of 1 row block per block (each reads the previous one's output as
//                  x); the second releases each kernel when every block of its predecessor
//                  has added 1 to a counter (fence, atomic; thread 0 polls it) instead of
//                  waiting for the predecessor's completion. Per kernel: the µs / 21
#include "bench.h"
#include "common/device_common.cuh"
#include "qmatmul/qmatmul_decode.h"
#include "common/grid_barrier.cuh"
#include "qmatmul/qmatmul_decode_mma.cuh"
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

// Parts of the x staging: 0 the whole stage_x_mma, 1 its loads of x and the norm weight
// and the block sum of squares, 2 the loads alone; 3 x pre-staged by its producer:
// X.x holds the fragments [cols floats' worth], then partial group sums [cols / 16] (one
// per 16 rows of the producer), then partial sums of squares [cols / 16].
template <int PART>
__global__ void __launch_bounds__(kThreads) stage_kernel(XSpec X, int cols, float* sink) {
  extern __shared__ uint4 smem_u4[];
  const MmaStage st = mma_stage(smem_u4, cols);
  uint4* const xf = st.xf;
  float *const xsum = st.xsum, *const raw = st.raw;
  pdl_wait();
  if constexpr (PART == 0) {
    stage_x_mma(X, cols, st);
    if (threadIdx.x == 0) sink[blockIdx.x] = xsum[0];
  } else if constexpr (PART == 3) {
    // Every load first (unrolled, cols <= 2048 at 256 threads), so they share one L2 round trip.
    constexpr int kFrag = 2, kSs = 4;  // 2048 columns at 256 threads (add_probe_ops launches kH)
    static_assert(kH <= 2048, "the pre-staged probe's unrolled loads cover 2048 columns");
    const uint4* frag = reinterpret_cast<const uint4*>(X.x);
    const float *gpart = X.x + cols, *sspart = gpart + cols / 16;
    uint4 fr[kFrag];
    float sp[kSs];
#pragma unroll
    for (int j = 0; j < kFrag; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      fr[j] = i < cols / 4 ? __ldcg(frag + i) : make_uint4(0, 0, 0, 0);
    }
    const float gp = threadIdx.x < cols / 16 ? __ldcg(gpart + threadIdx.x) : 0.0f;
#pragma unroll
    for (int j = 0; j < kSs; ++j) {
      const int i = (threadIdx.x & 31) + 32 * j;
      sp[j] = i < cols / 16 ? fabsf(__ldcg(sspart + i)) : 0.0f;  // random inputs: keep it finite
    }
#pragma unroll
    for (int j = 0; j < kFrag; ++j)
      if (threadIdx.x + j * blockDim.x < cols / 4) xf[threadIdx.x + j * blockDim.x] = fr[j];
    const float g = quad_sum(gp);  // 4 parts a group
    if (threadIdx.x < cols / 16 && threadIdx.x % 4 == 0) xsum[threadIdx.x / 4] = g;
    const float inv = rsqrtf(warp_sum(sp[0] + sp[1] + sp[2] + sp[3]) / cols + X.eps);  // every warp its own 1/rms
    __syncthreads();
    if (threadIdx.x == 0) sink[blockIdx.x] = xsum[0] * inv + __uint_as_float(xf[cols / 8].x);
  } else {
    float ss = 0.0f;
    for (int f = threadIdx.x; f < cols / 4; f += blockDim.x) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(X.x) + f), w = reinterpret_cast<const float4*>(X.w)[f];
      ss += v.x * v.x * w.x + v.y * v.y * w.y + v.z * v.z * w.z + v.w * v.w * w.w;
    }
    if (PART == 1) ss = block_sum(ss, raw);
    if (threadIdx.x == 0 || PART == 2) sink[blockIdx.x * blockDim.x + threadIdx.x] = ss;
  }
  pdl_trigger();
}

int probe_grid() { return 2 * sm_count(); }  // the decode GEMVs' grid: two blocks per multiprocessor

// Kernel i > 0 of a chain polls c[(i - 1) % 3] until it holds `target` (its predecessor's
// blocks; kernel 0 waits with griddepcontrol.wait), adds 1 to c[i % 3] at the end of
// each block, and its block 0 zeroes c[(i + 1) % 3]: the counter kernel i - 1 polled
// (every block of it got past its poll before kernel i was released) and kernel i + 1
// fills after polling c[i % 3]. The polls spin without a pause.
struct ChainLink {
  const unsigned* wait_on = nullptr;  // null: griddepcontrol.wait
  unsigned target = 0;
  unsigned* signal = nullptr;  // null: no counter
  unsigned* reset = nullptr;
};

// A multiple of 3: the last kernel zeroes c[0], which the next chain's kernel 0 fills
// without zeroing it first.
constexpr int kChain = 21;

__global__ void __launch_bounds__(kThreads) chain_gemv_kernel(QMat W, XSpec X, float* y, ChainLink link) {
  constexpr int kGpw = 4;  // 2048 columns over 8 warps
  extern __shared__ uint4 smem_u4[];
  const MmaStage st = mma_stage(smem_u4, W.cols);
  __shared__ float red[kThreads / 32][16];
  const int lane = threadIdx.x & 31, G = W.cols / 64, g0 = (threadIdx.x >> 5) * kGpw;
  MmaTiles<kGpw> tiles;
  tiles.load(W, blockIdx.x, g0, G, lane);
  if (link.wait_on) {
    if (threadIdx.x == 0)
      while (ld_acquire(link.wait_on) < link.target) {
      }
    __syncthreads();
  } else {
    pdl_wait();
  }
  if (link.reset && blockIdx.x == 0 && threadIdx.x == 0) st_relaxed(link.reset, 0u);
  stage_x_mma(X, W.cols, st);
  float y0 = 0.0f, y1 = 0.0f;
  tiles.accumulate(g0, G, g0, st.xf, st.xsum, lane, y0, y1);
  const float v = reduce_rows16(red, y0, y1);
  if (threadIdx.x < 16) y[blockIdx.x * 16 + threadIdx.x] = v;
  pdl_trigger();
  if (link.signal) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(link.signal, 1u);
    }
  }
}

}  // namespace

void add_probe_ops(std::vector<Op>& ops) {
  ops.push_back({"probe: empty dependent kernel", std::to_string(kThreads) + " threads x 2 per SM", 0, 0,
                 [](Arena& A) -> Launch {
                   float* sink = A.zeros<float>(1);
                   return [=](cudaStream_t s) {
                     launch("probe empty", empty_kernel, dim3(probe_grid()), dim3(kThreads), 0, s, sink);
                   };
                 }});
  const char* stage_names[] = {"probe: stage x (RMSNorm, tensor-core layout)", "probe: stage x, its loads and block sum only",
                                "probe: stage x, its loads only", "probe: stage x pre-staged by its producer"};
  auto stage_kernels = {stage_kernel<0>, stage_kernel<1>, stage_kernel<2>, stage_kernel<3>};
  int part = 0;
  for (auto kernel : stage_kernels) {
    const double bytes = part == 3 ? (kH + kH / 8) * 4.0 : kH * 8.0;  // x and its norm weight; fragments and partials
    ops.push_back({stage_names[part++], dims(1, kH), bytes, 0, [=](Arena& A) -> Launch {
                     const XSpec X = rmsnorm_of(A, A.normal(kH + kH / 8));  // PART 3 reads past the kH values
                     float* sink = A.zeros<float>(probe_grid() * kThreads);
                     return [=](cudaStream_t s) {
                       launch("probe stage", kernel, dim3(probe_grid()), dim3(kThreads), stage_mma_bytes(kH), s, X, kH,
                              sink);
                     };
                   }});
  }
  for (int per_block : {1, 2, 3}) {
    const int rows = 16 * per_block * 264;  // an H200's decode grid; other cards get other splits
    ops.push_back({"probe: qmatmul_decode +rmsnorm, " + std::to_string(per_block) + " row block(s) per block", dims(rows, kH),
                   qbytes(rows, kH, 4) + kH * 8.0 + rows * 4.0, 2.0 * rows * kH, [=](Arena& A) -> Launch {
                     const XSpec X = rmsnorm_of(A, A.normal(kH));
                     const QMat W = A.qmat(rows, kH, 4, true);
                     const YSpec Y{YMode::Store, A.normal(rows)};
                     return [=](cudaStream_t s) { qmatmul_decode(W, X, Y, nullptr, s); };
                   }});
  }
  for (bool counter : {false, true}) {
    const int rows = 16 * 264;  // as above
    ops.push_back({"probe: chain of " + std::to_string(kChain) + " gemvs, released by " + (counter ? "a counter" : "griddepcontrol.wait"),
                   dims(rows, kH) + " x " + std::to_string(kChain), kChain * (qbytes(rows, kH, 4) + kH * 8.0 + rows * 4.0),
                   kChain * 2.0 * rows * kH, [=](Arena& A) -> Launch {
                     const int grid = probe_grid();
                     const QMat W = A.qmat(16 * grid, kH, 4, true);
                     float* y[2] = {A.normal(16 * grid), A.normal(16 * grid)};
                     const XSpec X = rmsnorm_of(A, y[0]);
                     unsigned* c = A.zeros<unsigned>(3);
                     const size_t smem = stage_mma_bytes(kH);
                     allow_dynamic_smem(reinterpret_cast<const void*>(chain_gemv_kernel), smem, "probe chain");
                     return [=](cudaStream_t s) {
                       for (int i = 0; i < kChain; ++i) {
                         XSpec Xi = X;
                         Xi.x = y[(i + 1) % 2];
                         ChainLink link;
                         if (counter) {
                           link.wait_on = i == 0 ? nullptr : c + (i + 2) % 3;
                           link.target = static_cast<unsigned>(grid);
                           link.signal = c + i % 3;
                           link.reset = c + (i + 1) % 3;
                         }
                         launch("probe chain", chain_gemv_kernel, dim3(grid), dim3(kThreads), smem, s, W, Xi,
                                y[i % 2], link);
                       }
                     };
                   }});
  }
}

}  // namespace lily::bench
