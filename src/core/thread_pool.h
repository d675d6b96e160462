// A small persistent thread pool tuned for many short parallel sections (a decode step has several per
// layer): workers spin briefly on an epoch counter before sleeping, and the calling thread takes part in
// the work, so n_threads == 2 means one extra thread.
//
// for_chunks() is the one to use on a machine shared with other processes (a server next to its clients):
// a worker that is preempted, or still asleep, does not hold the section up, because its share of the work
// is taken over and a worker that arrives after the work is done is not waited for.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
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

  // Calls fn(thread, begin, end) for chunks [c * grain, min(n, (c + 1) * grain)) that together cover [0, n)
  // exactly once, and returns when all are done. Thread t starts on the t-th contiguous share of the chunks,
  // front to back (what a static split would give it); a thread whose share is done takes chunks from the back
  // of another's. Which thread runs a chunk is therefore not fixed: `thread` (0 = the caller) is only for
  // per-thread scratch, and no two calls with the same `thread` overlap.
  using ChunkFn = std::function<void(int thread, int64_t begin, int64_t end)>;
  void for_chunks(int64_t n, int64_t grain, const ChunkFn& fn);

  static int default_threads();  // hardware concurrency, at least 1

 private:
  struct alignas(64) Share {
    std::atomic<uint64_t> range{0};  // (first << 32) | end, in chunks
  };
  void worker_loop(int index);
  void open_epoch();
  void close_epoch();
  void chunk_loop(int thread);
  bool take(int thread, int64_t& chunk);

  int n_threads_;
  std::vector<std::thread> workers_;
  // The current section: run()'s function, or for_chunks()'s.
  const std::function<void(int, int)>* run_fn_ = nullptr;
  const ChunkFn* chunk_fn_ = nullptr;
  int64_t n_ = 0, grain_ = 1;
  std::unique_ptr<Share[]> shares_;
  // (epoch << 1) | open. Workers join an open epoch once; the caller closes it when the work is done and then
  // waits only for workers that joined (active_), never for one that has not arrived.
  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<int> active_{0};
  alignas(64) std::atomic<int> finished_{0};   // run(): workers done with this epoch
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace merlin
