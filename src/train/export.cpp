#include "train/export.h"

#include <vector>

#include "core/error.h"
#include "format/gguf.h"
#include "tokenizer/tokenizer.h"
#include "train/checkpoint.h"

namespace merlin::train {
namespace {

// GGUF general.file_type (llama_ftype) of a model whose matrices are `t`.
uint32_t file_type(DType t) { return t == DType::F32 ? 0 : t == DType::F16 ? 1 : 32; }

void write_converted(gguf::Writer& w, const float* src, size_t n, DType t) {
  if (t == DType::F32) {
    w.write_tensor_data(src, n * sizeof(float));
    return;
  }
  constexpr size_t kBlock = 1 << 16;
  std::vector<uint16_t> buf(kBlock);
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = std::min(n, b + kBlock);
    for (size_t i = b; i < e; ++i) buf[i - b] = t == DType::F16 ? f32_to_fp16(src[i]) : f32_to_bf16(src[i]);
    w.write_tensor_data(buf.data(), (e - b) * sizeof(uint16_t));
  }
}

}  // namespace

void write_model_gguf(const std::string& path, const ModelConfig& c, const ParamLayout& layout, const float* params,
                      DType type, const Tokenizer* tokenizer) {
  MERLIN_CHECK(type == DType::F32 || type == DType::F16 || type == DType::BF16, "--type must be f32, f16 or bf16");
  if (tokenizer)
    MERLIN_CHECK(tokenizer->vocab_size() <= c.vocab_size, "the tokenizer has ", tokenizer->vocab_size(),
                 " tokens but the model only ", c.vocab_size, " (trained on a truncated vocabulary?)");
  gguf::Writer w(path);
  c.write_gguf(w.metadata());
  w.metadata().set("general.file_type", file_type(type));
  if (tokenizer) tokenizer->write_gguf(w.metadata());
  for (const ParamTensor& t : layout.tensors()) w.add_tensor(t.name, t.dims, t.is_norm() ? DType::F32 : type);
  for (const ParamTensor& t : layout.tensors()) write_converted(w, params + t.offset, t.size, t.is_norm() ? DType::F32 : type);
  w.finish();
}

uint64_t export_checkpoint(const std::string& ckpt_path, const std::string& out_path, DType type,
                           const Tokenizer& tokenizer) {
  const Checkpoint ck = load_checkpoint(ckpt_path);
  MERLIN_CHECK(ck.state.tokenizer == tokenizer.model_name(), ckpt_path, " was trained on '", ck.state.tokenizer,
               "' tokens, not '", tokenizer.model_name(), "'");
  write_model_gguf(out_path, ck.config, ParamLayout(ck.config), ck.params.data(), type, &tokenizer);
  return ck.state.step;
}

}  // namespace merlin::train
