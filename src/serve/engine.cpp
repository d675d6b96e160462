// Engine: the scheduler on its own thread, a mutex-protected inbox for submit(), and a stats snapshot.
#include "serve/engine.h"

#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/sys.h"
#include "runtime/backend.h"
#include "runtime/model.h"
#include "serve/scheduler.h"

namespace merlin::serve {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Error: return "error";
    case FinishReason::None: break;
  }
  return "none";
}

// Shared with the streams (which may outlive the engine): a cancel() wakes the engine thread so the
// sequence's blocks are freed at once even when the engine was idle.
struct Wakeup {
  std::mutex mu;
  std::condition_variable cv;
  bool pending = false;
  void notify() {
    {
      std::lock_guard<std::mutex> lock(mu);
      pending = true;
    }
    cv.notify_all();
  }
};

struct Engine::Impl {
  const Model& model;
  std::unique_ptr<Backend> backend;
  EngineOptions opts;
  Scheduler scheduler;
  std::shared_ptr<Wakeup> wake = std::make_shared<Wakeup>();
  // Guarded by wake->mu:
  std::deque<std::shared_ptr<StreamState>> inbox;
  bool stopping = false;
  bool idle_work_allowed = false;  // Engine::start_idle_work
  int scheduler_waiting = 0;  // the scheduler's queue length after its last step, for the queue bound
  mutable std::mutex stats_mu;
  EngineStats stats;
  double last_step_time = 0;   // engine thread: when the scheduler last ran a step
  double stats_step_time = 0;  // guarded by stats_mu: the same, as of the published stats
  std::thread thread;

  Impl(const Model& m, std::unique_ptr<Backend> b, const EngineOptions& o)
      : model(m), backend(std::move(b)), opts(o), scheduler(m, *backend, o) {
    stats = scheduler.stats();
    thread = std::thread([this] { run(); });
  }

  void run();
  void publish();
};

void Engine::Impl::run() {
  bool idle_work = true;  // the backend's work ahead (Backend::idle_work), done while nothing runs
  for (;;) {
    std::deque<std::shared_ptr<StreamState>> arrived;
    {
      std::unique_lock<std::mutex> lock(wake->mu);
      if (!stopping && scheduler.idle() && inbox.empty() && !wake->pending) {
        if (idle_work && idle_work_allowed) {
          lock.unlock();
          idle_work = backend->idle_work();
          continue;
        }
        wake->cv.wait(lock, [&] { return stopping || !inbox.empty() || wake->pending; });
      }
      wake->pending = false;
      if (stopping) break;
      arrived.swap(inbox);
    }
    for (auto& s : arrived) scheduler.enqueue(std::move(s));
    try {
      if (scheduler.step()) last_step_time = now_seconds();
    } catch (const std::exception& e) {
      // A bug in the scheduler must not take the server down: end what runs and keep serving.
      std::fprintf(stderr, "engine: step failed: %s\n", e.what());
      scheduler.cancel_all();
    }
    publish();
  }
  scheduler.cancel_all();
  std::deque<std::shared_ptr<StreamState>> left;
  {
    std::lock_guard<std::mutex> lock(wake->mu);
    left.swap(inbox);
  }
  for (auto& s : left) s->push(final_event(FinishReason::Cancelled));
  publish();
}

void Engine::Impl::publish() {
  EngineStats st = scheduler.stats();
  {
    std::lock_guard<std::mutex> lock(wake->mu);
    scheduler_waiting = scheduler.n_waiting();
    st.waiting += (int)inbox.size();
  }
  std::lock_guard<std::mutex> lock(stats_mu);
  stats = st;
  stats_step_time = last_step_time;
}

Engine::Engine(const Model& model, std::unique_ptr<Backend> backend, const EngineOptions& opts) {
  MERLIN_CHECK(backend != nullptr, "the engine needs a backend");
  impl_ = std::make_unique<Impl>(model, std::move(backend), opts);
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(impl_->wake->mu);
    impl_->stopping = true;
  }
  impl_->wake->cv.notify_all();
  impl_->thread.join();
}

void Engine::start_idle_work() {
  {
    std::lock_guard<std::mutex> lock(impl_->wake->mu);
    impl_->idle_work_allowed = true;
  }
  impl_->wake->notify();
}

std::shared_ptr<RequestStream> Engine::submit(GenerationRequest request) {
  impl_->scheduler.validate(request);  // reads only immutable configuration: safe off the engine thread
  std::weak_ptr<Wakeup> wake = impl_->wake;
  auto stream = std::make_shared<StreamState>(std::move(request), [wake] {
    if (auto w = wake.lock()) w->notify();
  });
  {
    std::lock_guard<std::mutex> lock(impl_->wake->mu);
    if (impl_->stopping) fail("the engine is shutting down");
    if ((int)impl_->inbox.size() + impl_->scheduler_waiting >= impl_->opts.max_queue) throw QueueFull();
    impl_->inbox.push_back(stream);
  }
  impl_->wake->cv.notify_all();
  return stream;
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(impl_->stats_mu);
  EngineStats st = impl_->stats;
  // The rate covers the last few seconds of steps; an engine that has been idle longer generates nothing.
  if (now_seconds() - impl_->stats_step_time > Scheduler::kRateWindowSeconds) st.generated_tokens_per_second = 0;
  return st;
}

int Engine::n_ctx() const { return impl_->backend->n_ctx(); }

const Model& Engine::model() const { return impl_->model; }

}  // namespace merlin::serve
