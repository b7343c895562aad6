// Hopper warpgroup MMA (wgmma.mma_async, sm_90a): shared-memory matrix descriptors and
// the instruction forms lily's wgmma kernels use (flash attention, qmatmul_prefill_wgmma). A warpgroup = 4
// consecutive warps (128 threads, warp index / 4 equal) that issue each call together.
//
// Facts of the PTX ISA ("Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
//  * Descriptor (64 bits, "Matrix Descriptor Format"): bits 0-13 start address >> 4,
//    16-29 leading-dimension byte offset (LBO) >> 4, 32-45 stride-dimension byte offset
//    (SBO) >> 4, 49-51 base offset (0 when every swizzle pattern starts 1024-byte
//    aligned, as here), 62-63 swizzle: 0 none, 1 = 128B, 2 = 64B, 3 = 32B.
//  * 128B swizzle, bf16 (T = 8 elements = 16 bytes), canonical layouts in elements:
//      K-major  ((8,m),(T,2k)) : ((8T,SBO),(1,T))       row r, column c (c < 64 per row):
//               byte = 128 (r % 8) + SBO (r / 8) + 2 c; LBO unused ("assumed 1");
//      MN-major ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO))   mn index n, k index k:
//               byte = 2 (n % 64) + LBO (n / 64) + 128 (k % 8) + SBO (k / 8);
//    then the swizzle (Swizzle<3,4,3> on the byte address): bits 4-6 ^= bits 7-9, i.e.
//    16-byte chunk j of a 128-byte row r sits at chunk j ^ (r % 8) of a 1024-byte atom.
//  * A K-step of 16 inside a 128-byte K-major row is the start address + 32 bytes (the
//    swizzle is applied to the final address, so the row's XOR pattern still holds).
//  * Register fragments, warp w = (thread % 128) / 32, gid = lane / 4, t = lane % 4:
//      A (m64 x k16 bf16, 4 x .b32): reg 0 = (row 16w+gid,   k 2t, 2t+1), reg 1 = (row +8, k 2t..),
//                                    reg 2 = (row 16w+gid, k 2t+8, 2t+9), reg 3 = (row +8, k 2t+8..)
//      D (m64 x nN f32, N/2 regs):   d[4i + 2h + e] = (row 16w + gid + 8h, column 8i + 2t + e)
//    (per warp, the mma.sync m16n8k16 A and C fragments; D repeats them over N/8 column tiles).
//  * wgmma.fence before the first mma_async and after registers it reads (A, D) were
//    written; commit_group closes a group; wait_group N blocks until at most N groups
//    are pending. D and register A must not be touched before the wait covering them.
//    Shared memory written by the generic proxy (st.shared, cp.async) must be made
//    visible to the async proxy with fence.proxy.async before a wgmma reads it.
#pragma once
#include <cstdint>

namespace lily::cuda {

constexpr int kSwizzleRowBytes = 128;   // one row of a 128B-swizzle atom
constexpr int kSwizzleAtomBytes = 1024; // 8 rows: the period of the XOR pattern

// Tiles of bf16 rows whose length is a multiple of 64 (kernels here: 256) are stored as
// panels of 64 columns (128-byte rows; panel p at p * rows * 128 bytes) in the 128B-swizzle
// canonical layout, the tile base 1024-byte aligned. Byte offset of 16-byte chunk c
// (columns 8c .. 8c+7) of row r:
__host__ __device__ constexpr uint32_t sw128_chunk_offset(int rows, int r, int c) {
  return (c / 8) * rows * kSwizzleRowBytes + r * kSwizzleRowBytes + (((c % 8) ^ (r % 8)) << 4);
}
// Start of K-step ks (columns 16ks .. 16ks+15) of such a tile read K-major.
__host__ __device__ constexpr uint32_t sw128_kstep_offset(int rows, int ks) {
  return (ks / 4) * rows * kSwizzleRowBytes + (ks % 4) * 32;
}

// A 128B-swizzle descriptor; `lbo`, `sbo` in bytes (multiples of 16).
__host__ __device__ constexpr uint64_t wgmma_desc_sw128(uint32_t start, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((start >> 4) & 0x3FFFu) | static_cast<uint64_t>((lbo >> 4) & 0x3FFFu) << 16 |
         static_cast<uint64_t>((sbo >> 4) & 0x3FFFu) << 32 | 1ull << 62;
}

// K-major tile with 128-byte rows: LBO unused (encoded 1), SBO one 8-row atom.
__host__ __device__ constexpr uint64_t wgmma_desc_kmajor_sw128(uint32_t start) {
  return wgmma_desc_sw128(start, 16, kSwizzleAtomBytes);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// This thread's generic-proxy shared-memory writes (cp.async included) become visible to
// wgmma operand reads (async proxy); then a barrier publishes them to the warpgroup.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pins accumulator registers at this point of the program: the compiler may not move
// their reads or writes across it (they change asynchronously between mma_async and
// wait_group, which the compiler does not know).
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for register A fragments: an in-flight wgmma still reads them, so they must
// stay live (not be reallocated) until the wait that covers it.
template <int N>
__device__ __forceinline__ void wgmma_hold(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// The accumulator operands of one wgmma: the registers "%0,...,%(n-1)" and the matching
// "+f"(d[i]) constraints (#undef'd below).
#define LILY_WGMMA_R32 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define LILY_WGMMA_R64 LILY_WGMMA_R32 ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define LILY_WGMMA_R128 LILY_WGMMA_R64 ",%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
  "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
  "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
#define LILY_WGMMA_D8(i)                                                                                       \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define LILY_WGMMA_D32(i) LILY_WGMMA_D8(i), LILY_WGMMA_D8(i + 8), LILY_WGMMA_D8(i + 16), LILY_WGMMA_D8(i + 24)
#define LILY_WGMMA_D64 LILY_WGMMA_D32(0), LILY_WGMMA_D32(32)
#define LILY_WGMMA_D128 LILY_WGMMA_D64, LILY_WGMMA_D32(64), LILY_WGMMA_D32(96)

// D (64 x N fp32) = A (64 x 16) * B (16 x N) + (accumulate ? D : 0): A and B bf16 in
// shared memory, K-major (imm-trans 0), scale-a = scale-b = 1.
template <int N>
__device__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate);
template <>
__device__ __forceinline__ void wgmma_ss<64>(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" LILY_WGMMA_R32
               "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : LILY_WGMMA_D32(0)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate)
               : "memory");
}
template <>
__device__ __forceinline__ void wgmma_ss<128>(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" LILY_WGMMA_R64
               "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : LILY_WGMMA_D64
               : "l"(desc_a), "l"(desc_b), "r"(accumulate)
               : "memory");
}
template <>
__device__ __forceinline__ void wgmma_ss<256>(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" LILY_WGMMA_R128
               "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
               : LILY_WGMMA_D128
               : "l"(desc_a), "l"(desc_b), "r"(accumulate)
               : "memory");
}

// D (64 x 256 fp32) += A (64 x 16, registers) * B (16 x 256, shared, MN-major: imm-trans-b = 1).
__device__ __forceinline__ void wgmma_m64n256k16_rs_tb(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" LILY_WGMMA_R128
               "}, {%128,%129,%130,%131}, %132, 1, 1, 1, 1;\n"
               : LILY_WGMMA_D128
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b)
               : "memory");
}

#undef LILY_WGMMA_R32
#undef LILY_WGMMA_R64
#undef LILY_WGMMA_R128
#undef LILY_WGMMA_D8
#undef LILY_WGMMA_D32
#undef LILY_WGMMA_D64
#undef LILY_WGMMA_D128

}  // namespace lily::cuda
