#include "core/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#define MERLIN_PAUSE() _mm_pause()
#else
#define MERLIN_PAUSE() ((void)0)
#endif

namespace merlin {

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int ThreadPool::default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : (int)n;
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  fn(0, n_threads_);
  // Spin first (the common case is a few microseconds), then yield so an oversubscribed machine can run
  // the worker we are waiting for.
  for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) {
    if (spin < 4000) MERLIN_PAUSE();
    else std::this_thread::yield();
  }
  job_ = nullptr;
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

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    // Spin for a short while: the next parallel section usually follows within microseconds.
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spin = 0; gen == seen && spin < 20000; ++spin) {
      if (spin < 4000) MERLIN_PAUSE();
      else std::this_thread::yield();
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      gen = generation_.load(std::memory_order_acquire);
    }
    seen = gen;
    if (stop_.load()) return;
    (*job_)(index, n_threads_);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace merlin
