// The one place that knows every backend (make_executor), and the state an engine and its
// sessions share: one forward or generation at a time (batch 1).
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "error.h"
#include "executor.h"

namespace lily {

// device: "cpu", "cuda", "cuda:N", "auto" (CUDA when available, else CPU) or "metal-emulator"
// (the CPU executor over the Metal kernels on the MSL emulator: a slow test device). The executor's
// options (options.h) come from the environment, read here once.
std::unique_ptr<Executor> make_executor(std::shared_ptr<const ModelWeights> weights, const std::string& device);

// Backends compiled into this build and usable on this machine.
std::vector<std::string> available_devices();

struct EngineState {
  std::shared_ptr<ModelWeights> weights;
  std::unique_ptr<Executor> executor;
  std::mutex busy;  // held by every executor call
};

// A session of an engine; `generating` while a TokenStream owns it.
struct EngineSession {
  EngineSession(std::shared_ptr<EngineState> e, std::unique_ptr<Session> s)
      : engine(std::move(e)), session(std::move(s)) {}
  std::shared_ptr<EngineState> engine;
  std::unique_ptr<Session> session;
  std::atomic<bool> generating{false};

  void check_idle() const {
    if (generating) fail("this session is generating; finish or cancel its stream first");
  }
};

}  // namespace lily
