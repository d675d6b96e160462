// GGUF reader/writer: round trips of every value type, llama.cpp's files, and hostile input.
#include <cstring>
#include <fstream>
#include <iterator>

#include "core/error.h"
#include "format/gguf.h"
#include "test_util.h"

using namespace merlin;
using namespace merlin::gguf;

namespace {

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A small file with every metadata type, a nested array and three tensors.
std::string write_sample(const test::TempDir& dir) {
  const std::string path = dir.file("sample.gguf");
  Writer w(path);
  Metadata& md = w.metadata();
  md.set("general.architecture", "llama");
  md.set("u8", uint8_t{200});
  md.set("i8", int8_t{-100});
  md.set("u16", uint16_t{60000});
  md.set("i16", int16_t{-30000});
  md.set("u32", uint32_t{4000000000u});
  md.set("i32", int32_t{-2000000000});
  md.set("f32", 1.5f);
  md.set("bool", true);
  md.set("string", std::string("héllo"));
  md.set("u64", uint64_t{1} << 60);
  md.set("i64", -(int64_t{1} << 60));
  md.set("f64", 2.25);
  md.set("strings", make_array(std::vector<std::string>{"a", "", "ccc"}));
  Array inner1, inner2, outer;
  inner1.type = inner2.type = ValueType::I32;
  inner1.items = {int32_t{1}, int32_t{2}};
  inner2.items = {int32_t{3}};
  outer.type = ValueType::ARRAY;
  outer.items = {Value(inner1), Value(inner2)};
  md.set("nested", Value(outer));
  md.set("general.alignment", uint32_t{64});
  w.add_tensor("a", {3, 2}, DType::F32);
  w.add_tensor("b", {5}, DType::F16);
  w.add_tensor("c", {4, 1, 1}, DType::BF16);
  const float a[6] = {1, 2, 3, 4, 5, 6};
  w.write_tensor_data(a, 8);  // in two chunks
  w.write_tensor_data(reinterpret_cast<const uint8_t*>(a) + 8, 16);
  uint16_t b[5];
  for (int i = 0; i < 5; ++i) b[i] = f32_to_fp16((float)i * 0.5f);
  w.write_tensor_data(b, sizeof b);
  uint16_t c[4];
  for (int i = 0; i < 4; ++i) c[i] = f32_to_bf16(-(float)i);
  w.write_tensor_data(c, sizeof c);
  w.finish();
  return path;
}

void expect_error(std::vector<uint8_t> bytes, const std::string& needle) {
  SCOPED_TRACE(needle);
  try {
    File::parse(bytes.data(), bytes.size(), "bad.gguf");
    FAIL() << "parse succeeded, expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "error must be one line";
  }
}

template <typename T>
void poke(std::vector<uint8_t>& b, size_t off, T v) {
  std::memcpy(b.data() + off, &v, sizeof v);
}

}  // namespace

