// Device helpers shared by the kernels: programmatic dependent launch (PDL), warp
// reductions, bf16 packing and unpacking, streaming loads, and the launcher every op uses.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "common/cuda_check.h"
#include "common/decode_ctl.h"
#include "common/launch_options.h"

namespace lily::cuda {

// PDL: a kernel may start while its predecessor finishes. pdl_trigger() lets the next
// kernel start its own prologue; every kernel calls it only after its pdl_wait(), so when
// a kernel starts, the one launched two before it has completed. Before pdl_wait() a
// kernel may read weights and data last written two or more launches back (through L2:
// ld.global.cg), never what its direct predecessor writes. Both are no-ops when the kernel
// was launched without PDL.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

#ifdef LILY_CUDA_TIMELINE
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ bool stamp_thread() { return threadIdx.x + threadIdx.y + threadIdx.z == 0; }
__device__ __forceinline__ bool timeline_thread() { return stamp_thread() && blockIdx.x + blockIdx.y + blockIdx.z == 0; }
// Block 0's record and this block's stamp in a timeline build (set by wait_halted; null
// without a DecodeCtl or without stamps).
__device__ __forceinline__ TimelineRec*& timeline_rec() {
  __shared__ TimelineRec* rec;
  return rec;
}
__device__ __forceinline__ BlockStamp*& block_stamp() {
  __shared__ BlockStamp* stamp;
  return stamp;
}
#endif

// In a timeline build block 0 notes when it got past step j of its work (decode_ctl.h);
// otherwise nothing. Only after wait_halted.
__device__ __forceinline__ void timeline_mark(int j) {
#ifdef LILY_CUDA_TIMELINE
  if (timeline_thread() && timeline_rec()) timeline_rec()->mark[j] = globaltimer();
#endif
}

// The decode kernels' wait: the PDL wait, the trigger that lets the next kernel launch,
// then whether the decode loop has halted (a step queued after generation ended does
// nothing).
// Trigger: here rather than after the kernel's work, so the dependent launches during this
// kernel (once all of its blocks have passed their wait); its blocks take what room a
// multiprocessor has left, beside this kernel's or as they leave, and run their prologue
// (weights and other early loads, before their own wait) during this kernel's tail
// (perf-log §13). As safe as a trigger at the end: once this wait
// has returned, the kernel launched before this one has completed, so what the dependent
// reads before its wait (written two or more launches back) is final.
// Halt: halt is &DecodeCtl::halt or null. Only a step's token choice writes the flag (and
// the host, between generations), so a kernel launched two or more after it reads the
// flag before its wait (through L2), and the branch on it costs nothing after the wait.
// The kernel launched right after the token choice (the step's first, which embeds the
// token) passes after_choice and reads it after the wait.
// Timeline build: block 0 records the wait in the DecodeCtl's timeline, and every block
// stamps it when stamps are on (decode_ctl.h).
__device__ __forceinline__ bool wait_halted(const int* halt, bool after_choice = false) {
  const bool early = halt && !after_choice;
  const int early_flag = early ? __ldcg(halt) : 0;
#ifdef LILY_CUDA_TIMELINE
  DecodeCtl* ctl = reinterpret_cast<DecodeCtl*>(const_cast<int*>(halt));
  if (stamp_thread()) {
    const unsigned long long t0 = globaltimer();
    TimelineRec* rec = nullptr;
    BlockStamp* stamp = nullptr;
    if (ctl && ctl->timeline && timeline_thread()) {
      const unsigned i = atomicAdd(&ctl->timeline_n, 1u);
      if (i < kTimelineCap) rec = ctl->timeline + i;
    }
    if (ctl && ctl->stamps) {
      const unsigned j = atomicAdd(&ctl->stamps_n, 1u);
      if (j < kBlockStampCap) stamp = ctl->stamps + j;
    }
    pdl_wait();
    // Thread 0 alone triggers here (a block's first trigger is the one that counts), after
    // drawing its stamp index, so that every block of a kernel is stamped before any block
    // of the next: decode_timeline.py cuts kernels by that order.
    pdl_trigger();
    const unsigned long long t1 = globaltimer();
    const unsigned grid = gridDim.x * gridDim.y * gridDim.z, threads = blockDim.x * blockDim.y * blockDim.z;
    if (rec) *rec = {t0, t1, grid, threads};
    if (stamp) *stamp = {t0, t1, 0, grid, threads, blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), 0};
    if (timeline_thread()) timeline_rec() = rec;
    block_stamp() = stamp;
  } else {
    pdl_wait();
  }
#else
  pdl_wait();
  pdl_trigger();
#endif
  if (early) return early_flag != 0;
  return halt && *halt;
}

