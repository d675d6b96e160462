// merlin quantize (runtime/quantize_model.h): byte-identical to llama-quantize --pure on the tiny conformance
// model, fallbacks for rows that do not fit a type's blocks, overrides, metadata.
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "format/gguf.h"
#include "kernels/cpu/kernels.h"
#include "runtime/quantize_model.h"
#include "test_util.h"

using namespace merlin;

namespace {

constexpr const char* kDir = "models/tiny-llama-conformance/";

QuantizeOptions quiet(DType type) {
  QuantizeOptions o;
  o.type = type;
  o.progress = false;
  o.n_threads = 2;
  return o;
}

// Every tensor of `mine` has the same type, shape and bytes in `theirs` (file order may differ:
// llama-quantize reorders tensors, which readers never depend on).
void expect_same_tensors(const gguf::File& mine, const gguf::File& theirs) {
  ASSERT_EQ(mine.tensors().size(), theirs.tensors().size());
  for (const gguf::TensorInfo& t : mine.tensors()) {
    const gguf::TensorInfo* o = theirs.find_tensor(t.name);
    ASSERT_NE(o, nullptr) << t.name;
    EXPECT_EQ(t.type, o->type) << t.name;
    EXPECT_EQ(t.dims, o->dims) << t.name;
    ASSERT_EQ(t.n_bytes, o->n_bytes) << t.name;
    EXPECT_EQ(0, std::memcmp(t.data, o->data, t.n_bytes)) << t.name << ": bytes differ";
  }
}

}  // namespace

TEST(Quantize, TinyModelMatchesLlamaQuantizePure) {
  MERLIN_REQUIRE_DATA(f32, std::string(kDir) + "tiny-f32.gguf");
  test::TempDir dir;
  int compared = 0;
  for (const char* name : {"f16", "bf16", "q8_0", "q4_0", "q4_k", "tq1_0", "tq2_0"}) {
    const std::string ref = test::data_file(std::string(kDir) + "tiny-" + name + ".gguf");
    if (ref.empty()) continue;
    SCOPED_TRACE(name);
    const std::string out = dir.file(std::string(name) + ".gguf");
    quantize_model(f32, out, quiet(*parse_quant_type(name)));
    auto mine = gguf::File::open(out);
    auto theirs = gguf::File::open(ref);
    expect_same_tensors(*mine, *theirs);
    EXPECT_EQ(mine->metadata().get_int("general.file_type", -1), theirs->metadata().get_int("general.file_type", -2));
    EXPECT_EQ(mine->metadata().get_int("general.quantization_version", -1),
              theirs->metadata().get_int("general.quantization_version", -1));
    for (const auto& [key, value] : theirs->metadata().entries()) EXPECT_TRUE(mine->metadata().contains(key)) << key;
    ++compared;
  }
  EXPECT_GE(compared, 5);
}

TEST(Quantize, LlamaFtypeNumbers) {
  EXPECT_EQ(llama_ftype(DType::F32), 0u);
  EXPECT_EQ(llama_ftype(DType::F16), 1u);
  EXPECT_EQ(llama_ftype(DType::Q4_0), 2u);
  EXPECT_EQ(llama_ftype(DType::Q8_0), 7u);
  EXPECT_EQ(llama_ftype(DType::Q4_K), 15u);
  EXPECT_EQ(llama_ftype(DType::BF16), 32u);
  EXPECT_EQ(llama_ftype(DType::TQ1_0), 36u);
  EXPECT_EQ(llama_ftype(DType::TQ2_0), 37u);
  EXPECT_EQ(llama_ftype(DType::MXFP4), 38u);
}

TEST(Quantize, TypeNamesAndOverrides) {
  EXPECT_EQ(parse_quant_type("q4_k"), DType::Q4_K);
  EXPECT_EQ(parse_quant_type("mxfp4"), DType::MXFP4);
  EXPECT_FALSE(parse_quant_type("q9").has_value());
  EXPECT_FALSE(parse_quant_type("q5_0").has_value());  // a ggml type we do not write
  const QuantizeOverride o = parse_quantize_override("token_embd=q8_0");
  EXPECT_EQ(o.pattern, "token_embd");
  EXPECT_EQ(o.type, DType::Q8_0);
  EXPECT_THROW(parse_quantize_override("token_embd=q9"), Error);
  EXPECT_THROW(parse_quantize_override("token_embd"), Error);
  EXPECT_THROW(parse_quantize_override("([=q8_0"), Error);
}

