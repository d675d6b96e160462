// Files we write (models, checkpoints, shards) go to "<path>.tmp.<pid>" and are renamed over the target
// only after a successful flush+fsync, so a crash or a full disk never leaves a torn file behind.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

namespace merlin {

class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);  // opens the temporary file; throws merlin::Error
  ~AtomicFileWriter();                          // removes the temporary file unless commit() ran
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, size_t n);
  void write_zeros(size_t n);
  uint64_t position() const { return pos_; }
  void commit();  // flush, fsync, rename into place

 private:
  std::string path_, tmp_path_;
  std::FILE* f_ = nullptr;
  uint64_t pos_ = 0;
  bool committed_ = false;
};

}  // namespace merlin
