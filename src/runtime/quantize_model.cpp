#include "runtime/quantize_model.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <regex>

#include "core/error.h"
#include "core/progress.h"
#include "core/sys.h"
#include "core/thread_pool.h"
#include "format/gguf.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant.h"

namespace merlin {
namespace {

constexpr DType kQuantTypes[] = {DType::F32,  DType::F16,  DType::BF16,  DType::Q8_0, DType::Q4_0,
                                 DType::Q4_K, DType::MXFP4, DType::TQ1_0, DType::TQ2_0};

// Elements converted per chunk: big enough to keep both threads busy, small enough that memory stays flat.
constexpr uint64_t kChunkElements = uint64_t{1} << 22;

bool is_embedding(const std::string& name) { return name == "token_embd.weight" || name == "output.weight"; }

// The rule's type, before checking that the row length fits the type's blocks.
DType chosen_type(const gguf::TensorInfo& t, const QuantizeOptions& o, const std::vector<std::regex>& res) {
  if (t.dims.size() < 2) return DType::F32;
  for (size_t i = 0; i < o.overrides.size(); ++i)
    if (std::regex_search(t.name, res[i])) return o.overrides[i].type;
  if (o.keep_embeddings_q8 && is_embedding(t.name)) return DType::Q8_0;
  return o.type;
}

bool fits(DType type, uint64_t row_length) { return row_length % dtype_info(type).block_size == 0; }

void convert_from_float(DType to, const float* src, uint8_t* dst, int64_t n) {
  switch (to) {
    case DType::F32: std::memcpy(dst, src, (size_t)n * 4); return;
    case DType::F16: {
      auto* h = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_fp16(src[i]);
      return;
    }
    case DType::BF16: {
      auto* h = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(src[i]);
      return;
    }
    default:
      MERLIN_CHECK(kernels::quant_quantize_row(to, src, dst, n), "cannot quantize to ", dtype_name(to));
  }
}

// Converts rows [r0, r1) of a tensor; `out` holds exactly those rows.
void convert_rows(const gguf::TensorInfo& t, DType to, uint64_t r0, uint64_t r1, uint8_t* out, ThreadPool& pool) {
  const int64_t n = (int64_t)t.row_length();
  const size_t in_row = dtype_row_bytes(t.type, (uint64_t)n), out_row = dtype_row_bytes(to, (uint64_t)n);
  pool.parallel_for((int64_t)(r1 - r0), [&](int64_t i0, int64_t i1) {
    std::vector<float> row(t.type == DType::F32 ? 0 : (size_t)n);
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* src = t.data + (r0 + (uint64_t)i) * in_row;
      const float* x = reinterpret_cast<const float*>(src);
      if (t.type != DType::F32) {
        kernels::dequantize_row(t.type, src, row.data(), n);
        x = row.data();
      }
      convert_from_float(to, x, out + (size_t)i * out_row, n);
    }
  });
}

void write_tensor(const gguf::TensorInfo& t, DType to, gguf::Writer& w, ThreadPool& pool, Progress* progress,
                  uint64_t& done) {
  if (t.type == to) {  // same type: copy the bytes, never requantize (that would only lose precision)
    w.write_tensor_data(t.data, t.n_bytes);
    done += t.n_elements;
    if (progress) progress->update(done);
    return;
  }
  const uint64_t n_rows = t.n_rows(), row_len = t.row_length();
  const uint64_t rows_per_chunk = std::max<uint64_t>(1, kChunkElements / std::max<uint64_t>(1, row_len));
  std::vector<uint8_t> buf(dtype_row_bytes(to, row_len) * std::min(rows_per_chunk, n_rows));
  for (uint64_t r0 = 0; r0 < n_rows; r0 += rows_per_chunk) {
    const uint64_t r1 = std::min(n_rows, r0 + rows_per_chunk);
    convert_rows(t, to, r0, r1, buf.data(), pool);
    w.write_tensor_data(buf.data(), dtype_row_bytes(to, row_len) * (r1 - r0));
    done += (r1 - r0) * row_len;
    if (progress) progress->update(done);
  }
}

void copy_metadata(const gguf::File& in, const QuantizeOptions& o, gguf::Metadata& md) {
  for (const auto& [key, value] : in.metadata().entries()) md.set(key, value);
  md.set("general.quantization_version", uint32_t{2});  // llama-quantize writes it whatever the type
  md.set("general.file_type", llama_ftype(o.type));
}

}  // namespace

std::optional<DType> parse_quant_type(std::string_view name) {
  const std::optional<DType> t = dtype_from_name(name);
  if (!t) return std::nullopt;
  for (DType q : kQuantTypes)
    if (q == *t) return t;
  return std::nullopt;
}

