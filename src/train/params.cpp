#include "train/params.h"

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/init.h"

namespace merlin::train {
namespace {
constexpr float kInitStd = 0.02f;  // model/init.h's default, so training starts where `merlin init` does
}

bool ParamTensor::is_embedding() const {
  return name == tensor_names::kTokenEmbd || name == tensor_names::kOutput;
}

ParamLayout::ParamLayout(const ModelConfig& c) {
  c.validate();
  for (const TensorSpec& s : model_tensor_specs(c, kInitStd)) {
    ParamTensor t{s.name, s.dims, total_, 1, s.std};
    for (uint64_t d : s.dims) t.size *= d;
    total_ += t.size;
    tensors_.push_back(std::move(t));
  }
  auto at = [&](const std::string& name) {
    const ParamTensor* t = find(name);
    MERLIN_CHECK(t, "internal: no tensor ", name);
    return t->offset;
  };
  namespace tn = tensor_names;
  token_embd = at(tn::kTokenEmbd);
  output_norm = at(tn::kOutputNorm);
  output = c.tied_embeddings ? token_embd : at(tn::kOutput);
  for (int l = 0; l < c.n_layers; ++l) {
    Layer L{at(tn::blk(l, "attn_norm")), at(tn::blk(l, "attn_q")), at(tn::blk(l, "attn_output")),
            at(tn::blk(l, "ffn_norm")), at(tn::blk(l, "ffn_gate")), at(tn::blk(l, "ffn_down"))};
    // The fused products read q|k|v and gate|up as single matrices.
    MERLIN_CHECK(at(tn::blk(l, "attn_k")) == L.wqkv + (size_t)(c.n_heads * c.head_dim() * c.dim) &&
                     at(tn::blk(l, "attn_v")) == at(tn::blk(l, "attn_k")) + (size_t)(c.kv_dim() * c.dim) &&
                     at(tn::blk(l, "ffn_up")) == L.wgu + (size_t)(c.ffn_dim * c.dim),
                 "internal: unexpected parameter order");
    layers.push_back(L);
  }
}

const ParamTensor* ParamLayout::find(const std::string& name) const {
  for (const ParamTensor& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

void init_params(const ModelConfig& c, const ParamLayout& layout, uint64_t seed, float* params, int threads) {
  const std::vector<TensorSpec> specs = model_tensor_specs(c, kInitStd);
  ThreadPool pool(threads > 0 ? threads : 1);
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamTensor& t = layout.tensors()[i];
    // Chunks of 65536 elements are seeded independently in init_values, so any split gives the same values.
    pool.parallel_for((int64_t)t.size, [&](int64_t b, int64_t e) {
      init_values(seed, i, specs[i], (uint64_t)b, (uint64_t)e, params + t.offset + b);
    }, 1 << 16);
  }
}

}  // namespace merlin::train
