// GGUF parsing. Every count, length and offset is checked against the bytes actually present before it
// is used, so a hostile or truncated file produces a merlin::Error and never an out-of-bounds read or a
// huge allocation.
#include <sys/mman.h>

#include <cstring>
#include <limits>

#include "core/error.h"
#include "format/gguf.h"

namespace merlin::gguf {
namespace {

constexpr int kMaxArrayDepth = 8;
constexpr uint32_t kMaxDims = 4;  // GGML_MAX_DIMS

class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size, const std::string& name) : p_(data), end_(data + size), begin_(data), name_(name) {}

  size_t offset() const { return (size_t)(p_ - begin_); }
  size_t remaining() const { return (size_t)(end_ - p_); }

  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T x;
    std::memcpy(&x, p_, sizeof(T));
    p_ += sizeof(T);
    return x;
  }

  std::string read_string(const char* what) {
    const uint64_t n = read<uint64_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(p_), (size_t)n);
    p_ += n;
    return s;
  }

  void need(uint64_t n, const char* what) const {
    if (n > remaining())
      fail(name_, ": truncated file: ", what, " needs ", n, " bytes at offset ", offset(), " but only ",
           remaining(), " remain");
  }

  [[noreturn]] void error(const std::string& msg) const { fail(name_, ": ", msg, " (at offset ", offset(), ")"); }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
  const uint8_t* begin_;
  const std::string& name_;
};

// Smallest encoded size of one value of this type: bounds array counts before reserving memory.
uint64_t min_encoded_size(ValueType t) {
  switch (t) {
    case ValueType::U8: case ValueType::I8: case ValueType::BOOL: return 1;
    case ValueType::U16: case ValueType::I16: return 2;
    case ValueType::U32: case ValueType::I32: case ValueType::F32: return 4;
    case ValueType::U64: case ValueType::I64: case ValueType::F64: case ValueType::STRING: return 8;
    case ValueType::ARRAY: return 12;
  }
  return 1;
}

bool valid_value_type(uint32_t t) { return t <= (uint32_t)ValueType::F64; }

Value read_value(Cursor& c, ValueType type, int depth);

Array read_array(Cursor& c, int depth) {
  if (depth > kMaxArrayDepth) c.error("arrays nested too deeply");
  const uint32_t et = c.read<uint32_t>("array element type");
  if (!valid_value_type(et)) c.error(cat("unknown array element type ", et));
  const uint64_t n = c.read<uint64_t>("array length");
  const ValueType etype = (ValueType)et;
  if (n > c.remaining() / min_encoded_size(etype))
    c.error(cat("array of ", n, " ", value_type_name(etype), " values does not fit in the file"));
  Array a;
  a.type = etype;
  a.items.reserve((size_t)n);
  for (uint64_t i = 0; i < n; ++i) a.items.push_back(read_value(c, etype, depth + 1));
  return a;
}

Value read_value(Cursor& c, ValueType type, int depth) {
  switch (type) {
    case ValueType::U8: return c.read<uint8_t>("u8 value");
    case ValueType::I8: return c.read<int8_t>("i8 value");
    case ValueType::U16: return c.read<uint16_t>("u16 value");
    case ValueType::I16: return c.read<int16_t>("i16 value");
    case ValueType::U32: return c.read<uint32_t>("u32 value");
    case ValueType::I32: return c.read<int32_t>("i32 value");
    case ValueType::F32: return c.read<float>("f32 value");
    case ValueType::U64: return c.read<uint64_t>("u64 value");
    case ValueType::I64: return c.read<int64_t>("i64 value");
    case ValueType::F64: return c.read<double>("f64 value");
    case ValueType::BOOL: {
      const uint8_t b = c.read<uint8_t>("bool value");
      if (b > 1) c.error(cat("bool value ", (int)b, " is neither 0 nor 1"));
      return b != 0;
    }
    case ValueType::STRING: return c.read_string("string value");
    case ValueType::ARRAY: return read_array(c, depth);
  }
  c.error("unknown value type");
}

}  // namespace

std::unique_ptr<File> File::open(const std::string& path) {
  std::unique_ptr<File> f(new File());
  f->map_ = MappedFile(path);
  f->name_ = path;
  f->parse_all(f->map_.data(), f->map_.size());
  return f;
}

void File::release_metadata(const std::string& key) {
  const Value* v = metadata_.find(key);
  if (v == nullptr) return;
  Array empty;
  if (v->type() == ValueType::ARRAY) empty.type = v->as_array().type;
  metadata_.set(key, Value(std::move(empty)));
}

void File::release_resident_pages() const {
  if (map_.data() == nullptr || map_.size() == 0) return;
  ::madvise(const_cast<uint8_t*>(map_.data()), map_.size(), MADV_DONTNEED);
}

