#include "qmatmul/qmatmul_decode.h"

#include <algorithm>

#include "qmatmul/qmatmul_decode_fma.cuh"
#include "qmatmul/qmatmul_decode_mma.cuh"

namespace lily::cuda {
namespace {

constexpr int kWarps = 8;

// Warps stride over groups of R rows (so the x staging is paid once per block); each
// lane holds U chunks of each row per tile step. The first tile is loaded before the
// wait on the previous kernel, the next tile while the current one is consumed.
template <int BITS, int R, int U>
__global__ void __launch_bounds__(kWarps * 32) qmatmul_decode_fma_kernel(QMat W, XSpec X, YSpec Y, const int* halt) {
  extern __shared__ float4 smem[];
  const FmaStage st = fma_stage<BITS>(smem, W.cols);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_groups = (W.rows + R - 1) / R;
  auto W_of = [&](int) -> const QMat& { return W; };
  auto rows_of = [&](int g, int (&row)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) row[r] = min(g * R + r, W.rows - 1);
  };
  RowWalk<BITS, R, U> walk(blockIdx.x * kWarps + warp, gridDim.x * kWarps, n_groups, W.chunks());
  walk.prefetch(W_of, rows_of, lane);
  if (wait_halted(halt, X.mode == XMode::EmbedRmsNorm)) return;
  stage_x<BITS>(X, W.cols, st);
  walk.run(W_of, rows_of, st.xs, st.xsum, lane, [&](int g, const float (&acc)[1][R]) {
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (g * R + r < W.rows) {
          if (Y.mode == YMode::Add) Y.y[g * R + r] += acc[0][r];
          else Y.y[g * R + r] = acc[0][r];
        }
    }
  });
  timeline_done();
}

// Tensor-core path (tiled 4-bit weights): a block takes 16-row blocks in turn, its WARPS
// warps split the groups (GPW each) and meet in shared memory; the next row block's tiles
// are loaded while this one is computed, the first before the wait on the previous kernel.
// Two blocks of 8 warps or one of 16 fill a multiprocessor. T x rows share every tile
// (qmatmul_decode_mma.cuh: MmaRows), each summed exactly as alone.
template <int WARPS, int GPW, int T>
__global__ void __launch_bounds__(WARPS * 32, 16 / WARPS) qmatmul_decode_mma_kernel(QMat W, XSpec X, YSpec Y, const int* halt) {
  extern __shared__ uint4 smem_u4[];
  const int G = W.cols / 64, n_rb = (W.rows + 15) / 16;
  const MmaStage st = mma_stage(smem_u4, W.cols, T);
  __shared__ float red[2][T * WARPS][16];
  const int lane = threadIdx.x & 31, g0 = (threadIdx.x >> 5) * GPW;
  const int t_out = T == 1 ? 0 : threadIdx.x >> 4, r_out = threadIdx.x & 15;  // the output row of threads < 16 T
  int rb = blockIdx.x;
  MmaTiles<GPW> next;
  if (rb < n_rb) next.load(W, rb, g0, G, lane);
  // The residual of the first row block, read before the wait (qmatmul_decode.h says why that is safe):
  // its round trip leaves the kernel's tail.
  const int row0 = rb * 16 + r_out;
  const bool out0 = threadIdx.x < 16 * T && row0 < W.rows;
  const float resid0 = Y.mode == YMode::Add && out0 ? __ldcg(Y.y + static_cast<size_t>(t_out) * W.rows + row0) : 0.0f;
  if (wait_halted(halt, X.mode == XMode::EmbedRmsNorm)) return;
  stage_x_mma<T>(X, W.cols, st);
  const MmaRows xr = mma_rows<T>(st, W.cols, lane);
  timeline_mark(0);
  for (int it = 0; rb < n_rb; rb += gridDim.x, ++it) {
    const MmaTiles<GPW> cur = next;
    if (rb + static_cast<int>(gridDim.x) < n_rb) next.load(W, rb + gridDim.x, g0, G, lane);
    float y0 = 0.0f, y1 = 0.0f;
    cur.accumulate(g0, G, g0, xr.xf, xr.xsum, lane, y0, y1);
    if (it == 0) timeline_mark(1);
    const float y = reduce_rows16<T>(red[it & 1], y0, y1);
    const int row = rb * 16 + r_out;
    if (threadIdx.x < 16 * T && row < W.rows) {
      float* dst = Y.y + static_cast<size_t>(t_out) * W.rows + row;
      if (Y.mode == YMode::Add) *dst = (it == 0 ? resid0 : *dst) + y;
      else *dst = y;
    }
  }
  timeline_done();
}