TEST(Gguf, RoundTripEveryValueType) {
  test::TempDir dir;
  auto f = File::open(write_sample(dir));
  const Metadata& md = f->metadata();
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->alignment(), 64u);
  EXPECT_EQ(md.at("u8").as_int(), 200);
  EXPECT_EQ(md.at("i8").as_int(), -100);
  EXPECT_EQ(md.at("u16").as_int(), 60000);
  EXPECT_EQ(md.at("i16").as_int(), -30000);
  EXPECT_EQ(md.at("u32").as_int(), 4000000000LL);
  EXPECT_EQ(md.at("i32").as_int(), -2000000000LL);
  EXPECT_FLOAT_EQ((float)md.at("f32").as_double(), 1.5f);
  EXPECT_TRUE(md.at("bool").as_bool());
  EXPECT_EQ(md.at("string").as_string(), "héllo");
  EXPECT_EQ(md.at("u64").as_int(), int64_t{1} << 60);
  EXPECT_EQ(md.at("i64").as_int(), -(int64_t{1} << 60));
  EXPECT_DOUBLE_EQ(md.at("f64").as_double(), 2.25);
  EXPECT_EQ(md.at("u8").type(), ValueType::U8);
  EXPECT_EQ(md.at("f64").type(), ValueType::F64);
  const Array& s = md.at("strings").as_array();
  ASSERT_EQ(s.items.size(), 3u);
  EXPECT_EQ(s.items[2].as_string(), "ccc");
  const Array& n = md.at("nested").as_array();
  ASSERT_EQ(n.type, ValueType::ARRAY);
  ASSERT_EQ(n.items.size(), 2u);
  EXPECT_EQ(n.items[0].as_array().items[1].as_int(), 2);
  EXPECT_EQ(n.items[1].as_array().items[0].as_int(), 3);
  // Entries keep file order.
  EXPECT_EQ(md.entries()[0].first, "general.architecture");

  ASSERT_EQ(f->tensors().size(), 3u);
  const TensorInfo& a = f->tensor("a");
  EXPECT_EQ(a.dims, (std::vector<uint64_t>{3, 2}));
  EXPECT_EQ(a.n_bytes, 24u);
  EXPECT_EQ(a.row_length(), 3u);
  EXPECT_EQ(a.n_rows(), 2u);
  EXPECT_EQ(reinterpret_cast<const float*>(a.data)[5], 6.0f);
  for (const TensorInfo& t : f->tensors()) EXPECT_EQ((t.data - (const uint8_t*)nullptr) % 64, 0) << t.name;
  EXPECT_EQ(fp16_to_f32(reinterpret_cast<const uint16_t*>(f->tensor("b").data)[3]), 1.5f);
  EXPECT_EQ(bf16_to_f32(reinterpret_cast<const uint16_t*>(f->tensor("c").data)[2]), -2.0f);
  EXPECT_EQ(f->find_tensor("missing"), nullptr);
  EXPECT_THROW(f->tensor("missing"), Error);
  EXPECT_THROW(md.at("missing"), Error);
  EXPECT_THROW(md.at("string").as_int(), Error);
}

// A loader drops arrays it has copied and the map's resident pages; the file still reads the same afterwards.
TEST(Gguf, ReleaseMetadataAndPages) {
  test::TempDir dir;
  auto f = File::open(write_sample(dir));
  f->release_metadata("strings");
  f->release_metadata("missing");  // no-op
  const Array& s = f->metadata().at("strings").as_array();
  EXPECT_EQ(s.type, ValueType::STRING);
  EXPECT_TRUE(s.items.empty());
  EXPECT_EQ(f->metadata().at("string").as_string(), "héllo");
  f->release_resident_pages();
  EXPECT_EQ(reinterpret_cast<const float*>(f->tensor("a").data)[5], 6.0f);
}

TEST(Gguf, WriterRejectsShortOrExtraData) {
  test::TempDir dir;
  {
    Writer w(dir.file("short.gguf"));
    w.add_tensor("a", {4}, DType::F32);
    const float x[2] = {1, 2};
    w.write_tensor_data(x, sizeof x);
    EXPECT_THROW(w.finish(), Error);
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("short.gguf"))) << "a failed write must leave no file";
  Writer w(dir.file("long.gguf"));
  w.add_tensor("a", {1}, DType::F32);
  const float x[2] = {1, 2};
  EXPECT_THROW(w.write_tensor_data(x, sizeof x), Error);
}

TEST(Gguf, ReadsLlamaCppFiles) {
  MERLIN_REQUIRE_DATA(stories, "models/stories260K/stories260K.gguf");
  auto f = File::open(stories);
  EXPECT_EQ(f->metadata().get_string("general.architecture", ""), "llama");
  EXPECT_EQ(f->tensors().size(), 48u);
  EXPECT_EQ(f->tensor("token_embd.weight").dims, (std::vector<uint64_t>{64, 512}));
  EXPECT_EQ(f->metadata().at("tokenizer.ggml.tokens").as_array().items.size(), 512u);
  for (const char* type : {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "tq1_0", "tq2_0"}) {
    const std::string p = test::data_file(std::string("models/tiny-llama-conformance/tiny-") + type + ".gguf");
    if (p.empty()) continue;
    auto t = File::open(p);
    EXPECT_EQ(dtype_name(t->tensor("blk.0.attn_q.weight").type), std::string(type)) << p;
  }
}

