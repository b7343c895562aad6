// Shared-memory staging of the tensor-core kernels: cp.async copies (global -> shared
// without passing through registers), their commit/wait groups and ldmatrix fragment loads.
#pragma once
#include <cstdint>

namespace lily::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared (shared address `dst`), bypassing L1. src_bytes < 16 fills the
// rest with zeros; 0 reads nothing (a row past the end of the data).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// The same into a generic pointer to shared memory, all 16 bytes or zeros.
__device__ __forceinline__ void cp_async16_or_zero(void* dst, const void* src, bool valid) {
  cp_async16(smem_addr(dst), src, valid ? 16u : 0u);
}
// 4 bytes (through L1: cp.async.cg takes 16-byte copies only), or zeros.
__device__ __forceinline__ void cp_async4_or_zero(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices from shared memory into mma fragments (lanes 8i..8i+7 give the
// row addresses of matrix i); _trans transposes each matrix (the B operand from row-major V).
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

}  // namespace lily::cuda
