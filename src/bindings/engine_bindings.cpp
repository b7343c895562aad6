// Engine, Session and TokenStream: the Python-facing handles of the C++ core. A stream's
// generation runs on its own C++ thread (token_stream.h); every call that blocks on it
// releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <mutex>
#include <optional>

#include "bindings.h"
#include "draft_policy.h"
#include "engine.h"
#include "error.h"
#include "options.h"
#include "token_stream.h"
#include "threadpool.h"

namespace nb = nanobind;

namespace lily {
namespace {

using TokenArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

template <typename T>
nb::ndarray<nb::numpy, T> numpy_owning(std::vector<T>&& v, std::vector<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.data(), owner);
}

// A session as Python holds it. Its stream's executor call changes the session under
// the engine lock, so a read while generating waits for the stream's next pause (at most
// TokenStream::kReadAhead tokens).
class PySession : public EngineSession {
 public:
  using EngineSession::EngineSession;

  template <typename Get>
  auto read(Get get) const {
    if (!generating) return get(*session);
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> busy(engine->busy);
    return get(*session);
  }
};

class PyEngine {
 public:
  template <typename Load>
  PyEngine(Load load, const std::string& device, int64_t prefill_chunk) {
    if (prefill_chunk < 0) fail("prefill_chunk must be positive (or 0: the device's default), got ", std::to_string(prefill_chunk));
    state_ = std::make_shared<EngineState>();
    nb::gil_scoped_release release;
    state_->weights = load();
    state_->executor = make_executor(state_->weights, device);
    if (prefill_chunk > 0) state_->executor->prefill_chunk = prefill_chunk;
  }

  PyEngine(const std::string& path, const std::string& device, int64_t prefill_chunk)
      : PyEngine([&] { return ModelWeights::load(path); }, device, prefill_chunk) {}

  // Random weights for config.json at `config_path` (benchmarks; no checkpoint file).
  static PyEngine* random(const std::string& config_path, const std::string& device, uint64_t seed,
                          int64_t prefill_chunk, const std::string& style, bool mtp) {
    return new PyEngine([&] { return ModelWeights::random(config_path, seed, style, mtp); }, device, prefill_chunk);
  }

  std::shared_ptr<PySession> new_session(int64_t max_context) {
    const ModelConfig& c = state_->weights->config;
    if (max_context <= 0) fail("max_context must be positive, got ", std::to_string(max_context));
    if (max_context > c.max_position_embeddings)
      fail("max_context ", std::to_string(max_context), " exceeds the model's max_position_embeddings ",
           std::to_string(c.max_position_embeddings));
    std::lock_guard<std::mutex> busy(state_->busy);
    return std::make_shared<PySession>(state_, state_->executor->new_session(max_context));
  }

  // Feeds tokens; returns [V] last logits, or [n, V] for every position with all_logits.
  nb::object forward(PySession& s, TokenArray tokens, bool all_logits) {
    s.check_idle();
    const int64_t n = static_cast<int64_t>(tokens.shape(0));
    const int64_t V = state_->weights->config.vocab_size;
    std::vector<float> all;
    {
      nb::gil_scoped_release release;
      std::lock_guard<std::mutex> busy(state_->busy);
      if (all_logits) all.resize(static_cast<size_t>(n) * V);
      state_->executor->forward(*s.session, tokens.data(), n, all_logits ? all.data() : nullptr);
    }
    if (all_logits) return nb::cast(numpy_owning(std::move(all), {static_cast<size_t>(n), static_cast<size_t>(V)}));
    std::vector<float> last = s.session->last_logits;
    return nb::cast(numpy_owning(std::move(last), {static_cast<size_t>(V)}));
  }

  // Speculative verify (Executor::verify): feeds tokens as one step; returns [n, V] logits,
  // or with logits=False each row's greedy choice [n] among ids < vocab_limit (0: all).
  nb::object verify(PySession& s, TokenArray tokens, bool want_logits, int64_t vocab_limit) {
    s.check_idle();
    const int64_t n = static_cast<int64_t>(tokens.shape(0));
    const size_t rows = static_cast<size_t>(std::clamp<int64_t>(n, 0, kMaxVerifyTokens));
    const int64_t V = state_->weights->config.vocab_size;
    std::vector<float> logits;
    std::vector<int32_t> argmax;
    {
      nb::gil_scoped_release release;
      std::lock_guard<std::mutex> busy(state_->busy);
      if (want_logits) logits.resize(rows * V);
      else argmax.resize(rows);
      state_->executor->verify(*s.session, tokens.data(), n, want_logits ? logits.data() : nullptr,
                               want_logits ? nullptr : argmax.data(), vocab_limit);
    }
    if (!want_logits) return nb::cast(numpy_owning(std::move(argmax), {rows}));
    return nb::cast(numpy_owning(std::move(logits), {rows, static_cast<size_t>(V)}));
  }

