// Output head and token choice: lm_head logits, greedy argmax (vocab limit, penalties
// compared with the host Sampler), stop rules, and the sampling distributions of the
// Gumbel-max path and the top-k / top-p / min-p sampler measured over thousands of draws.
#include <algorithm>
#include <chrono>
#include <numeric>

#include "head/lm_head.h"
#include "head/sampler.h"
#include "sampling.h"
#include "test_util.h"

namespace lily::cuda::test {
namespace {

struct Sink {
  DecodeCtl* ctl;
  int *pos, *slot, *host_h, *host_d, *counts;
  unsigned char* seen;
  explicit Sink(int V) {
    ctl = dev_alloc<DecodeCtl>(1, false);
    pos = to_dev(std::vector<int>{5});
    slot = dev_alloc<int>(1);
    CK(cudaHostAlloc(reinterpret_cast<void**>(&host_h), 4, cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_d), host_h, 0));
    counts = dev_alloc<int>(V, false);
    seen = dev_alloc<unsigned char>(V, false);
  }
  ~Sink() { cudaFree(ctl), cudaFree(pos), cudaFree(slot), cudaFreeHost(host_h), cudaFree(counts), cudaFree(seen); }
  TokenSink sink() const { return {ctl, pos, slot, host_d, counts, seen}; }
  void set(const DecodeCtl& c) { CK(cudaMemcpy(ctl, &c, sizeof c, cudaMemcpyHostToDevice)); }
  DecodeCtl get() const { return from_dev(ctl, 1)[0]; }
  int token() const {
    const int s = from_dev(slot, 1)[0];
    return s == *static_cast<volatile int*>(host_h) ? s : -1;  // the two copies must agree
  }
};

DecodeCtl params(float temperature, int top_k, float top_p, float min_p) {
  DecodeCtl c;
  c.max_tokens = 1 << 30;
  c.max_context = 1 << 30;
  c.temperature = temperature, c.top_k = top_k, c.top_p = top_p, c.min_p = min_p;
  c.seed = 1234;
  return c;
}

int argmax(const std::vector<float>& v, int limit) {
  return static_cast<int>(std::max_element(v.begin(), v.begin() + limit) - v.begin());
}

// The host Sampler's distribution over tokens for logits l (exact rules, no draw).
std::vector<double> expected_probs(const std::vector<float>& l, const DecodeCtl& c) {
  const int V = static_cast<int>(l.size());
  std::vector<int> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return l[a] > l[b]; });
  const int k = c.top_k > 0 ? std::min(c.top_k, V) : V;
  std::vector<double> p(k);
  double sum = 0;
  for (int i = 0; i < k; ++i) sum += p[i] = std::exp((double(l[idx[i]]) - l[idx[0]]) / c.temperature);
  for (double& q : p) q /= sum;
  int keep = k;
  if (c.top_p < 1) {
    double acc = 0;
    for (int i = 0; i < k; ++i)
      if ((acc += p[i]) >= c.top_p) { keep = i + 1; break; }
  }
  if (c.min_p > 0) {
    int n = 1;
    while (n < keep && p[n] >= c.min_p * p[0]) ++n;
    keep = n;
  }
  double mass = 0;
  for (int i = 0; i < keep; ++i) mass += p[i];
  std::vector<double> out(V, 0.0);
  for (int i = 0; i < keep; ++i) out[idx[i]] = p[i] / mass;
  return out;
}

// Draws n tokens with `draw` and compares the frequencies with `want`.
template <typename Draw>
void check_distribution(const std::string& name, const std::vector<double>& want, int n, Draw draw) {
  std::vector<int> hist(want.size(), 0);
  for (int i = 0; i < n; ++i) {
    const int t = draw();
    if (t < 0 || t >= static_cast<int>(want.size())) { expect(name + ": token out of range", false); return; }
    ++hist[t];
  }
  double worst = 0;  // in standard deviations (plus a 2-count allowance)
  bool outside = false;
  for (size_t i = 0; i < want.size(); ++i) {
    const double f = double(hist[i]) / n, p = want[i];
    if (p == 0 && hist[i] > 0) outside = true;
    worst = std::max(worst, std::fabs(f - p) / (std::sqrt(p * (1 - p) / n) + 2.0 / n));
  }
  expect(name + ": no token outside the kept set", !outside);
  report(name + ": frequencies (max deviation in sigmas)", worst, 5.0);
}

