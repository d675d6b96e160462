// Model quantization (`merlin quantize`): rewrites a GGUF file with its 2-D weights in another type,
// streaming tensor by tensor, so memory stays at one chunk of rows whatever the model's size.
//
// Rules, in order, for each tensor:
//   1. tensors with fewer than 2 dimensions (norm vectors) are stored as F32;
//   2. the first --override whose pattern matches the name (std::regex_search) gives its type;
//   3. keep_embeddings_q8: token_embd.weight and output.weight go to Q8_0;
//   4. otherwise the main type. As llama-quantize --pure: token_embd and output are no exception.
// When a tensor's row length is not a multiple of the chosen type's block, it falls back to Q8_0 if 32
// divides it, else F16, and the plan records why.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace merlin {

namespace gguf {
class File;
}

struct QuantizeOverride {
  std::string pattern;  // ECMAScript regex, searched in the tensor name
  DType type;
};

struct QuantizeOptions {
  DType type = DType::Q8_0;
  std::vector<QuantizeOverride> overrides;
  bool keep_embeddings_q8 = false;
  int n_threads = 0;     // 0: all cores
  bool progress = true;  // progress bar on stderr
};

struct TensorPlan {
  std::string name;
  DType from = DType::F32, to = DType::F32;
  uint64_t n_elements = 0, bytes_in = 0, bytes_out = 0;
  std::string note;  // why the type differs from the rule's choice (a fallback), empty otherwise
};

struct QuantizeResult {
  std::vector<TensorPlan> tensors;
  uint64_t bytes_in = 0, bytes_out = 0;
  double seconds = 0;
};

// Types `merlin quantize` writes: f32 f16 bf16 q8_0 q4_0 q4_k mxfp4 tq1_0 tq2_0.
std::optional<DType> parse_quant_type(std::string_view name);
std::string quant_type_names();  // "f32, f16, ..." for error messages

// llama.cpp's llama_ftype number for a file whose main type is `t` (general.file_type):
// F32 0, F16 1, Q4_0 2, Q8_0 7, Q4_K 15 (LLAMA_FTYPE_MOSTLY_Q4_K_M, what llama-quantize --pure q4_k_m
// writes), BF16 32, TQ1_0 36, TQ2_0 37, MXFP4 38 (LLAMA_FTYPE_MOSTLY_MXFP4_MOE).
uint32_t llama_ftype(DType t);

// "NAME=TYPE" -> override; throws merlin::Error on a bad pattern or type.
QuantizeOverride parse_quantize_override(const std::string& spec);

// The per-tensor decisions without writing anything.
std::vector<TensorPlan> plan_quantization(const gguf::File& in, const QuantizeOptions& opts);

// Reads `in_path`, writes `out_path` atomically. Throws merlin::Error on any problem (nothing is left
// behind at out_path then).
QuantizeResult quantize_model(const std::string& in_path, const std::string& out_path, const QuantizeOptions& opts);

}  // namespace merlin
