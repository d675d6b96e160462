// A small persistent thread pool tuned for many short parallel sections (a decode step has several per
// layer): workers spin briefly on a generation counter before sleeping, and the calling thread takes
// part in the work, so n_threads == 2 means one extra thread.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace merlin {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Runs fn(thread_index, n_threads) once on every thread (the caller is index 0) and waits.
  void run(const std::function<void(int, int)>& fn);

  // Splits [0, n) into one contiguous range per thread, each a multiple of `align` (except the last).
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t align = 1);

  static int default_threads();  // hardware concurrency, at least 1

 private:
  void worker_loop(int index);

  int n_threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace merlin
