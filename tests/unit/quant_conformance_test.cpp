// Conformance with llama.cpp's quantized files (tiny-llama-conformance, written by `llama-quantize --pure`
// from tiny-f32.gguf): our Q8_0 / Q4_0 / TQ1_0 / TQ2_0 quantizers reproduce llama-quantize's bytes, and our
// dequantization of every type it wrote is consistent with the f32 original.
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "format/gguf.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/quant_formats.h"
#include "test_util.h"

using namespace merlin;

namespace {

constexpr const char* kDir = "models/tiny-llama-conformance/";

struct Pair {
  const gguf::TensorInfo* f32;
  const gguf::TensorInfo* q;
};

// Tensors of `type` in the quantized file, each with its f32 original.
std::vector<Pair> pairs_of_type(const gguf::File& f32, const gguf::File& q, DType type) {
  std::vector<Pair> out;
  for (const auto& t : q.tensors()) {
    if (t.type != type) continue;
    const gguf::TensorInfo* orig = f32.find_tensor(t.name);
    EXPECT_NE(orig, nullptr) << t.name;
    if (orig == nullptr) continue;
    EXPECT_EQ(orig->type, DType::F32) << t.name;
    EXPECT_EQ(orig->dims, t.dims) << t.name;
    out.push_back({orig, &t});
  }
  return out;
}

const float* f32_row(const gguf::TensorInfo& t, uint64_t r) {
  return reinterpret_cast<const float*>(t.data) + r * t.row_length();
}

const uint8_t* q_row(const gguf::TensorInfo& t, uint64_t r) {
  return t.data + r * dtype_row_bytes(t.type, t.row_length());
}

// Quantizes every row of every tensor of `type` and compares with llama-quantize's bytes. Returns the
// fraction of identical blocks (tests that need exactness assert 1).
double requantize_match(const std::string& qname, DType type, int* n_tensors) {
  const std::string f32_path = test::data_file(std::string(kDir) + "tiny-f32.gguf");
  const std::string q_path = test::data_file(std::string(kDir) + qname);
  auto f32 = gguf::File::open(f32_path);
  auto q = gguf::File::open(q_path);
  const auto pairs = pairs_of_type(*f32, *q, type);
  *n_tensors = (int)pairs.size();
  const DTypeInfo& info = dtype_info(type);
  uint64_t blocks = 0, same = 0;
  for (const Pair& p : pairs) {
    const uint64_t n = p.q->row_length();
    std::vector<uint8_t> mine(dtype_row_bytes(type, n));
    for (uint64_t r = 0; r < p.q->n_rows(); ++r) {
      EXPECT_TRUE(kernels::quant_quantize_row(type, f32_row(*p.f32, r), mine.data(), (int64_t)n));
      const uint8_t* theirs = q_row(*p.q, r);
      for (uint64_t b = 0; b < n / info.block_size; ++b, ++blocks)
        same += std::memcmp(mine.data() + b * info.block_bytes, theirs + b * info.block_bytes, info.block_bytes) == 0;
    }
  }
  return blocks ? (double)same / (double)blocks : 0.0;
}

}  // namespace

TEST(QuantConformance, Q8_0BytesMatchLlamaQuantize) {
  MERLIN_REQUIRE_DATA(f, "models/tiny-llama-conformance/tiny-q8_0.gguf");
  int n = 0;
  EXPECT_EQ(requantize_match("tiny-q8_0.gguf", DType::Q8_0, &n), 1.0);
  EXPECT_GE(n, 14) << "expected every 2-D weight (2 layers x 7, plus embeddings) in Q8_0";
}

TEST(QuantConformance, Q4_0BytesMatchLlamaQuantize) {
  MERLIN_REQUIRE_DATA(f, "models/tiny-llama-conformance/tiny-q4_0.gguf");
  int n = 0;
  EXPECT_EQ(requantize_match("tiny-q4_0.gguf", DType::Q4_0, &n), 1.0);
  EXPECT_GE(n, 14);
}

