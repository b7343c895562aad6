// A barrier across all blocks of a grid whose blocks are all resident at once (the phase
// probes of benchmarks/ops), and the acquire / release accesses it is built from (also
// the counter chain of launch_probes.cu).
#pragma once
#include <cstdint>

namespace lily::cuda {

// Grid barrier: sync[0] counts arrivals, sync[1] is the generation. The last block
// to arrive resets the count and bumps the generation (release); the others spin on the
// generation (acquire). The count is zero again after every barrier, so a launch (or a
// graph replay) needs no reset. Thread 0 arrives for its block after a block barrier and
// a fence, so the block's writes are visible to every block that passes the barrier
// (the pattern of cooperative groups' grid sync). Split in arrive/wait so that a block
// can do work that needs no other block in between.
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned atom_add_acq_rel(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

struct GridBarrier {
  unsigned* sync;
  unsigned gen = 0;  // thread 0: the generation this block waits to see change

  __device__ void arrive() {
    __syncthreads();
    if (threadIdx.x == 0) {
      gen = ld_acquire(sync + 1);  // before arriving: it cannot change until every block arrived
      __threadfence();
      if (atom_add_acq_rel(sync, 1u) == gridDim.x - 1) {
        st_relaxed(sync, 0u);  // ordered before the release below: nobody arrives again before it
        st_release(sync + 1, gen + 1);
      }
    }
  }

  __device__ void wait() {
    if (threadIdx.x == 0) {
      for (unsigned ns = 32; ld_acquire(sync + 1) == gen; ns = min(2 * ns, 128u)) __nanosleep(ns);
      __threadfence();
    }
    __syncthreads();
  }
};

}  // namespace lily::cuda
