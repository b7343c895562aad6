// The one generate loop of every executor (pending token, stop ids, max_tokens, context end,
// cancel) over a backend's queue of decode steps; a device keeps steps queued ahead of the
// host (two token slots), and a step the loop does not accept must change nothing kept.
#pragma once
#include <cstdint>

#include "executor.h"

namespace lily {

// A backend's decode steps as the loop drives them. Each queued step chooses one token;
// the loop reads them back in queue order.
class StepQueue {
 public:
  static constexpr int32_t kPrevious = -2;  // feed(): the token the step before chose

  virtual ~StepQueue() = default;
  // Steps that may be queued at once (1: each one runs when queued).
  virtual int depth() const = 0;
  // Queues a step that feeds `token` (or kPrevious) and chooses the next one.
  virtual void feed(int32_t token) = 0;
  // Queues choosing a token from the session's current logits, feeding nothing.
  virtual void choose() = 0;
  // Waits for the oldest queued step; its choice.
  virtual int32_t next_token() = 0;
  // The oldest step's fed token is now the session's (called after next_token).
  virtual void accept() {}
  // The loop has ended: steps still queued or read but not accepted are undone.
  virtual void finish() {}
  // As finish, while an exception is on its way out (must not throw).
  virtual void abort() noexcept {}
};

// Runs generation over q: s holds a pending token or logits, req.max_tokens > 0 and the
// sampling parameters were checked (Executor::generate). Leaves the last choice pending.
GenerateResult decode_loop(Session& s, const GenerateRequest& req, StepQueue& q, const TokenCallback& on_token);

}  // namespace lily
