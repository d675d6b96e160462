#include "core/thread_pool.h"

#include <algorithm>
#include <cstdlib>

#if defined(__x86_64__)
#include <immintrin.h>
#define MERLIN_PAUSE() _mm_pause()
#else
#define MERLIN_PAUSE() ((void)0)
#endif

namespace merlin {
namespace {

// How long an idle worker polls before it sleeps: pause-spins (the next section of a forward pass usually
// follows within microseconds), then sched_yield()s, which let another runnable thread of this core (a server's
// HTTP threads, its clients) have the core while still reacting within a few microseconds.
// MERLIN_POOL_SPIN=pauses,yields overrides it (A/B runs).
struct SpinPolicy {
  int pauses = 4000, yields = 16000;
  SpinPolicy() {
    if (const char* s = std::getenv("MERLIN_POOL_SPIN")) {
      char* end = nullptr;
      pauses = (int)std::strtol(s, &end, 10);
      if (end != nullptr && *end == ',') yields = (int)std::strtol(end + 1, nullptr, 10);
    }
  }
};
const SpinPolicy& spin_policy() {
  static const SpinPolicy p;
  return p;
}

constexpr uint64_t kOpen = 1;

// Waits for `done()` on a thread that has work left to wait for (the caller's own tail): short pauses, then
// yields so an oversubscribed core can run the thread being waited for.
template <class Done>
void spin_until(Done done) {
  for (int spin = 0; !done(); ++spin) {
    if (spin < 4000) MERLIN_PAUSE();
    else std::this_thread::yield();
  }
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  shares_ = std::make_unique<Share[]>((size_t)n_threads_);
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    state_.fetch_add(2);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int ThreadPool::default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : (int)n;
}

// The section's fields are written before this store (release), and a worker reads them only after seeing it.
void ThreadPool::open_epoch() {
  const uint64_t s = state_.load(std::memory_order_relaxed);
  state_.store(((s >> 1) + 1) << 1 | kOpen, std::memory_order_seq_cst);
  // Pairs with the worker's sleepers_ increment before it checks state_ under the mutex: either it sees the new
  // epoch or we see it and wake it.
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard<std::mutex> lock(mu_); }
    cv_.notify_all();
  }
}

// After this, a worker that had not joined yet sees a closed epoch and leaves the section's fields alone
// (worker_loop re-checks state_ after counting itself active), so only joined workers are waited for.
void ThreadPool::close_epoch() {
  state_.store(state_.load(std::memory_order_relaxed) & ~kOpen, std::memory_order_seq_cst);
  spin_until([&] { return active_.load(std::memory_order_seq_cst) == 0; });
  run_fn_ = nullptr;
  chunk_fn_ = nullptr;
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  run_fn_ = &fn;
  finished_.store(0, std::memory_order_relaxed);
  open_epoch();
  fn(0, n_threads_);
  spin_until([&] { return finished_.load(std::memory_order_acquire) == n_threads_ - 1; });
  close_epoch();
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t align) {
  if (n <= 0) return;
  align = std::max<int64_t>(1, align);
  const int64_t units = (n + align - 1) / align;
  const int parts = (int)std::min<int64_t>(n_threads_, units);
  if (parts == 1) {
    fn(0, n);
    return;
  }
  run([&](int ti, int /*nt*/) {
    if (ti >= parts) return;
    const int64_t u0 = units * ti / parts, u1 = units * (ti + 1) / parts;
    const int64_t b = u0 * align, e = std::min(n, u1 * align);
    if (b < e) fn(b, e);
  });
}

void ThreadPool::for_chunks(int64_t n, int64_t grain, const ChunkFn& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>({(int64_t)1, grain, n >> 31});  // chunk indices fit the 32-bit halves of a share
  const int64_t chunks = (n + grain - 1) / grain;
  if (n_threads_ == 1 || chunks == 1) {
    for (int64_t b = 0; b < n; b += grain) fn(0, b, std::min(n, b + grain));
    return;
  }
  chunk_fn_ = &fn;
  n_ = n;
  grain_ = grain;
  for (int t = 0; t < n_threads_; ++t) {
    const uint64_t c0 = (uint64_t)(chunks * t / n_threads_), c1 = (uint64_t)(chunks * (t + 1) / n_threads_);
    shares_[(size_t)t].range.store(c0 << 32 | c1, std::memory_order_relaxed);
  }
  open_epoch();
  chunk_loop(0);
  close_epoch();
}

// A share is one word, so the owner (front) and a thief (back) claim chunks with one compare-exchange each.
bool ThreadPool::take(int thread, int64_t& chunk) {
  for (int k = 0; k < n_threads_; ++k) {
    std::atomic<uint64_t>& r = shares_[(size_t)((thread + k) % n_threads_)].range;
    uint64_t v = r.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = v >> 32, hi = v & 0xffffffffu;
      if (lo >= hi) break;
      const uint64_t next = k == 0 ? (lo + 1) << 32 | hi : lo << 32 | (hi - 1);
      if (r.compare_exchange_weak(v, next, std::memory_order_acq_rel, std::memory_order_relaxed)) {
        chunk = (int64_t)(k == 0 ? lo : hi - 1);
        return true;
      }
    }
  }
  return false;
}

void ThreadPool::chunk_loop(int thread) {
  for (int64_t c; take(thread, c);) {
    const int64_t b = c * grain_;
    (*chunk_fn_)(thread, b, std::min(n_, b + grain_));
  }
}

void ThreadPool::worker_loop(int index) {
  const SpinPolicy& policy = spin_policy();
  uint64_t seen = 0;  // the last epoch this worker looked at
  auto wanted = [&](uint64_t s) { return (s & kOpen) != 0 && (s >> 1) != seen; };
  for (;;) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (int spin = 0; !wanted(s) && !stop_.load(std::memory_order_relaxed); ++spin) {
      if (spin < policy.pauses) {
        MERLIN_PAUSE();
      } else if (spin < policy.pauses + policy.yields) {
        std::this_thread::yield();
      } else {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return stop_.load() || wanted(state_.load(std::memory_order_seq_cst)); });
        }
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        spin = 0;
      }
      s = state_.load(std::memory_order_acquire);
    }
    if (stop_.load()) return;
    seen = s >> 1;
    active_.fetch_add(1, std::memory_order_seq_cst);
    if (state_.load(std::memory_order_seq_cst) == s) {  // still open: the section's fields are valid
      if (run_fn_ != nullptr) {
        (*run_fn_)(index, n_threads_);
        finished_.fetch_add(1, std::memory_order_release);
      } else {
        chunk_loop(index);
      }
    }
    active_.fetch_sub(1, std::memory_order_release);
  }
}

}  // namespace merlin
