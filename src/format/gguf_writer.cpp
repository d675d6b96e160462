// Streaming GGUF writer: the header (metadata + tensor infos with precomputed offsets) goes out first,
// then each tensor's bytes in declaration order, padded to the alignment.
#include <cstring>

#include "core/atomic_file.h"
#include "core/error.h"
#include "format/gguf.h"

namespace merlin::gguf {
namespace {

template <typename T>
void put(AtomicFileWriter& out, T x) {
  out.write(&x, sizeof(T));
}

void put_string(AtomicFileWriter& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out.write(s.data(), s.size());
}

void put_value(AtomicFileWriter& out, const Value& v);

void put_array(AtomicFileWriter& out, const Array& a) {
  put<uint32_t>(out, (uint32_t)a.type);
  put<uint64_t>(out, a.items.size());
  for (const Value& item : a.items) {
    MERLIN_CHECK(item.type() == a.type, "array element of type ", value_type_name(item.type()),
                 " in an array of ", value_type_name(a.type));
    put_value(out, item);
  }
}

void put_value(AtomicFileWriter& out, const Value& v) {
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) put_string(out, x);
        else if constexpr (std::is_same_v<T, Array>) put_array(out, x);
        else if constexpr (std::is_same_v<T, bool>) put<uint8_t>(out, x ? 1 : 0);
        else put<T>(out, x);
      },
      v.v);
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

Writer::Writer(const std::string& path) : path_(path) {}
Writer::~Writer() = default;

void Writer::add_tensor(const std::string& name, std::vector<uint64_t> dims, DType type) {
  MERLIN_CHECK(!header_written_, "gguf::Writer: add_tensor after data was written");
  MERLIN_CHECK(!dims.empty() && dims.size() <= 4, "tensor '", name, "' must have 1..4 dimensions");
  for (const TensorInfo& t : tensors_) MERLIN_CHECK(t.name != name, "duplicate tensor '", name, "'");
  TensorInfo t;
  t.name = name;
  t.type = type;
  t.n_elements = 1;
  for (uint64_t d : dims) t.n_elements *= d;
  t.dims = std::move(dims);
  t.n_bytes = dtype_row_bytes(type, t.dims[0]) * (t.n_elements / t.dims[0]);
  tensors_.push_back(std::move(t));
}

void Writer::write_header() {
  if (const Value* a = metadata_.find("general.alignment")) alignment_ = (uint64_t)a->as_int("general.alignment");
  MERLIN_CHECK(alignment_ > 0 && (alignment_ & (alignment_ - 1)) == 0, "alignment must be a power of two");
  uint64_t offset = 0;
  for (TensorInfo& t : tensors_) {
    t.offset = offset;
    offset = align_up(offset + t.n_bytes, alignment_);
  }
  out_ = std::make_unique<AtomicFileWriter>(path_);
  put<uint32_t>(*out_, kMagic);
  put<uint32_t>(*out_, kVersion);
  put<uint64_t>(*out_, tensors_.size());
  put<uint64_t>(*out_, metadata_.size());
  for (const auto& [key, value] : metadata_.entries()) {
    put_string(*out_, key);
    put<uint32_t>(*out_, (uint32_t)value.type());
    put_value(*out_, value);
  }
  for (const TensorInfo& t : tensors_) {
    put_string(*out_, t.name);
    put<uint32_t>(*out_, (uint32_t)t.dims.size());
    for (uint64_t d : t.dims) put<uint64_t>(*out_, d);
    put<uint32_t>(*out_, (uint32_t)t.type);
    put<uint64_t>(*out_, t.offset);
  }
  out_->write_zeros(align_up(out_->position(), alignment_) - out_->position());
  header_written_ = true;
  finish_current_tensor_if_complete();  // zero-byte tensors need no data
}

void Writer::write_tensor_data(const void* data, size_t n_bytes) {
  if (!header_written_) write_header();
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n_bytes > 0) {
    MERLIN_CHECK(current_ < tensors_.size(), "gguf::Writer: more tensor data than declared");
    const TensorInfo& t = tensors_[current_];
    const uint64_t take = std::min<uint64_t>(n_bytes, t.n_bytes - current_done_);
    out_->write(p, take);
    p += take;
    n_bytes -= take;
    current_done_ += take;
    finish_current_tensor_if_complete();
  }
}

void Writer::finish_current_tensor_if_complete() {
  while (current_ < tensors_.size() && current_done_ == tensors_[current_].n_bytes) {
    ++current_;
    current_done_ = 0;
    out_->write_zeros(align_up(out_->position(), alignment_) - out_->position());
  }
}

void Writer::finish() {
  if (!header_written_) write_header();
  MERLIN_CHECK(current_ == tensors_.size(), "gguf::Writer: tensor '", tensors_[current_].name,
               "' got ", current_done_, " of ", tensors_[current_].n_bytes, " bytes");
  out_->commit();
}

uint64_t Writer::bytes_written() const { return out_ ? out_->position() : 0; }

}  // namespace merlin::gguf