// The end of a decode kernel's main work (some finish a short tail after it: the router's
// routing, the lm_head's token choice): a timeline build notes it as kTimelineDone, and as
// every block's `done` stamp; otherwise nothing.
__device__ __forceinline__ void timeline_done() {
#ifdef LILY_CUDA_TIMELINE
  timeline_mark(kTimelineDone);
  if (stamp_thread() && block_stamp()) block_stamp()->done = globaltimer();
#endif
}

// Thread-block clusters: a block may write another block's shared memory only once that
// block has started: every block arrives (cluster_arrive) early and waits (cluster_wait)
// before its first remote access; a full cluster.sync() after the last remote access
// keeps every block alive until no other block can touch its shared memory.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait;" ::: "memory"); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Over the 4 lanes of a quad (lanes 4i .. 4i+3, which hold one row of an mma fragment).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// N sums over the block for the barriers of one; every thread gets them. `red` holds >= 32 N
// floats of shared memory (sum i uses red[32 i + warp]).
template <int N>
__device__ __forceinline__ void block_sums(float (&v)[N], float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
  __syncthreads();
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < N; ++i) red[32 * i + warp] = v[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(lane < nw ? red[32 * i + lane] : 0.0f);
}
__device__ __forceinline__ float block_sum(float v, float* red) {
  float s[1] = {v};
  block_sums(s, red);
  return s[0];
}

__device__ __forceinline__ float bf16_lo(uint32_t p) { return __uint_as_float(p << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t p) { return __uint_as_float(p & 0xffff0000u); }
__device__ __forceinline__ float bf16_bits(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }
__device__ __forceinline__ uint16_t to_bf16_bits(float f) {  // round to nearest even (one cvt.rn.bf16.f32)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
// Two floats -> bf16x2 (round to nearest even), `lo` in the low half (the lower column of an mma fragment).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Weights are read once per token: bypass L1 so they do not evict activations.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.0f + __expf(-x)); }


// Launches `kernel` on `stream` (with PDL when enabled), in thread-block clusters of
// `cluster` blocks along x when cluster > 1, and checks the launch, naming `op`.
template <typename... KArgs, typename... Args>
void launch_clustered(const char* op, int cluster, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {static_cast<unsigned>(cluster), 1, 1};
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  check(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), op);
}

template <typename... KArgs, typename... Args>
void launch(const char* op, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
            Args&&... args) {
  launch_clustered(op, 1, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

// The largest cluster of at most `want` blocks (non-portable sizes above 8 allowed) that
// the current device can place for `kernel` with this block size and dynamic shared
// memory; at least 1. Cached per device, kernel, block size, memory and want.
int max_cluster_size(const void* kernel, int threads, size_t smem, int want, const char* op);

// Number of multiprocessors of the current device (cached per device).
int sm_count();

// Lets `kernel` use at least `bytes` of dynamic shared memory on the current device (the
// attribute belongs to a device; it is only raised, never lowered); `op` names the failure.
void allow_dynamic_smem(const void* kernel, size_t bytes, const char* op);

}  // namespace lily::cuda
