#include "core/atomic_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace merlin {

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  tmp_path_ = cat(path_, ".tmp.", ::getpid());
  f_ = std::fopen(tmp_path_.c_str(), "wb");
  if (f_ == nullptr) fail("cannot create '", tmp_path_, "': ", std::strerror(errno));
  std::setvbuf(f_, nullptr, _IOFBF, 1 << 20);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (f_ != nullptr) std::fclose(f_);
  if (!committed_) std::remove(tmp_path_.c_str());
}

void AtomicFileWriter::write(const void* data, size_t n) {
  if (n == 0) return;
  if (std::fwrite(data, 1, n, f_) != n) fail("write to '", tmp_path_, "' failed: ", std::strerror(errno));
  pos_ += n;
}

void AtomicFileWriter::write_zeros(size_t n) {
  static const std::vector<uint8_t> zeros(4096, 0);
  while (n > 0) {
    const size_t k = n < zeros.size() ? n : zeros.size();
    write(zeros.data(), k);
    n -= k;
  }
}

void AtomicFileWriter::commit() {
  if (std::fflush(f_) != 0 || ::fsync(::fileno(f_)) != 0)
    fail("flushing '", tmp_path_, "' failed: ", std::strerror(errno));
  if (std::fclose(f_) != 0) {
    f_ = nullptr;
    fail("closing '", tmp_path_, "' failed: ", std::strerror(errno));
  }
  f_ = nullptr;
  if (std::rename(tmp_path_.c_str(), path_.c_str()) != 0)
    fail("renaming '", tmp_path_, "' to '", path_, "' failed: ", std::strerror(errno));
  committed_ = true;
}

}  // namespace merlin