TEST(QuantConformance, TernaryBytesMatchLlamaQuantize) {
  MERLIN_REQUIRE_DATA(f1, "models/tiny-llama-conformance/tiny-tq1_0.gguf");
  MERLIN_REQUIRE_DATA(f2, "models/tiny-llama-conformance/tiny-tq2_0.gguf");
  int n1 = 0, n2 = 0;
  EXPECT_EQ(requantize_match("tiny-tq1_0.gguf", DType::TQ1_0, &n1), 1.0);
  EXPECT_EQ(requantize_match("tiny-tq2_0.gguf", DType::TQ2_0, &n2), 1.0);
  EXPECT_GE(n1, 14);
  EXPECT_GE(n2, 14);
}

// Q4_K's quantizer is a float search (make_qkx2_quants); following ggml operation for operation gives
// llama-quantize's bytes too. If a different llama.cpp build ever contracted multiply-adds differently, a
// few blocks could differ: the printed fraction says how many.
TEST(QuantConformance, Q4_KBytesMatchLlamaQuantize) {
  MERLIN_REQUIRE_DATA(f, "models/tiny-llama-conformance/tiny-q4_k.gguf");
  int n = 0;
  const double frac = requantize_match("tiny-q4_k.gguf", DType::Q4_K, &n);
  RecordProperty("q4_k_identical_blocks", std::to_string(frac));
  std::printf("Q4_K: %.4f%% of blocks identical to llama-quantize's\n", 100.0 * frac);
  EXPECT_GE(n, 14);
  EXPECT_EQ(frac, 1.0);
}

namespace {

struct ErrorStats {
  double sum_err2 = 0, sum_x2 = 0, max_abs = 0;
  double rel_rms() const { return std::sqrt(sum_err2 / sum_x2); }
};

// Dequantizes every tensor of `type` in `qname` and measures it against the f32 original.
ErrorStats dequant_error(const std::string& qname, DType type, int* n_tensors) {
  auto f32 = gguf::File::open(test::data_file(std::string(kDir) + "tiny-f32.gguf"));
  auto q = gguf::File::open(test::data_file(std::string(kDir) + qname));
  const auto pairs = pairs_of_type(*f32, *q, type);
  *n_tensors = (int)pairs.size();
  ErrorStats s;
  for (const Pair& p : pairs) {
    const uint64_t n = p.q->row_length();
    std::vector<float> row(n);
    for (uint64_t r = 0; r < p.q->n_rows(); ++r) {
      kernels::dequantize_row(type, q_row(*p.q, r), row.data(), (int64_t)n);
      const float* x = f32_row(*p.f32, r);
      for (uint64_t i = 0; i < n; ++i) {
        const double e = (double)row[i] - x[i];
        s.sum_err2 += e * e;
        s.sum_x2 += (double)x[i] * x[i];
        s.max_abs = std::max(s.max_abs, std::fabs(e));
      }
    }
  }
  return s;
}

}  // namespace

TEST(QuantConformance, DequantizedFilesAreCloseToF32) {
  MERLIN_REQUIRE_DATA(f, "models/tiny-llama-conformance/tiny-f32.gguf");
  struct Case {
    const char* file;
    DType type;
    double max_rel_rms;  // Gaussian weights: the formats' typical reconstruction error, with margin
  };
  const Case cases[] = {
      {"tiny-q8_0.gguf", DType::Q8_0, 0.01},  {"tiny-q4_0.gguf", DType::Q4_0, 0.15},
      {"tiny-q4_k.gguf", DType::Q4_K, 0.12},  {"tiny-tq1_0.gguf", DType::TQ1_0, 0.9},
      {"tiny-tq2_0.gguf", DType::TQ2_0, 0.9}, {"tiny-mxfp4.gguf", DType::MXFP4, 0.2},
  };
  for (const Case& c : cases) {
    if (test::data_file(std::string(kDir) + c.file).empty()) {
      std::printf("%s: absent, skipped\n", c.file);
      continue;
    }
    int n = 0;
    const ErrorStats s = dequant_error(c.file, c.type, &n);
    std::printf("%s: %d tensors, relative rms error %.4f, max abs error %.4f\n", c.file, n, s.rel_rms(), s.max_abs);
    EXPECT_GE(n, 14) << c.file;
    EXPECT_LT(s.rel_rms(), c.max_rel_rms) << c.file;
  }
}

