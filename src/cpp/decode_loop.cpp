#include "decode_loop.h"

#include <algorithm>
#include <deque>

namespace lily {

GenerateResult decode_loop(Session& s, const GenerateRequest& req, StepQueue& q, const TokenCallback& on_token) {
  constexpr int32_t kNone = -1;  // a queued step that feeds nothing (choose)
  GenerateResult r;
  std::deque<int32_t> queued;  // what each queued step feeds, oldest first
  int64_t queued_feeds = 0;    // how many of them feed a token
  auto feed = [&](int32_t token) {
    q.feed(token);
    queued.push_back(token);
    ++queued_feeds;
  };
  // Queues steps while the queue has room and their tokens are wanted: every queued step
  // yields a token (at most max_tokens in all), and every feed takes a position (the last
  // choice stays pending, so feeds end one position before the context's end).
  auto top_up = [&] {
    while (static_cast<int>(queued.size()) < q.depth() &&
           r.n_tokens + static_cast<int64_t>(queued.size()) < req.max_tokens &&
           s.position() + queued_feeds + 1 < s.max_context)
      feed(StepQueue::kPrevious);
  };

  int32_t last = -1;
  try {
    if (s.pending >= 0) {
      feed(s.pending);
    } else {
      q.choose();
      queued.push_back(kNone);
    }
    top_up();
    for (;;) {
      const int32_t fed = queued.front();
      queued.pop_front();
      const int32_t tok = q.next_token();
      if (fed != kNone) {
        s.tokens.push_back(fed == StepQueue::kPrevious ? last : fed);
        s.pending = -1;
        --queued_feeds;
        q.accept();
      }
      last = tok;
      ++r.n_tokens;
      s.pending = tok;  // handed out: pending until a step feeds it, also when on_token throws
      const bool keep_going = on_token(tok);
      const bool stop = std::find(req.stop_ids.begin(), req.stop_ids.end(), tok) != req.stop_ids.end();
      const bool length = r.n_tokens == req.max_tokens || s.position() + 1 >= s.max_context;
      if (stop || length || !keep_going) {  // the natural ends' reasons win over a cancel (TokenCallback)
        r.finish_reason = stop ? "stop" : length ? "length" : "cancelled";
        break;
      }
      top_up();  // at least the next step: the loop goes on only when another token is wanted
    }
  } catch (...) {
    q.abort();
    throw;
  }
  q.finish();
  return r;
}

}  // namespace lily
