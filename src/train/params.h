// Where every parameter tensor lives in one flat float buffer. Tensors follow model_tensor_specs() order
// without padding, so attn_q|attn_k|attn_v and ffn_gate|ffn_up are each one contiguous [rows][dim]
// matrix and run as one fused product. Gradients and AdamW moments use the same layout.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace merlin::train {

struct ParamTensor {
  std::string name;            // GGUF tensor name
  std::vector<uint64_t> dims;  // GGUF order ([cols, rows] for matrices)
  size_t offset = 0, size = 0;
  float init_std = 0;          // 0: a norm weight, initialised to 1
  bool is_norm() const { return dims.size() == 1; }
  bool is_embedding() const;   // token_embd (and an untied output head)
};

class ParamLayout {
 public:
  explicit ParamLayout(const ModelConfig& c);
  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  size_t total() const { return total_; }
  const ParamTensor* find(const std::string& name) const;

  struct Layer {
    size_t attn_norm, wqkv, wo, ffn_norm, wgu, wdown;
  };
  size_t token_embd = 0, output_norm = 0, output = 0;  // output == token_embd when tied
  std::vector<Layer> layers;

 private:
  std::vector<ParamTensor> tensors_;
  size_t total_ = 0;
};

// Weights as `merlin init --seed` would write them (the same init_values per tensor).
void init_params(const ModelConfig& c, const ParamLayout& layout, uint64_t seed, float* params, int threads);

}  // namespace merlin::train