// llama.cpp's TQ1_0 and TQ2_0 files hold the same ternary values and scales in two packings.
TEST(QuantConformance, Tq1AndTq2FilesDecodeToTheSameTernaryValues) {
  MERLIN_REQUIRE_DATA(f1, "models/tiny-llama-conformance/tiny-tq1_0.gguf");
  MERLIN_REQUIRE_DATA(f2, "models/tiny-llama-conformance/tiny-tq2_0.gguf");
  auto a = gguf::File::open(f1);
  auto b = gguf::File::open(f2);
  int compared = 0;
  for (const auto& ta : a->tensors()) {
    if (ta.type != DType::TQ1_0) continue;
    const gguf::TensorInfo& tb = b->tensor(ta.name);
    ASSERT_EQ(tb.type, DType::TQ2_0) << ta.name;
    ASSERT_EQ(ta.dims, tb.dims);
    const uint64_t n_blocks = ta.n_elements / kernels::quant::kQK_K;
    const auto* ba = reinterpret_cast<const kernels::quant::BlockTQ1_0*>(ta.data);
    const auto* bb = reinterpret_cast<const kernels::quant::BlockTQ2_0*>(tb.data);
    int8_t va[256], vb[256];
    for (uint64_t i = 0; i < n_blocks; ++i) {
      ASSERT_EQ(ba[i].d, bb[i].d) << ta.name << " block " << i;
      kernels::quant::tq1_0_trits(ba[i], va);
      kernels::quant::tq2_0_trits(bb[i], vb);
      ASSERT_EQ(0, std::memcmp(va, vb, 256)) << ta.name << " block " << i;
    }
    ++compared;
  }
  EXPECT_GE(compared, 14);
}

// No llama.cpp MXFP4 file is in the data set: quantize tiny-f32's weights with our MXFP4 quantizer and check
// the reconstruction (4-bit E2M1 with a power-of-two scale per 32). A file made this way was checked by hand
// against llama.cpp (node-llama-cpp 3.22.1): it loads it and its logits equal Merlin's.
TEST(QuantConformance, Mxfp4RoundTripOnTinyWeights) {
  MERLIN_REQUIRE_DATA(path, "models/tiny-llama-conformance/tiny-f32.gguf");
  auto f32 = gguf::File::open(path);
  double err2 = 0, x2 = 0;
  int n_tensors = 0;
  for (const auto& t : f32->tensors()) {
    if (t.dims.size() != 2) continue;
    ++n_tensors;
    const uint64_t n = t.row_length();
    std::vector<uint8_t> q(dtype_row_bytes(DType::MXFP4, n));
    std::vector<float> y(n);
    for (uint64_t r = 0; r < t.n_rows(); ++r) {
      const float* x = f32_row(t, r);
      ASSERT_TRUE(kernels::quant_quantize_row(DType::MXFP4, x, q.data(), (int64_t)n));
      kernels::dequantize_row(DType::MXFP4, q.data(), y.data(), (int64_t)n);
      for (uint64_t i = 0; i < n; ++i) {
        err2 += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
        x2 += (double)x[i] * x[i];
      }
    }
  }
  std::printf("MXFP4 on tiny-f32: %d tensors, relative rms error %.4f\n", n_tensors, std::sqrt(err2 / x2));
  EXPECT_GE(n_tensors, 14);
  EXPECT_LT(std::sqrt(err2 / x2), 0.2);
}
