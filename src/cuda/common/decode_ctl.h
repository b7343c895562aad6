// State of one generate() call that lives on the device: the stop rules and sampling
// parameters (written by the host before the loop) and the counters the token-choosing
// kernels update. A step that finds `halt` set does nothing, so steps queued ahead of
// the host never change the session once generation has ended. Only the token choice
// (lm_head choosing, sample_topk) writes `halt` on the device, and it is always a step's
// last kernel; every decode kernel reads the flag before its PDL wait (wait_halted)
// except the step's first, the embedding qmatmul_decode, which reads it after. A kernel that
// follows a token choice in any other graph must do the same.
#pragma once
#include <cstddef>
#include <cstdint>

namespace lily::cuda {

constexpr int kMaxStopIds = 64;

#ifdef LILY_CUDA_TIMELINE
// A measurement build (CMake option LILY_CUDA_TIMELINE=ON): block 0 of every decode kernel appends
// when it started (reached wait_halted: gate/up computes the shared expert before that)
// and when its PDL wait returned (%globaltimer, ns), in launch order. The
// wait of kernel N+1 returns when kernel N has completed, so the differences of `released`
// are the time each kernel adds to the step (benchmarks/ops/decode_timeline.py). Every
// kernel given a halt pointer must then be given &DecodeCtl::halt (the engine does; the
// kernel tests, with plain int flags, are not built this way).
// mark[j]: when block 0 got past step j of its work (kernels name their steps with
// timeline_mark; the last one, kTimelineDone, is the end of its main work: timeline_done).
constexpr int kTimelineMarks = 3, kTimelineDone = kTimelineMarks - 1;
struct TimelineRec {
  unsigned long long start = 0, released = 0;
  unsigned grid = 0, threads = 0;
  unsigned long long mark[kTimelineMarks] = {};
};
constexpr unsigned kTimelineCap = 1u << 20;
// With $LILY_CUDA_TIMELINE_BLOCKS set, thread 0 of every block of every decode kernel also
// stamps its start, its wait's return and the end of its main work, in the order blocks
// start (all blocks of a kernel start before any block of the next: a kernel's blocks
// trigger the next launch after their wait, so all of them are resident by then).
struct BlockStamp {
  unsigned long long start = 0, released = 0, done = 0;
  unsigned grid = 0, threads = 0, block = 0, pad = 0;
};
constexpr unsigned kBlockStampCap = 1u << 22;
#endif

struct DecodeCtl {
  int halt = 0;         // set by the device when a stop rule fires
  int n_generated = 0;  // tokens chosen so far in this call
  int max_tokens = 0;
  int max_context = 0;
  int n_stop = 0;
  int penalties = 0;    // any of repetition / presence / frequency active
  int top_k = 0;
  int vocab_limit = 0;  // tokens >= vocab_limit are never chosen
  float temperature = 0.0f, top_p = 1.0f, min_p = 0.0f;
  float repetition = 1.0f, presence = 0.0f, frequency = 0.0f;
  unsigned long long seed = 0;
  int stop_ids[kMaxStopIds] = {};
#ifdef LILY_CUDA_TIMELINE
  TimelineRec* timeline = nullptr;  // [kTimelineCap]
  unsigned timeline_n = 0;
  BlockStamp* stamps = nullptr;     // [kBlockStampCap], or null
  unsigned stamps_n = 0;
#endif
};
static_assert(offsetof(DecodeCtl, halt) == 0, "wait_halted finds the DecodeCtl from &halt");

// Where a chosen token goes.
struct TokenSink {
  DecodeCtl* ctl = nullptr;
  const int* pos = nullptr;         // tokens fed so far (the session position)
  int* slot = nullptr;              // device slot the next step embeds
  volatile int* host = nullptr;     // mapped pinned memory the host polls
  int* counts = nullptr;            // [V] times generated in this call (penalties)
  unsigned char* seen = nullptr;    // [V] in the prompt or generated (repetition penalty)
};

}  // namespace lily::cuda
