// GGUF v3 reading and writing (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
//
// Reading: the whole file is mmapped and validated up front (magic, version, counts, string lengths,
// types, dimensions, offsets and sizes against the file size), so the rest of Merlin can trust a
// gguf::File. Tensor data is used in place from the map.
// Writing: streaming. Declare metadata and tensors, then write the tensors' bytes in declaration order,
// so a model far larger than memory can be written.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "core/dtype.h"
#include "core/mapped_file.h"

namespace merlin {
class AtomicFileWriter;
}

namespace merlin::gguf {

inline constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
inline constexpr uint32_t kVersion = 3;
inline constexpr uint32_t kDefaultAlignment = 32;

enum class ValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};
const char* value_type_name(ValueType t);

struct Value;
struct Array {
  ValueType type = ValueType::U8;  // element type (ARRAY for nested arrays)
  std::vector<Value> items;
};

// One metadata value. The variant index order is not the GGUF type order; use type().
struct Value {
  using Storage = std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool, std::string,
                               Array, uint64_t, int64_t, double>;
  Storage v;

  Value() : v(uint8_t{0}) {}
  template <typename T>
  Value(T x) : v(std::move(x)) {}  // NOLINT: implicit on purpose, Value{uint32_t(3)}
  Value(const char* s) : v(std::string(s)) {}

  ValueType type() const;
  bool is_integer() const;
  // Conversions; throw merlin::Error naming `what` when the value has the wrong type or is out of range.
  int64_t as_int(const std::string& what = "value") const;
  double as_double(const std::string& what = "value") const;
  bool as_bool(const std::string& what = "value") const;
  const std::string& as_string(const std::string& what = "value") const;
  const Array& as_array(const std::string& what = "value") const;
  std::string to_string(size_t max_items = 8) const;  // for `merlin info`
};

// Helpers to build arrays.
Value make_array(const std::vector<std::string>& items);
Value make_array(const std::vector<float>& items);
Value make_array(const std::vector<int32_t>& items);

// Key/value pairs in file order.
class Metadata {
 public:
  void set(const std::string& key, Value v);  // replaces an existing key in place
  const Value* find(const std::string& key) const;
  const Value& at(const std::string& key) const;  // throws "missing metadata key 'k'"
  bool contains(const std::string& key) const { return find(key) != nullptr; }
  const std::vector<std::pair<std::string, Value>>& entries() const { return entries_; }
  size_t size() const { return entries_.size(); }

  // Typed lookups with defaults, converting between integer widths.
  int64_t get_int(const std::string& key, int64_t dflt) const;
  double get_double(const std::string& key, double dflt) const;
  std::string get_string(const std::string& key, const std::string& dflt) const;

 private:
  std::vector<std::pair<std::string, Value>> entries_;
  std::map<std::string, size_t> index_;
};

struct TensorInfo {
  std::string name;
  std::vector<uint64_t> dims;  // GGUF order: dims[0] is the fastest-varying (row length)
  DType type = DType::F32;
  uint64_t offset = 0;  // relative to the start of the data section
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;
  const uint8_t* data = nullptr;  // points into the mapped file (reader only)

  uint64_t row_length() const { return dims.empty() ? 1 : dims[0]; }
  uint64_t n_rows() const { return dims.empty() ? 1 : n_elements / dims[0]; }
};

class File {
 public:
  // Maps and validates `path`; throws merlin::Error with a one-line reason on any problem.
  static std::unique_ptr<File> open(const std::string& path);
  // Parses a buffer the caller keeps alive (used by the fuzzer and tests).
  static std::unique_ptr<File> parse(const uint8_t* data, size_t size, const std::string& name = "<buffer>");

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  size_t file_size() const { return size_; }
  const std::string& path() const { return name_; }
  const Metadata& metadata() const { return metadata_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(const std::string& name) const;
  const TensorInfo& tensor(const std::string& name) const;  // throws "missing tensor 'x'"

  // For a loader that has copied what it needs (RSS matters on small devices): replaces a metadata value by
  // an empty array of the same element type (the key stays, so `contains` still answers), and drops the
  // map's resident pages (later reads fault them in again from the file; no-op for parse()d buffers).
  void release_metadata(const std::string& key);
  void release_resident_pages() const;

 private:
  File() = default;
  void parse_all(const uint8_t* data, size_t size);
  MappedFile map_;
  std::string name_;
  size_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = kDefaultAlignment;
  uint64_t data_offset_ = 0;
  Metadata metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

// Streaming writer. Usage: set metadata, add_tensor() for every tensor, then write_tensor_data() for each
// tensor in the same order (possibly in several chunks), then finish(). The file appears under `path`
// only when finish() succeeds (temporary name + rename).
class Writer {
 public:
  explicit Writer(const std::string& path);
  ~Writer();
  Metadata& metadata() { return metadata_; }
  void add_tensor(const std::string& name, std::vector<uint64_t> dims, DType type);
  // Writes the next chunk of the current tensor's bytes; the header is written on the first call.
  void write_tensor_data(const void* data, size_t n_bytes);
  void finish();
  uint64_t bytes_written() const;

 private:
  void write_header();
  void finish_current_tensor_if_complete();
  std::string path_;
  Metadata metadata_;
  std::vector<TensorInfo> tensors_;
  std::unique_ptr<AtomicFileWriter> out_;
  bool header_written_ = false;
  size_t current_ = 0;         // index of the tensor being written
  uint64_t current_done_ = 0;  // bytes of it written so far
  uint64_t alignment_ = kDefaultAlignment;
};

}  // namespace merlin::gguf
