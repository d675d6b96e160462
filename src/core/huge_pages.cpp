#include "core/huge_pages.h"

#include <sys/mman.h>

#include <fstream>
#include <string>

namespace merlin {

uint8_t* map_huge_page_aligned(size_t bytes) {
  const size_t reserve = bytes + kHugePageBytes;
  void* r = ::mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (r == MAP_FAILED) return nullptr;
  auto* base = static_cast<uint8_t*>(r);
  auto* p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(base) + kHugePageBytes - 1) & ~(kHugePageBytes - 1));
  if (p > base) ::munmap(base, (size_t)(p - base));
  if (base + reserve > p + bytes) ::munmap(p + bytes, (size_t)(base + reserve - (p + bytes)));
  ::madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

void HugePageUnmap::operator()(uint8_t* p) const {
  if (p != nullptr) ::munmap(p, bytes);
}

bool populate_pages(uint8_t* p, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  return ::madvise(p, bytes, MADV_POPULATE_WRITE) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

uint64_t mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  while (f >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024;
    f.ignore(1 << 10, '\n');
  }
  return 0;
}

}  // namespace merlin