TEST(Quantize, OverridesAndEmbeddingRule) {
  MERLIN_REQUIRE_DATA(f32, std::string(kDir) + "tiny-f32.gguf");
  auto in = gguf::File::open(f32);
  QuantizeOptions o = quiet(DType::Q4_0);
  o.overrides.push_back(parse_quantize_override("token_embd=q8_0"));
  o.overrides.push_back(parse_quantize_override("blk\\.1\\..*ffn=tq2_0"));
  for (const TensorPlan& p : plan_quantization(*in, o)) {
    SCOPED_TRACE(p.name);
    const bool vec = p.name.find("norm") != std::string::npos;
    const DType want = vec                                     ? DType::F32
                       : p.name == "token_embd.weight"         ? DType::Q8_0
                       : p.name.rfind("blk.1.ffn_", 0) == 0 ? DType::TQ2_0
                                                               : DType::Q4_0;
    EXPECT_EQ(p.to, want);
    EXPECT_TRUE(p.note.empty());
  }
  QuantizeOptions k = quiet(DType::Q4_K);
  k.keep_embeddings_q8 = true;
  for (const TensorPlan& p : plan_quantization(*in, k)) {
    const bool embd = p.name == "token_embd.weight" || p.name == "output.weight";
    if (embd || p.name == "blk.0.attn_q.weight") {
      EXPECT_EQ(p.to, embd ? DType::Q8_0 : DType::Q4_K) << p.name;
    }
  }
}

// A file with rows of 96 (Q4_K's 256 does not divide, 32 does) and 40 (neither) elements.
TEST(Quantize, RowsThatDoNotFitFallBack) {
  test::TempDir dir;
  const std::string in = dir.file("odd.gguf"), out = dir.file("odd-q4k.gguf");
  std::vector<float> a(96 * 4), b(40 * 3), v(40);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::sin(0.1f * (float)i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = std::cos(0.1f * (float)i);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f + 0.01f * (float)i;
  {
    gguf::Writer w(in);
    w.metadata().set("general.architecture", "test");
    w.add_tensor("a.weight", {96, 4}, DType::F32);
    w.add_tensor("b.weight", {40, 3}, DType::F32);
    w.add_tensor("v.weight", {40}, DType::F32);
    w.write_tensor_data(a.data(), a.size() * 4);
    w.write_tensor_data(b.data(), b.size() * 4);
    w.write_tensor_data(v.data(), v.size() * 4);
    w.finish();
  }
  const QuantizeResult r = quantize_model(in, out, quiet(DType::Q4_K));
  ASSERT_EQ(r.tensors.size(), 3u);
  EXPECT_EQ(r.tensors[0].to, DType::Q8_0);
  EXPECT_NE(r.tensors[0].note.find("q8_0"), std::string::npos) << r.tensors[0].note;
  EXPECT_EQ(r.tensors[1].to, DType::F16);
  EXPECT_FALSE(r.tensors[1].note.empty());
  EXPECT_EQ(r.tensors[2].to, DType::F32);
  auto f = gguf::File::open(out);
  EXPECT_EQ(f->tensor("a.weight").type, DType::Q8_0);
  EXPECT_EQ(f->tensor("b.weight").type, DType::F16);
  EXPECT_EQ(0, std::memcmp(f->tensor("v.weight").data, v.data(), v.size() * 4));
  EXPECT_EQ(f->metadata().get_int("general.file_type", -1), 15);
  EXPECT_EQ(f->metadata().get_string("general.architecture", ""), "test");
}

// Requantizing: a Q8_0 file to Q4_0 stays close to the f32 original; the same type is copied verbatim.
TEST(Quantize, RequantizeFromQuantizedFile) {
  MERLIN_REQUIRE_DATA(f32, std::string(kDir) + "tiny-f32.gguf");
  test::TempDir dir;
  quantize_model(f32, dir.file("q8.gguf"), quiet(DType::Q8_0));
  quantize_model(dir.file("q8.gguf"), dir.file("q8-again.gguf"), quiet(DType::Q8_0));
  quantize_model(dir.file("q8.gguf"), dir.file("q4.gguf"), quiet(DType::Q4_0));
  auto q8 = gguf::File::open(dir.file("q8.gguf"));
  expect_same_tensors(*gguf::File::open(dir.file("q8-again.gguf")), *q8);
  auto orig = gguf::File::open(f32);
  auto q4 = gguf::File::open(dir.file("q4.gguf"));
  const gguf::TensorInfo& t = q4->tensor("blk.0.ffn_up.weight");
  ASSERT_EQ(t.type, DType::Q4_0);
  std::vector<float> row(t.row_length());
  double err2 = 0, x2 = 0;
  for (uint64_t r = 0; r < t.n_rows(); ++r) {
    kernels::dequantize_row(t.type, t.data + r * dtype_row_bytes(t.type, t.row_length()), row.data(),
                            (int64_t)row.size());
    const float* x = reinterpret_cast<const float*>(orig->tensor(t.name).data) + r * t.row_length();
    for (size_t i = 0; i < row.size(); ++i) {
      err2 += ((double)row[i] - x[i]) * ((double)row[i] - x[i]);
      x2 += (double)x[i] * x[i];
    }
  }
  EXPECT_LT(std::sqrt(err2 / x2), 0.15);
}

TEST(Quantize, MissingInputLeavesNoOutput) {
  test::TempDir dir;
  EXPECT_THROW(quantize_model(dir.file("absent.gguf"), dir.file("out.gguf"), quiet(DType::Q8_0)), Error);
  EXPECT_FALSE(std::filesystem::exists(dir.file("out.gguf")));
}