// A large V gives each block many row blocks in turn (and a partial last one).
void test_greedy_head(bool tiled, int V = 1000) {
  Rng r(41);
  const int H = 256;
  HostQ W = make_q(V, H, 4, 64, r);
  std::vector<float> h = randn(H, r, 3.0), w = randn(H, r, 0.1);
  for (float& v : w) v += 1;
  Sink s(V);
  HeadArgs a;
  a.W = upload_as(W, tiled);
  a.X.mode = XMode::RmsNorm;
  a.X.x = to_dev(h);
  a.X.w = to_dev(w);
  a.logits = dev_alloc<float>(V);
  a.select = HeadSelect::Greedy;
  a.ctl = s.ctl;
  a.partial = dev_alloc<float2>(kLmHeadMaxBlocks);
  a.counter = dev_alloc<unsigned>(1, false);
  a.sink = s.sink();
  DecodeCtl c = params(0, 0, 1, 0);
  s.set(c);
  lm_head(a, nullptr, 0);
  const auto logits = from_dev(a.logits, V);
  double ss = 0;
  for (float v : h) ss += double(v) * v;
  std::vector<double> ref(V, 0.0);
  for (int i = 0; i < V; ++i)
    for (int j = 0; j < H; ++j) ref[i] += W.deq[size_t(i) * H + j] * h[j] / std::sqrt(ss / H + 1e-6) * w[j];
  report("lm_head logits V" + std::to_string(V) + " H256" + (tiled ? " (tensor cores)" : ""), rel_err(logits, ref),
         tiled ? 2e-4 : 1e-4);
  const int t0 = s.token();
  expect("greedy token is the first argmax of the logits (slot and host copy agree)", t0 == argmax(logits, V));
  DecodeCtl after = s.get();
  expect("emit: n_generated counts, no halt", after.n_generated == 1 && after.halt == 0);

  a.compute = false;  // choose from the stored logits
  lm_head(a, nullptr, 0);
  expect("greedy from stored logits picks the same token", s.token() == t0);

  c.vocab_limit = 500;
  s.set(c);
  lm_head(a, nullptr, 0);
  expect("vocab_limit: argmax over the allowed ids only", s.token() == argmax(logits, 500));

  // Penalties: device counts/seen built from a history, compared with the host Sampler.
  SamplingParams sp;
  sp.repetition_penalty = 1.7f, sp.presence_penalty = 0.4f, sp.frequency_penalty = 0.3f;
  std::vector<int32_t> history;
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int x, int y) { return logits[x] > logits[y]; });
  for (int i = 0; i < 6; ++i) history.push_back(order[i]);                   // prompt: top tokens
  for (int i = 0; i < 9; ++i) history.push_back(order[(i * 7) % 20 + 1]);    // generated, with repeats
  std::vector<int> counts(V, 0);
  std::vector<unsigned char> seen(V, 0);
  for (int t : history) seen[t] = 1;
  for (size_t i = 6; i < history.size(); ++i) ++counts[history[i]];
  CK(cudaMemcpy(s.counts, counts.data(), V * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s.seen, seen.data(), V, cudaMemcpyHostToDevice));
  c = params(0, 0, 1, 0);
  c.penalties = 1, c.repetition = sp.repetition_penalty, c.presence = sp.presence_penalty, c.frequency = sp.frequency_penalty;
  s.set(c);
  lm_head(a, nullptr, 0);
  Sampler host(sp);
  const int want = host.sample(logits.data(), V, history, 9);
  const int got = s.token();
  expect("greedy with repetition/presence/frequency penalties matches the host Sampler", got == want);
  expect("emit: the chosen token's count and seen flag are updated",
         from_dev(s.counts, V)[got] == counts[got] + 1 && from_dev(s.seen, V)[got] == 1);

  c = params(0, 0, 1, 0);  // plain greedy picks t0 again
  c.n_stop = 2;
  c.stop_ids[0] = (t0 + 1) % V;
  c.stop_ids[1] = t0;
  s.set(c);
  lm_head(a, nullptr, 0);
  expect("emit: a stop id sets halt", s.token() == t0 && s.get().halt == 1);
  c.n_stop = 0;
  c.max_tokens = 1;
  s.set(c);
  lm_head(a, nullptr, 0);
  expect("emit: max_tokens sets halt", s.get().halt == 1);
  c.max_tokens = 100;
  c.max_context = 7;  // pos is 5: 5 + 1 < 7 keeps going
  s.set(c);
  lm_head(a, nullptr, 0);
  expect("emit: context limit not yet reached", s.get().halt == 0);
  c.max_context = 6;
  s.set(c);
  lm_head(a, nullptr, 0);
  expect("emit: context limit sets halt", s.get().halt == 1);
  c.halt = 1;
  c.max_context = 1 << 30;
  s.set(c);
  CK(cudaMemset(s.slot, 0xFF, 4));
  lm_head(a, &s.ctl->halt, 0);
  expect("halted head writes no token", from_dev(s.slot, 1)[0] == -1 && s.get().n_generated == c.n_generated);
  free_q(a.W);
  cudaFree(const_cast<float*>(a.X.x)), cudaFree(const_cast<float*>(a.X.w)), cudaFree(a.logits), cudaFree(a.partial),
      cudaFree(a.counter);
}

