#include "token_stream.h"

#include <algorithm>

namespace lily {
namespace {

double seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return b > a ? std::chrono::duration<double>(b - a).count() : 0.0;
}

}  // namespace

TokenStream::TokenStream(std::shared_ptr<EngineSession> s, GenerateRequest req, StopStringMatcher stops)
    : session_(std::move(s)), stops_(std::move(stops)) {
  session_->check_idle();
  session_->generating = true;
  start_ = Clock::now();
  try {
    worker_ = std::thread([this, req = std::move(req)]() mutable { run(std::move(req)); });
  } catch (...) {
    session_->generating = false;
    throw;
  }
}

TokenStream::~TokenStream() {
  cancel();
  join();
}

std::optional<int32_t> TokenStream::next() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    token_ready_.wait(lk, [&] { return !queue_.empty() || done_; });
    if (!queue_.empty()) {
      const int32_t tok = queue_.front();
      queue_.pop_front();
      if (static_cast<int64_t>(queue_.size()) <= kResumeAt) reader_caught_up_.notify_one();
      return tok;
    }
  }
  join();
  if (error_) std::rethrow_exception(error_);
  return std::nullopt;
}

void TokenStream::cancel() {
  std::lock_guard<std::mutex> lk(mu_);
  cancel_ = true;
  reader_caught_up_.notify_one();
}

std::vector<int32_t> TokenStream::drain() {
  std::vector<int32_t> out;
  {
    std::unique_lock<std::mutex> lk(mu_);
    unbounded_ = true;
    for (;;) {
      token_ready_.wait(lk, [&] { return !queue_.empty() || done_; });
      out.insert(out.end(), queue_.begin(), queue_.end());
      queue_.clear();
      reader_caught_up_.notify_one();  // a paused stream resumes
      if (done_) break;
    }
  }
  join();
  if (error_) std::rethrow_exception(error_);
  return out;
}

std::string TokenStream::finish_reason() const {
  std::lock_guard<std::mutex> lk(mu_);
  return finish_reason_;
}
std::tuple<int64_t, int64_t, int64_t, int64_t> TokenStream::speculation() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {rounds_, drafted_, accepted_, round_tokens_};
}
int64_t TokenStream::n_tokens() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(generated_.size());
}
std::vector<int32_t> TokenStream::tokens() const {
  std::lock_guard<std::mutex> lk(mu_);
  return generated_;
}
double TokenStream::first_token_seconds() const {
  std::lock_guard<std::mutex> lk(mu_);
  return seconds(start_, first_);
}
double TokenStream::decode_seconds() const {
  std::lock_guard<std::mutex> lk(mu_);
  return decode_seconds_;
}

void TokenStream::join() {
  std::lock_guard<std::mutex> lk(join_mu_);  // next() and drain() may race to the end
  if (worker_.joinable()) worker_.join();
}

// Blocks while the reader lags by more than kResumeAt tokens; false once cancelled.
bool TokenStream::wait_for_reader() {
  std::unique_lock<std::mutex> lk(mu_);
  reader_caught_up_.wait(lk, [&] { return cancel_ || static_cast<int64_t>(queue_.size()) <= kResumeAt; });
  return !cancel_;
}

// The executor's callback: queues the token; false to stop (a stop string, cancel) or pause.
bool TokenStream::accept(int32_t tok) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lk(mu_);
  if (generated_.empty()) first_ = now;
  else decode_seconds_ += seconds(std::max(last_, call_start_), now);  // a pause is not decoding
  last_ = now;
  generated_.push_back(tok);
  queue_.push_back(tok);
  token_ready_.notify_one();
  if (stops_.push(tok)) {
    stopped_by_string_ = true;
    return false;
  }
  paused_ = !cancel_ && !unbounded_ && static_cast<int64_t>(queue_.size()) >= kReadAhead;
  return !cancel_ && !paused_;
}

// One executor call per stretch between pauses, until generation ends.
void TokenStream::run(GenerateRequest req) {
  std::string reason;
  try {
    const int64_t budget = req.max_tokens;
    while (reason.empty() && wait_for_reader()) {
      std::lock_guard<std::mutex> busy(session_->engine->busy);
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (cancel_) break;
        req.generated_before = static_cast<int64_t>(generated_.size());
        req.max_tokens = budget - req.generated_before;
        call_start_ = Clock::now();
        paused_ = false;
      }
      const GenerateResult r =
          session_->engine->executor->generate(*session_->session, req, [this](int32_t tok) { return accept(tok); });
      std::lock_guard<std::mutex> lk(mu_);
      rounds_ += r.rounds;
      drafted_ += r.drafted;
      accepted_ += r.accepted;
      round_tokens_ += r.round_tokens;
      if (stopped_by_string_) reason = "stop";
      else if (!paused_ || r.finish_reason != "cancelled") reason = r.finish_reason;
    }
    if (reason.empty()) reason = "cancelled";
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    error_ = std::current_exception();
  }
  session_->generating = false;
  std::lock_guard<std::mutex> lk(mu_);
  finish_reason_ = reason;
  done_ = true;
  token_ready_.notify_all();
}

}  // namespace lily
