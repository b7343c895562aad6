// Pieces shared by the two qgemm kernels (qgemm.cu: exact affine maths; qgemm_bf16w.cu:
// bf16-rounded weights): cp.async staging, ldmatrix, the first-k-step mma, and the
// host entry of the bf16-weight kernel (qgemm() validates and dispatches to it).
#pragma once
#include <cstdint>

#include "qgemm.h"
#include "qmma.cuh"

namespace lily::cuda {

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  // src_bytes 0: nothing is read and the 16 bytes are zero-filled.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d = a · b with a fresh accumulator (the first k-step of a group).
__device__ __forceinline__ void mma_16816_first(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

__device__ __forceinline__ uint32_t kstep_word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// The true bf16 weights of A register i of k-step word `code` (nibbles as in qmma.cuh),
// s2 / b2 the row's scale / bias twice: ((code >> 4i) & 0x000F000F) | 0x43004300 is two
// bf16 128 + q (one lop3: both masks in one instruction), q = (128 + q) - 128 is exact,
// and the bf16x2 fma rounds once: w = bf16(s q + b), what MLX's kernels dequantise to.
__device__ __forceinline__ uint32_t weights_bf16x2(uint32_t code, int i, uint32_t s2, uint32_t b2) {
  uint32_t biased, q, w;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(biased) : "r"(code >> (4 * i)), "r"(0x000F000Fu), "r"(0x43004300u));
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(q) : "r"(biased), "r"(0x43004300u));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(w) : "r"(q), "r"(s2), "r"(b2));
  return w;
}

// qgemm with GemmArgs::weights_bf16 on validated arguments; blocks_y: row tiles (dense)
// or max_tiles (grouped), > 0.
void qgemm_bf16w(const GemmArgs& a, int tile_m, int blocks_y, cudaStream_t stream);

}  // namespace lily::cuda
