// libFuzzer target for the GGUF reader: any byte string must either parse into a gguf::File whose every
// value and tensor byte can be read safely, or be rejected with merlin::Error. Anything else (a crash, a
// sanitizer report, a leak, another exception type, a broken invariant below) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "format/gguf.h"

using namespace merlin;

uint64_t g_fuzz_gguf_sink;  // external linkage, so the reads below are not optimised away

namespace {

#define FUZZ_CHECK(cond)                                                         \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::fprintf(stderr, "fuzz_gguf: invariant failed: %s (%s:%d)\n", #cond,   \
                   __FILE__, __LINE__);                                          \
      std::abort();                                                              \
    }                                                                            \
  } while (0)

void touch(const gguf::Value& v, int depth) {
  const gguf::ValueType t = v.type();
  g_fuzz_gguf_sink += std::string(gguf::value_type_name(t)).size();
  g_fuzz_gguf_sink += v.to_string().size();
  try {
    if (v.is_integer()) g_fuzz_gguf_sink += static_cast<uint64_t>(v.as_int());
  } catch (const Error&) {  // e.g. a u64 beyond int64's range
  }
  switch (t) {
    case gguf::ValueType::F32:
    case gguf::ValueType::F64:
      g_fuzz_gguf_sink += static_cast<uint64_t>(v.as_double() != 0);
      break;
    case gguf::ValueType::BOOL:
      g_fuzz_gguf_sink += v.as_bool();
      break;
    case gguf::ValueType::STRING:
      g_fuzz_gguf_sink += v.as_string().size();
      break;
    case gguf::ValueType::ARRAY: {
      const gguf::Array& a = v.as_array();
      g_fuzz_gguf_sink += v.to_string(std::numeric_limits<size_t>::max()).size();
      if (depth < 64) {
        for (const gguf::Value& item : a.items) {
          FUZZ_CHECK(item.type() == a.type);
          touch(item, depth + 1);
        }
      }
      break;
    }
    default:
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<gguf::File> f;
  try {
    f = gguf::File::parse(data, size, "<fuzz>");
  } catch (const Error&) {
    return 0;  // rejected with a reason: fine
  }
  FUZZ_CHECK(f != nullptr);
  FUZZ_CHECK(f->file_size() == size);
  // data_offset() may lie past the end when there is no tensor data (the padding after the header is
  // optional then), so only the tensors' own ranges are checked below.

  const gguf::Metadata& md = f->metadata();
  for (const auto& [key, value] : md.entries()) {
    FUZZ_CHECK(md.find(key) != nullptr);
    g_fuzz_gguf_sink += key.size();
    touch(value, 0);
  }
  try {
    g_fuzz_gguf_sink += static_cast<uint64_t>(md.get_int("general.alignment", 32));
    g_fuzz_gguf_sink += md.get_string("general.architecture", "").size();
  } catch (const Error&) {  // wrong type for a known key: may be rejected here instead of at parse time
  }

  for (const gguf::TensorInfo& t : f->tensors()) {
    FUZZ_CHECK(f->find_tensor(t.name) != nullptr);
    uint64_t n = 1;
    for (uint64_t d : t.dims) {
      FUZZ_CHECK(d == 0 || n <= std::numeric_limits<uint64_t>::max() / d);
      n *= d;
    }
    FUZZ_CHECK(n == t.n_elements);
    const DTypeInfo& ti = dtype_info(t.type);
    FUZZ_CHECK(t.row_length() % ti.block_size == 0);  // rows are whole blocks
    FUZZ_CHECK(t.n_bytes == t.n_elements / ti.block_size * ti.block_bytes);
    FUZZ_CHECK(t.n_bytes <= size);
    if (t.n_bytes > 0) {
      FUZZ_CHECK(t.data != nullptr);
      FUZZ_CHECK(t.data >= data && t.data <= data + size);
      FUZZ_CHECK(t.n_bytes <= static_cast<uint64_t>(data + size - t.data));
    }
    uint64_t sum = 0;
    for (uint64_t i = 0; i < t.n_bytes; ++i) sum += t.data[i];
    g_fuzz_gguf_sink += sum;
    g_fuzz_gguf_sink += std::string(dtype_name(t.type)).size();
  }
  return 0;
}