template <int WARPS, int GPW, int T>
void launch_qmatmul_decode_mma(const QMat& W, const XSpec& X, const YSpec& Y, const int* halt, cudaStream_t stream) {
  auto kernel = qmatmul_decode_mma_kernel<WARPS, GPW, T>;
  const size_t smem = stage_mma_bytes(W.cols, T);
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), std::max<size_t>(smem, 64 * 1024), "qmatmul_decode: set smem");
  static const int blocks_per_sm = [&] {
    int n = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, WARPS * 32, std::max<size_t>(smem, 24 * 1024)),
          "qmatmul_decode: occupancy");
    return std::max(n, 1);
  }();
  const int n_rb = (W.rows + 15) / 16;
  const int grid = std::min(n_rb, blocks_per_sm * sm_count());
  launch("qmatmul_decode (tensor cores)", kernel, dim3(grid), dim3(WARPS * 32), smem, stream, W, X, Y, halt);
}

template <int BITS, int R, int U>
void launch_qmatmul_decode_fma(const QMat& W, const XSpec& X, const YSpec& Y, const int* halt, cudaStream_t stream) {
  auto kernel = qmatmul_decode_fma_kernel<BITS, R, U>;
  const size_t smem = stage_bytes<BITS>(W.cols);
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), 64 * 1024, "qmatmul_decode: set smem");
  static const int blocks_per_sm = [&] {
    int n = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kWarps * 32, 24 * 1024), "qmatmul_decode: occupancy");
    return std::max(n, 1);
  }();
  const int groups = (W.rows + R - 1) / R;
  const int grid = std::min((groups + kWarps - 1) / kWarps, blocks_per_sm * sm_count());
  launch("qmatmul_decode", kernel, dim3(grid), dim3(kWarps * 32), smem, stream, W, X, Y, halt);
}

// Rows per warp: enough warps for every multiprocessor first (R*U <= 8 tile registers).
template <int BITS, int U>
void pick_rows(const QMat& W, const XSpec& X, const YSpec& Y, const int* halt, cudaStream_t stream) {
  const int target = 16 * sm_count();
  if constexpr (U <= 2) {
    if (W.rows >= 4 * target) return launch_qmatmul_decode_fma<BITS, 4, U>(W, X, Y, halt, stream);
  }
  if (W.rows >= 2 * target) launch_qmatmul_decode_fma<BITS, 2, U>(W, X, Y, halt, stream);
  else launch_qmatmul_decode_fma<BITS, 1, U>(W, X, Y, halt, stream);
}

// Chunks per lane: one tile step covers a whole row when it has <= 128 chunks.
template <int BITS>
void pick_tile(const QMat& W, const XSpec& X, const YSpec& Y, const int* halt, cudaStream_t stream) {
  const int chunks = W.chunks();
  if (chunks <= 32) pick_rows<BITS, 1>(W, X, Y, halt, stream);
  else if (chunks <= 64) pick_rows<BITS, 2>(W, X, Y, halt, stream);
  else pick_rows<BITS, 4>(W, X, Y, halt, stream);
}

}  // namespace

size_t qmatmul_decode_smem_bytes(const QMat& W, int rows) {
  return W.tiled ? stage_mma_bytes(W.cols, rows) : W.bits == 4 ? stage_bytes<4>(W.cols, rows) : stage_bytes<8>(W.cols, rows);
}

void qmatmul_decode(const QMat& W, const XSpec& X, const YSpec& Y, const int* halt, cudaStream_t stream, int rows) {
  if (W.cols % 32 != 0 || W.cols > 12288) fail("qmatmul_decode: cols ", std::to_string(W.cols), " must be a multiple of 32, <= 12288");
  if (rows > 1 && !W.tiled) fail("qmatmul_decode: ", std::to_string(rows), " x rows need tiled (tensor-core) weights");
  if (W.tiled) {
    // Both block shapes take the same widths: 8 groups of 64 columns a warp of 8.
    if (W.cols > 8 * 64 * kWarps)
      fail("qmatmul_decode: tiled weights with ", std::to_string(W.cols), " columns (more than ", std::to_string(8 * 64 * kWarps),
           ") are not supported");
    // One row block per multiprocessor or fewer (the out-projections): a block of 16 warps,
    // twice the loads in flight behind each multiprocessor's tiles.
    const bool wide = (W.rows + 15) / 16 <= sm_count();
    with_step_rows("qmatmul_decode", rows, [&](auto t) {
      if (wide)
        with_groups_per_warp(W.cols, 16, "qmatmul_decode", [&](auto gpw) { launch_qmatmul_decode_mma<16, gpw, t>(W, X, Y, halt, stream); });
      else
        with_groups_per_warp(W.cols, kWarps, "qmatmul_decode", [&](auto gpw) { launch_qmatmul_decode_mma<kWarps, gpw, t>(W, X, Y, halt, stream); });
    });
  } else if (W.bits == 4) pick_tile<4>(W, X, Y, halt, stream);
  else if (W.bits == 8) pick_tile<8>(W, X, Y, halt, stream);
  else fail("qmatmul_decode: ", std::to_string(W.bits), "-bit weights are not supported (4 or 8)");
}

}  // namespace lily::cuda