std::string quant_type_names() {
  std::string s;
  for (DType q : kQuantTypes) s += (s.empty() ? "" : ", ") + std::string(dtype_name(q));
  return s;
}

uint32_t llama_ftype(DType t) {
  switch (t) {
    case DType::F32: return 0;
    case DType::F16: return 1;
    case DType::Q4_0: return 2;
    case DType::Q8_0: return 7;
    case DType::Q4_K: return 15;
    case DType::BF16: return 32;
    case DType::TQ1_0: return 36;
    case DType::TQ2_0: return 37;
    case DType::MXFP4: return 38;
    default: fail("no llama.cpp file type for ", dtype_name(t));
  }
}

QuantizeOverride parse_quantize_override(const std::string& spec) {
  const size_t eq = spec.rfind('=');
  MERLIN_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < spec.size(), "--override wants PATTERN=TYPE, got '",
               spec, "'");
  QuantizeOverride o;
  o.pattern = spec.substr(0, eq);
  const std::optional<DType> t = parse_quant_type(spec.substr(eq + 1));
  MERLIN_CHECK(t.has_value(), "unknown type '", spec.substr(eq + 1), "' in --override ", spec, " (types: ",
               quant_type_names(), ")");
  o.type = *t;
  try {
    std::regex check(o.pattern);
  } catch (const std::regex_error& e) {
    fail("bad pattern '", o.pattern, "' in --override: ", e.what());
  }
  return o;
}

std::vector<TensorPlan> plan_quantization(const gguf::File& in, const QuantizeOptions& o) {
  std::vector<std::regex> res;
  for (const QuantizeOverride& ov : o.overrides) res.emplace_back(ov.pattern);
  std::vector<TensorPlan> plan;
  for (const gguf::TensorInfo& t : in.tensors()) {
    TensorPlan p;
    p.name = t.name;
    p.from = t.type;
    p.n_elements = t.n_elements;
    p.bytes_in = t.n_bytes;
    p.to = chosen_type(t, o, res);
    const bool floaty = p.from == DType::F32 || p.from == DType::F16 || p.from == DType::BF16 ||
                        dtype_info(p.from).block_size > 1;
    if (!floaty) {  // integer tensors (none in llama models today) pass through untouched
      p.to = p.from;
    } else if (!fits(p.to, t.row_length())) {
      const DType fb = fits(DType::Q8_0, t.row_length()) ? DType::Q8_0 : DType::F16;
      p.note = cat("row length ", t.row_length(), " is not a multiple of ", dtype_name(p.to), "'s block of ",
                   dtype_info(p.to).block_size, ": using ", dtype_name(fb));
      p.to = fb;
    }
    p.bytes_out = dtype_row_bytes(p.to, t.row_length()) * t.n_rows();
    plan.push_back(std::move(p));
  }
  return plan;
}

QuantizeResult quantize_model(const std::string& in_path, const std::string& out_path, const QuantizeOptions& o) {
  const double t0 = now_seconds();
  auto in = gguf::File::open(in_path);
  QuantizeResult r;
  r.tensors = plan_quantization(*in, o);
  // Checked up front because conversion runs on pool threads, where an exception cannot be reported.
  // A zero-length dequantize answers "supported?" without touching memory.
  for (const TensorPlan& p : r.tensors) {
    MERLIN_CHECK(p.from == p.to || p.from == DType::F32 || p.from == DType::F16 || p.from == DType::BF16 ||
                     kernels::quant_dequantize_row(p.from, nullptr, nullptr, 0),
                 "tensor ", p.name, ": cannot convert from ", dtype_name(p.from));
  }
  gguf::Writer w(out_path);
  copy_metadata(*in, o, w.metadata());
  uint64_t total = 0;
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    w.add_tensor(r.tensors[i].name, in->tensors()[i].dims, r.tensors[i].to);
    total += r.tensors[i].n_elements;
    r.bytes_in += r.tensors[i].bytes_in;
    r.bytes_out += r.tensors[i].bytes_out;
  }
  ThreadPool pool(o.n_threads > 0 ? o.n_threads : ThreadPool::default_threads());
  std::unique_ptr<Progress> progress;
  if (o.progress) progress = std::make_unique<Progress>("quantize", total, "weights");
  uint64_t done = 0;
  for (size_t i = 0; i < r.tensors.size(); ++i) write_tensor(in->tensors()[i], r.tensors[i].to, w, pool, progress.get(), done);
  w.finish();
  if (progress) progress->finish();
  r.seconds = now_seconds() - t0;
  return r;
}

}  // namespace merlin