void test_sampling() {
  Rng r(42);
  {  // Gumbel-max temperature sampling over 12 tokens.
    const int V = 12;
    const auto l = randn(V, r, 1.5);
    Sink s(V);
    HeadArgs a;
    a.W.rows = V;
    a.W.cols = 128;
    a.logits = to_dev(l);
    a.compute = false;
    a.select = HeadSelect::Gumbel;
    a.ctl = s.ctl;
    a.partial = dev_alloc<float2>(kLmHeadMaxBlocks);
    a.counter = dev_alloc<unsigned>(1, false);
    a.sink = s.sink();
    const DecodeCtl c = params(0.7f, 0, 1, 0);
    s.set(c);
    check_distribution("gumbel T0.7 V12", expected_probs(l, c), 6000, [&] {
      lm_head(a, nullptr, 0);
      return s.token();
    });
    cudaFree(a.logits), cudaFree(a.partial), cudaFree(a.counter);
  }
  const int V = 3000;
  const auto l = randn(V, r, 2.0);
  float* dl = to_dev(l);
  Sink s(V);
  const DecodeCtl cases[] = {params(0.8f, 20, 1, 0), params(1.0f, 0, 0.6f, 0), params(1.2f, 50, 1, 0.05f),
                             params(0.7f, 40, 0.9f, 0.02f)};
  for (const DecodeCtl& c : cases) {
    s.set(c);
    char name[120];
    std::snprintf(name, sizeof name, "sampler V3000 T%.1f top_k %d top_p %.2f min_p %.2f", c.temperature, c.top_k,
                  c.top_p, c.min_p);
    check_distribution(name, expected_probs(l, c), 4000, [&] {
      sample_topk(dl, V, s.ctl, s.sink(), nullptr, 0);
      return s.token();
    });
  }
  {
    DecodeCtl c = params(1.0f, 1, 1, 0);
    s.set(c);
    sample_topk(dl, V, s.ctl, s.sink(), nullptr, 0);
    expect("sampler top_k 1 is the argmax", s.token() == argmax(l, V));
  }
  cudaFree(dl);

  // Full vocabulary: top-k membership and the time one draw takes.
  const int BV = 248320;
  const auto bl = randn(BV, r, 3.0);
  float* dbl = to_dev(bl);
  Sink bs(BV);
  std::vector<int> idx(BV);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + 20, idx.end(), [&](int x, int y) { return bl[x] > bl[y]; });
  bs.set(params(1.0f, 20, 0.95f, 0));
  bool inside = true;
  CK(cudaDeviceSynchronize());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 200; ++i) {
    sample_topk(dbl, BV, bs.ctl, bs.sink(), nullptr, 0);
    const int t = bs.token();
    inside &= std::find(idx.begin(), idx.begin() + 20, t) != idx.begin() + 20;
  }
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 200;
  expect("sampler V248320 top_k 20: every draw in the top 20 (" + std::to_string(int(us)) + " us per draw incl. sync)",
         inside);
  cudaFree(dbl);
}

}  // namespace

void run_head_tests() {
  test_greedy_head(false);
  test_greedy_head(true);
  test_greedy_head(true, 40007);
  test_sampling();
}

}  // namespace lily::cuda::test