  int64_t max_verify_tokens() const { return state_->executor->max_verify_tokens(); }

  // n MTP drafts after `next` (Executor::draft): [n] token ids, or with logits=True also their
  // [n, V] logits.
  nb::object draft(PySession& s, int32_t next, int64_t n, bool want_logits, int64_t vocab_limit) {
    s.check_idle();
    const size_t rows = static_cast<size_t>(std::clamp<int64_t>(n, 0, kMaxVerifyTokens));
    const int64_t V = state_->weights->config.vocab_size;
    std::vector<int32_t> drafts(rows);
    std::vector<float> logits;
    {
      nb::gil_scoped_release release;
      std::lock_guard<std::mutex> busy(state_->busy);
      if (want_logits) logits.resize(rows * V);
      state_->executor->draft(*s.session, next, n, drafts.data(), want_logits ? logits.data() : nullptr, vocab_limit);
    }
    nb::object ids = nb::cast(numpy_owning(std::move(drafts), {rows}));
    if (!want_logits) return ids;
    return nb::make_tuple(ids, numpy_owning(std::move(logits), {rows, static_cast<size_t>(V)}));
  }

  bool use_mtp() const { return state_->executor->use_mtp; }
  void set_use_mtp(bool on) {
    if (on && !state_->weights->has_mtp) fail("use_mtp: the checkpoint has no MTP head");
    if (std::string why; on && !state_->executor->supports_mtp(&why)) fail("use_mtp: ", why);
    std::lock_guard<std::mutex> busy(state_->busy);
    state_->executor->use_mtp = on;
  }

  void keep_verified(PySession& s, int64_t m) {
    s.check_idle();
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> busy(state_->busy);
    state_->executor->keep_verified(*s.session, m);
  }

  void forget_draft_policies() {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> busy(state_->busy);
    state_->executor->forget_draft_policies();
  }

  std::shared_ptr<TokenStream> generate(std::shared_ptr<PySession> s, int64_t max_tokens, const SamplingParams& p,
                                        std::vector<int32_t> stop_ids, std::vector<nb::bytes> stop_strings,
                                        int64_t draft_tokens, bool adaptive_drafts,
                                        std::vector<int32_t> scripted_drafts) {
    if (max_tokens < 0) fail("max_tokens must be >= 0, got ", std::to_string(max_tokens));
    if (draft_tokens < 0) fail("draft_tokens must be >= 0, got ", std::to_string(draft_tokens));
    Sampler check(p);  // validates the parameters before the thread starts
    std::vector<std::string> stops;
    for (const nb::bytes& b : stop_strings) {
      if (b.size() == 0) fail("stop strings must not be empty");
      stops.emplace_back(b.c_str(), b.size());
    }
    if (!stops.empty() && !token_bytes_) fail("stop strings need the tokenizer's token bytes (set_token_bytes)");
    GenerateRequest req{max_tokens, p, std::move(stop_ids)};
    req.draft_tokens = draft_tokens;
    req.adaptive_drafts = adaptive_drafts;
    req.scripted_drafts = std::move(scripted_drafts);
    // Dropped by Python with the GIL held: the deleter releases it while the worker stops.
    return std::shared_ptr<TokenStream>(
        new TokenStream(std::move(s), std::move(req), StopStringMatcher(token_bytes_, std::move(stops))),
        [](TokenStream* t) {
          nb::gil_scoped_release release;
          delete t;
        });
  }

  // The bytes each token id stands for (from the tokenizer), for stop-string matching.
  void set_token_bytes(const std::vector<nb::bytes>& table) {
    auto t = std::make_shared<std::vector<std::string>>();
    t->reserve(table.size());
    for (const nb::bytes& b : table) t->emplace_back(b.c_str(), b.size());
    token_bytes_ = std::move(t);
  }

  // capacity 0: the source's own max_context.
  std::shared_ptr<PySession> clone(PySession& s, int64_t capacity) {
    s.check_idle();
    std::lock_guard<std::mutex> busy(state_->busy);
    const int64_t room = capacity > 0 ? capacity : s.session->max_context;
    return std::make_shared<PySession>(state_, state_->executor->clone(*s.session, room));
  }

  void restore(PySession& dst, PySession& src) {
    dst.check_idle();
    std::lock_guard<std::mutex> busy(state_->busy);
    state_->executor->restore(*dst.session, *src.session);
  }