std::unique_ptr<File> File::parse(const uint8_t* data, size_t size, const std::string& name) {
  std::unique_ptr<File> f(new File());
  f->name_ = name;
  f->parse_all(data, size);
  return f;
}

void File::parse_all(const uint8_t* data, size_t size) {
  size_ = size;
  static const uint8_t kEmpty = 0;
  Cursor c(data ? data : &kEmpty, data ? size : 0, name_);
  if (size < 4) fail(name_, ": not a GGUF file (", size, " bytes)");
  const uint32_t magic = c.read<uint32_t>("magic");
  if (magic != kMagic) fail(name_, ": not a GGUF file (bad magic)");
  version_ = c.read<uint32_t>("version");
  if (version_ != 2 && version_ != 3)
    fail(name_, ": unsupported GGUF version ", version_, " (Merlin reads versions 2 and 3)");
  const uint64_t n_tensors = c.read<uint64_t>("tensor count");
  const uint64_t n_kv = c.read<uint64_t>("metadata count");
  // Each key/value takes at least 8 (key length) + 4 (type) + 1 bytes; each tensor info at least 8+4+8+4+8.
  if (n_kv > c.remaining() / 13) c.error(cat("metadata count ", n_kv, " does not fit in the file"));
  if (n_tensors > c.remaining() / 32) c.error(cat("tensor count ", n_tensors, " does not fit in the file"));

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = c.read_string("metadata key");
    if (metadata_.contains(key)) c.error(cat("duplicate metadata key '", key, "'"));
    const uint32_t t = c.read<uint32_t>("metadata value type");
    if (!valid_value_type(t)) c.error(cat("metadata key '", key, "' has unknown value type ", t));
    metadata_.set(key, read_value(c, (ValueType)t, 0));
  }

  if (const Value* a = metadata_.find("general.alignment")) {
    const int64_t al = a->as_int("general.alignment");
    if (al <= 0 || al > (1 << 20) || (al & (al - 1)) != 0)
      fail(name_, ": general.alignment ", al, " is not a power of two up to 1 MiB");
    alignment_ = (uint64_t)al;
  }

  tensors_.reserve((size_t)n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo t;
    t.name = c.read_string("tensor name");
    if (tensor_index_.count(t.name)) c.error(cat("duplicate tensor '", t.name, "'"));
    const uint32_t n_dims = c.read<uint32_t>("tensor dimension count");
    if (n_dims == 0 || n_dims > kMaxDims) c.error(cat("tensor '", t.name, "' has ", n_dims, " dimensions (1..4 allowed)"));
    t.n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t ne = c.read<uint64_t>("tensor dimension");
      if (ne == 0 || ne > (uint64_t)std::numeric_limits<int64_t>::max() / t.n_elements)
        c.error(cat("tensor '", t.name, "' has an invalid dimension ", ne));
      t.dims.push_back(ne);
      t.n_elements *= ne;
    }
    const uint32_t type_id = c.read<uint32_t>("tensor type");
    const DTypeInfo* info = dtype_info(type_id);
    if (info == nullptr) c.error(cat("tensor '", t.name, "' has unknown type id ", type_id));
    t.type = info->type;
    if (t.dims[0] % info->block_size != 0)
      c.error(cat("tensor '", t.name, "': row length ", t.dims[0], " is not a multiple of ", info->name,
                  "'s block size ", info->block_size));
    const uint64_t n_blocks = t.n_elements / info->block_size;
    if (n_blocks > (uint64_t)std::numeric_limits<int64_t>::max() / info->block_bytes)
      c.error(cat("tensor '", t.name, "' is too large"));
    t.n_bytes = n_blocks * info->block_bytes;
    t.offset = c.read<uint64_t>("tensor offset");
    if (t.offset % alignment_ != 0) c.error(cat("tensor '", t.name, "' offset ", t.offset, " is not aligned"));
    tensor_index_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }

  data_offset_ = (c.offset() + alignment_ - 1) / alignment_ * alignment_;
  const uint64_t data_size = size >= data_offset_ ? size - data_offset_ : 0;
  for (TensorInfo& t : tensors_) {
    if (t.offset > data_size || t.n_bytes > data_size - t.offset)
      fail(name_, ": tensor '", t.name, "' (", t.n_bytes, " bytes at data offset ", t.offset,
           ") extends past the end of the file");
    t.data = data + data_offset_ + t.offset;
  }
}

const TensorInfo* File::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& File::tensor(const std::string& name) const {
  const TensorInfo* t = find_tensor(name);
  if (t == nullptr) fail(name_, ": missing tensor '", name, "'");
  return *t;
}

}  // namespace merlin::gguf
