// One generation on its own thread, read token by token: the decode loop never waits on
// its reader, and runs at most kReadAhead tokens ahead of it, so a stream nobody reads
// stops there and leaves the engine free.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "engine.h"
#include "stop_strings.h"

namespace lily {

// At kReadAhead unread tokens the executor's call returns and frees the engine; once the
// reader is down to kResumeAt a new call continues from the session (generated_before), so
// a paused stream yields the same tokens as one that never paused.
class TokenStream {
 public:
  static constexpr int64_t kReadAhead = 32;
  static constexpr int64_t kResumeAt = kReadAhead / 2;

  TokenStream(std::shared_ptr<EngineSession> s, GenerateRequest req, StopStringMatcher stops);
  ~TokenStream();  // cancels, then waits for the executor's call to return

  // The next token, blocking; nullopt at the end (rethrows the generation's error).
  std::optional<int32_t> next();
  void cancel();
  // Waits for the end and returns the tokens not yet read. Generation runs unbounded
  // meanwhile: this reader takes everything.
  std::vector<int32_t> drain();

  std::string finish_reason() const;
  int64_t n_tokens() const;
  // Every token generated so far, read or not: what the session holds from this stream.
  std::vector<int32_t> tokens() const;
  // Seconds from start to the first token, and spent generating the tokens after it
  // (pauses excluded).
  double first_token_seconds() const;
  double decode_seconds() const;
  // Speculative decoding so far: verify rounds, drafts, accepted drafts, tokens the rounds handed out.
  std::tuple<int64_t, int64_t, int64_t, int64_t> speculation() const;

 private:
  using Clock = std::chrono::steady_clock;
  void join();
  bool wait_for_reader();
  bool accept(int32_t tok);
  void run(GenerateRequest req);

  std::shared_ptr<EngineSession> session_;
  StopStringMatcher stops_;
  std::thread worker_;
  std::mutex join_mu_;
  mutable std::mutex mu_;  // guards everything below
  std::condition_variable token_ready_, reader_caught_up_;
  std::deque<int32_t> queue_;  // generated, not yet read
  std::vector<int32_t> generated_;
  bool stopped_by_string_ = false;
  bool cancel_ = false;
  bool unbounded_ = false;  // drain(): no read-ahead bound
  bool paused_ = false;     // the last callback paused the executor's call
  bool done_ = false;
  std::string finish_reason_;
  std::exception_ptr error_;
  Clock::time_point start_, first_, last_, call_start_;  // call_start_: of the executor's current call
  double decode_seconds_ = 0.0;
  int64_t rounds_ = 0, drafted_ = 0, accepted_ = 0, round_tokens_ = 0;
};

}  // namespace lily