  nb::dict config() const {
    const ModelConfig& c = state_->weights->config;
    nb::dict d;
    d["model_type"] = c.model_type;
    d["hidden_size"] = c.hidden_size;
    d["num_hidden_layers"] = c.num_hidden_layers;
    d["vocab_size"] = c.vocab_size;
    nb::list kinds;
    for (LayerKind k : c.layer_kinds) kinds.append(k == LayerKind::Full ? "full_attention" : "linear_attention");
    d["layer_types"] = kinds;
    d["num_attention_heads"] = c.num_attention_heads;
    d["num_key_value_heads"] = c.num_key_value_heads;
    d["head_dim"] = c.head_dim;
    d["linear_num_key_heads"] = c.linear_num_key_heads;
    d["linear_key_head_dim"] = c.linear_key_head_dim;
    d["linear_num_value_heads"] = c.linear_num_value_heads;
    d["linear_value_head_dim"] = c.linear_value_head_dim;
    d["linear_conv_kernel_dim"] = c.linear_conv_kernel_dim;
    d["num_experts"] = c.num_experts;
    d["num_experts_per_tok"] = c.num_experts_per_tok;
    d["moe_intermediate_size"] = c.moe_intermediate_size;
    d["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
    d["max_position_embeddings"] = c.max_position_embeddings;
    d["rope_theta"] = c.rope_theta;
    d["partial_rotary_factor"] = c.partial_rotary_factor;
    d["rms_norm_eps"] = c.rms_norm_eps;
    d["tie_word_embeddings"] = c.tie_word_embeddings;
    nb::list eos;
    for (int64_t id : c.eos_token_ids) eos.append(id);
    d["eos_token_ids"] = eos;
    return d;
  }

  std::vector<std::string> config_warnings() const { return state_->weights->config.warnings; }
  std::string device() const { return state_->executor->device_name(); }
  std::string prefill_route() const { return state_->executor->prefill_route(); }
  std::string source_layout() const { return state_->weights->source_layout; }
  size_t weight_bytes() const { return state_->weights->nbytes(); }
  bool has_mtp() const { return state_->weights->has_mtp; }
  int64_t prefill_chunk() const { return state_->executor->prefill_chunk; }
  void set_prefill_chunk(int64_t n) {
    if (n <= 0) fail("prefill_chunk must be positive, got ", std::to_string(n));
    state_->executor->prefill_chunk = n;
  }

 private:
  std::shared_ptr<EngineState> state_;
  std::shared_ptr<const std::vector<std::string>> token_bytes_;
};

}  // namespace

void register_engine(nb::module_& m) {
  nb::exception<Error>(m, "LilyError", PyExc_ValueError);

  nb::class_<SamplingParams>(m, "SamplingParams")
      .def(nb::init<>())
      .def_rw("temperature", &SamplingParams::temperature)
      .def_rw("top_k", &SamplingParams::top_k)
      .def_rw("top_p", &SamplingParams::top_p)
      .def_rw("min_p", &SamplingParams::min_p)
      .def_rw("repetition_penalty", &SamplingParams::repetition_penalty)
      .def_rw("presence_penalty", &SamplingParams::presence_penalty)
      .def_rw("frequency_penalty", &SamplingParams::frequency_penalty)
      .def_rw("seed", &SamplingParams::seed)
      .def_rw("vocab_limit", &SamplingParams::vocab_limit);

  nb::class_<PySession>(m, "Session")
      .def_prop_ro("position", [](const PySession& s) { return s.read([](const Session& x) { return x.position(); }); })
      .def_prop_ro("max_context", [](const PySession& s) { return s.session->max_context; })
      .def_prop_ro("tokens", [](const PySession& s) { return s.read([](const Session& x) { return x.tokens; }); })
      .def_prop_ro("pending", [](const PySession& s) { return s.read([](const Session& x) { return x.pending; }); })
      .def_prop_ro("expert_load",
                   [](const PySession& s) { return s.read([](const Session& x) { return x.expert_load; }); })
      .def_prop_ro("generating", [](const PySession& s) { return s.generating.load(); });

  m.attr("STREAM_READ_AHEAD") = TokenStream::kReadAhead;
  nb::class_<TokenStream>(m, "TokenStream")
      .def("__iter__", [](nb::handle self) { return self; })
      .def("__next__",
           [](TokenStream& t) {
             std::optional<int32_t> tok;
             {
               nb::gil_scoped_release release;
               tok = t.next();
             }
             if (!tok) throw nb::stop_iteration();
             return *tok;
           })
      .def("cancel", &TokenStream::cancel)
      .def("drain", &TokenStream::drain, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("finish_reason", &TokenStream::finish_reason)
      .def_prop_ro("n_tokens", &TokenStream::n_tokens)
      .def_prop_ro("tokens", &TokenStream::tokens)
      .def_prop_ro("first_token_seconds", &TokenStream::first_token_seconds)
      .def_prop_ro("decode_seconds", &TokenStream::decode_seconds)
      .def_prop_ro("speculation", &TokenStream::speculation);

  nb::class_<PyEngine>(m, "Engine")
      .def(nb::init<const std::string&, const std::string&, int64_t>(), nb::arg("path"), nb::arg("device") = "auto",
           nb::arg("prefill_chunk") = 0)
      .def_static("random", &PyEngine::random, nb::arg("config_path"), nb::arg("device") = "auto",
                  nb::arg("seed") = 0, nb::arg("prefill_chunk") = 0, nb::arg("style") = "plain", nb::arg("mtp") = false,
                  nb::rv_policy::take_ownership)
      .def("new_session", &PyEngine::new_session, nb::arg("max_context"))
      .def("forward", &PyEngine::forward, nb::arg("session"), nb::arg("tokens"), nb::arg("all_logits") = false)
      .def("verify", &PyEngine::verify, nb::arg("session"), nb::arg("tokens"), nb::arg("logits") = true,
           nb::arg("vocab_limit") = 0)
      .def_prop_ro("max_verify_tokens", [](const PyEngine& e) { return e.max_verify_tokens(); })
      .def("keep_verified", &PyEngine::keep_verified, nb::arg("session"), nb::arg("keep"))
      .def("draft", &PyEngine::draft, nb::arg("session"), nb::arg("next"), nb::arg("n"), nb::arg("logits") = false,
           nb::arg("vocab_limit") = 0)
      .def_prop_ro("has_mtp", &PyEngine::has_mtp)
      .def_prop_rw("use_mtp", &PyEngine::use_mtp, &PyEngine::set_use_mtp)
      .def("forget_draft_policies", &PyEngine::forget_draft_policies)
      .def("generate", &PyEngine::generate, nb::arg("session"), nb::arg("max_tokens"), nb::arg("sampling"),
           nb::arg("stop_ids"), nb::arg("stop_strings") = std::vector<nb::bytes>{}, nb::arg("draft_tokens") = 0,
           nb::arg("adaptive_drafts") = false, nb::arg("scripted_drafts") = std::vector<int32_t>{})
      .def("set_token_bytes", &PyEngine::set_token_bytes, nb::arg("table"))
      .def("clone", &PyEngine::clone, nb::arg("session"), nb::arg("capacity") = 0)
      .def("restore", &PyEngine::restore)
      .def_prop_ro("config", &PyEngine::config)
      .def_prop_ro("config_warnings", &PyEngine::config_warnings)
      .def_prop_ro("device", &PyEngine::device)
      .def_prop_ro("prefill_route", &PyEngine::prefill_route)
      .def_prop_ro("source_layout", &PyEngine::source_layout)
      .def_prop_ro("weight_bytes", &PyEngine::weight_bytes)
      .def_prop_rw("prefill_chunk", &PyEngine::prefill_chunk, &PyEngine::set_prefill_chunk);

  m.def("check_sampling", [](const SamplingParams& p) { Sampler check(p); }, nb::arg("sampling"),
        "Raises LilyError if the sampling parameters are invalid.");
  m.def("available_devices", &available_devices);
  m.def("executor_options", [] {  // the route switches of options.cpp, for docs and tests
    nb::list rows;
    for (const OptionInfo& o : executor_option_table()) {
      nb::dict d;
      d["name"] = o.name, d["values"] = o.values, d["default"] = o.default_value, d["doc"] = o.doc;
      rows.append(d);
    }
    return rows;
  });
  m.def("num_threads", &num_threads);
  m.def("set_num_threads", &set_num_threads);
  m.def(
      "convert",
      [](const std::string& src, const std::string& dst, int64_t max_shard_bytes, bool keep_mtp) {
        nb::gil_scoped_release release;
        ModelWeights::load(src)->save_mlx(dst, max_shard_bytes, keep_mtp);
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("max_shard_bytes") = int64_t(5) << 30, nb::arg("keep_mtp") = false);

  // The adaptive draft count's model alone (speculative_loop drives it inside generate).
  nb::class_<DraftPolicy>(m, "DraftPolicy")
      .def(nb::init<int64_t>(), nb::arg("most"))
      .def("choose", &DraftPolicy::choose)
      .def_prop_ro("plain_run", &DraftPolicy::plain_run)
      .def("drafted", &DraftPolicy::drafted, nb::arg("n"), nb::arg("accepted"), nb::arg("draft_s"), nb::arg("verify_s"),
           nb::arg("host_s_per_token") = 0.0)
      .def("decoded", &DraftPolicy::decoded, nb::arg("tokens"), nb::arg("seconds"))
      .def("expected_tokens", &DraftPolicy::expected_tokens, nb::arg("k"))
      .def("expected_seconds", &DraftPolicy::expected_seconds, nb::arg("k"));
}

}  // namespace lily
