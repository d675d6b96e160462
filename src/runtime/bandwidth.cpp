#include "runtime/bandwidth.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include <sys/mman.h>

#include "core/cpu_features.h"
#include "core/sys.h"
#include "core/thread_pool.h"

namespace merlin {
namespace {

// Compiled for AVX-512 through the target attribute and only called after run-time detection.
__attribute__((target("avx512f"))) uint64_t sum_avx512(const uint8_t* p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 256 <= n; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 192));
  }
  alignas(64) uint64_t lanes[8];  // not _mm512_reduce_add_epi64: GCC 12 warns inside target() functions
  _mm512_store_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
  uint64_t s = 0;
  for (uint64_t x : lanes) s += x;
  return s;
}

uint64_t sum_scalar(const uint8_t* p, size_t n) {
  const auto* q = reinterpret_cast<const uint64_t*>(p);
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (size_t i = 0; i + 4 <= n / 8; i += 4) {
    a0 += q[i];
    a1 += q[i + 1];
    a2 += q[i + 2];
    a3 += q[i + 3];
  }
  return a0 + a1 + a2 + a3;
}

}  // namespace

double read_bandwidth_gbps(int n_threads, size_t bytes, int reps) {
  n_threads = std::max(1, n_threads);
  bytes = std::max<size_t>(bytes / (256 * (size_t)n_threads), 1) * 256 * (size_t)n_threads;
  // The same kind of memory the weights live in (Model::load copies them into 2 MiB transparent huge pages),
  // so the roofline compares like with like.
  const size_t huge = size_t{2} << 20, mapped = (bytes + huge - 1) / huge * huge;
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return 0;
  ::madvise(p, mapped, MADV_HUGEPAGE);
  auto unmap = [mapped](uint8_t* q) { ::munmap(q, mapped); };
  std::unique_ptr<uint8_t, decltype(unmap)> buf(static_cast<uint8_t*>(p), unmap);
  ThreadPool pool(n_threads);
  const size_t slice = bytes / (size_t)n_threads;
  // Each thread touches its own slice first, so pages are resident (and local to it) before timing.
  pool.run([&](int t, int) { std::memset(buf.get() + (size_t)t * slice, 1, slice); });
  const bool avx512 = cpu_features().avx512f;
  std::atomic<uint64_t> sink{0};
  std::vector<double> gbps;
  for (int r = 0; r < std::max(1, reps); ++r) {
    const double t0 = now_seconds();
    pool.run([&](int t, int) {
      const uint8_t* p = buf.get() + (size_t)t * slice;
      sink += avx512 ? sum_avx512(p, slice) : sum_scalar(p, slice);
    });
    gbps.push_back((double)bytes / (now_seconds() - t0) / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  return sink.load() == 42 ? 0 : gbps[gbps.size() / 2];  // the sink comparison keeps the sums alive
}

}  // namespace merlin