TEST(Gguf, EveryTruncationIsAnError) {
  test::TempDir dir;
  const std::vector<uint8_t> full = read_all(write_sample(dir));
  ASSERT_NO_THROW(File::parse(full.data(), full.size()));
  // Every prefix that cuts into the header or the tensor data must fail cleanly.
  const size_t last_tensor_end = full.size() - 64 + 8;  // "c" is 8 bytes in the last 64-byte slot
  for (size_t n = 0; n < last_tensor_end; ++n) {
    std::vector<uint8_t> cut(full.begin(), full.begin() + (ptrdiff_t)n);
    EXPECT_THROW(File::parse(cut.data(), cut.size()), Error) << "prefix of " << n << " bytes";
  }
}

TEST(Gguf, HostileHeaders) {
  test::TempDir dir;
  const std::vector<uint8_t> good = read_all(write_sample(dir));
  auto b = good;
  b[0] = 'X';
  expect_error(b, "bad magic");
  b = good;
  poke<uint32_t>(b, 4, 99);
  expect_error(b, "unsupported GGUF version 99");
  b = good;
  poke<uint64_t>(b, 8, uint64_t{1} << 60);
  expect_error(b, "tensor count");
  b = good;
  poke<uint64_t>(b, 16, uint64_t{1} << 60);
  expect_error(b, "metadata count");
  b = good;
  poke<uint64_t>(b, 24, uint64_t{1} << 62);  // length of the first key
  expect_error(b, "truncated");
  expect_error({}, "not a GGUF file");
}

TEST(Gguf, HostileTensorInfos) {
  // Build a minimal file by hand: no metadata, one tensor, so offsets are easy to poke.
  auto make = [](uint32_t n_dims, uint64_t dim0, uint32_t type, uint64_t offset, size_t data_bytes) {
    std::vector<uint8_t> b;
    auto put = [&](const void* p, size_t n) { b.insert(b.end(), (const uint8_t*)p, (const uint8_t*)p + n); };
    const uint32_t magic = kMagic, version = 3;
    const uint64_t n_tensors = 1, n_kv = 0, name_len = 1;
    put(&magic, 4);
    put(&version, 4);
    put(&n_tensors, 8);
    put(&n_kv, 8);
    put(&name_len, 8);
    b.push_back('t');
    put(&n_dims, 4);
    for (uint32_t i = 0; i < n_dims && i < 8; ++i) put(i == 0 ? &dim0 : &name_len, 8);
    put(&type, 4);
    put(&offset, 8);
    b.resize((b.size() + 31) / 32 * 32 + data_bytes, 0);
    return b;
  };
  EXPECT_NO_THROW(File::parse(make(1, 4, 0, 0, 16).data(), make(1, 4, 0, 0, 16).size()));
  expect_error(make(1, 4, 250, 0, 16), "unknown type id 250");
  expect_error(make(1, 4, 0, 32, 16), "past the end");
  expect_error(make(1, 4, 0, uint64_t{1} << 63, 16), "past the end");
  expect_error(make(1, 4, 0, 3, 16), "not aligned");
  expect_error(make(1, uint64_t{1} << 62, 0, 0, 16), "too large");
  expect_error(make(1, uint64_t{1} << 40, 0, 0, 16), "past the end");
  expect_error(make(1, 0, 0, 0, 16), "invalid dimension");
  expect_error(make(5, 4, 0, 0, 16), "dimensions");
  expect_error(make(1, 33, 8, 0, 64), "block size");  // Q8_0 rows must be multiples of 32
}
