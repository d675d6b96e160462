// Anonymous memory in transparent huge pages, for large buffers streamed on every token: the model's weight
// copy (runtime/model.cpp) and a server's K/V cache (runtime/cpu_backend.cpp). A 2 MiB page costs one TLB
// entry and one fault where 4 KiB pages cost 512, and the hardware prefetchers do not stop at its inner
// 4 KiB boundaries.
#pragma once
#include <cstddef>
#include <cstdint>

namespace merlin {

constexpr size_t kHugePageBytes = size_t{2} << 20;
constexpr size_t kPageBytes = 4096;

// `bytes` (a multiple of 4 KiB) of anonymous memory starting on a 2 MiB boundary and advised for transparent
// huge pages: every whole 2 MiB stretch becomes one huge page, and the tail past the last boundary stays in
// 4 KiB pages instead of costing a whole huge page. Untouched (no RSS) until written. Null on failure.
uint8_t* map_huge_page_aligned(size_t bytes);

// munmap for map_huge_page_aligned's memory, as a unique_ptr deleter.
struct HugePageUnmap {
  size_t bytes = 0;
  void operator()(uint8_t* p) const;
};

// Faults [p, p + bytes) in now (MADV_POPULATE_WRITE), so that the first writes later do not stop for page
// faults. Changes no byte, so other threads may use the memory meanwhile. False where the kernel (before
// Linux 5.14) or the memory refuses.
bool populate_pages(uint8_t* p, size_t bytes);

// MemAvailable of /proc/meminfo in bytes (0 when unknown).
uint64_t mem_available_bytes();

}  // namespace merlin
