#include "model/init.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "format/gguf.h"
#include "tokenizer/tokenizer.h"

namespace merlin {
namespace {

constexpr uint64_t kChunk = 1 << 16;  // elements per independently seeded chunk

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void convert(const float* src, DType type, uint64_t n, uint8_t* dst) {
  if (type == DType::F32) {
    std::memcpy(dst, src, n * 4);
  } else if (type == DType::F16) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (uint64_t i = 0; i < n; ++i) d[i] = f32_to_fp16(src[i]);
  } else {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (uint64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  }
}

}  // namespace

std::vector<TensorSpec> model_tensor_specs(const ModelConfig& c, float std) {
  namespace tn = tensor_names;
  const uint64_t d = c.dim, q = c.n_heads * c.head_dim(), kv = c.kv_dim(), f = c.ffn_dim;
  const float resid = std / std::sqrt(2.0f * (float)c.n_layers);
  std::vector<TensorSpec> s;
  s.push_back({tn::kTokenEmbd, {d, (uint64_t)c.vocab_size}, std});
  for (int i = 0; i < c.n_layers; ++i) {
    s.push_back({tn::blk(i, "attn_norm"), {d}, 0});
    s.push_back({tn::blk(i, "attn_q"), {d, q}, std});
    s.push_back({tn::blk(i, "attn_k"), {d, kv}, std});
    s.push_back({tn::blk(i, "attn_v"), {d, kv}, std});
    s.push_back({tn::blk(i, "attn_output"), {q, d}, resid});
    s.push_back({tn::blk(i, "ffn_norm"), {d}, 0});
    s.push_back({tn::blk(i, "ffn_gate"), {d, f}, std});
    s.push_back({tn::blk(i, "ffn_up"), {d, f}, std});
    s.push_back({tn::blk(i, "ffn_down"), {f, d}, resid});
  }
  s.push_back({tn::kOutputNorm, {d}, 0});
  if (!c.tied_embeddings) s.push_back({tn::kOutput, {d, (uint64_t)c.vocab_size}, std});
  return s;
}

void init_values(uint64_t seed, size_t tensor_index, const TensorSpec& spec, uint64_t begin, uint64_t end,
                 float* out) {
  if (spec.std == 0) {
    std::fill(out, out + (end - begin), 1.0f);
    return;
  }
  for (uint64_t c0 = begin / kChunk * kChunk; c0 < end; c0 += kChunk) {
    Rng rng(mix(mix(seed, tensor_index), c0 / kChunk));
    const uint64_t c1 = c0 + kChunk;
    for (uint64_t i = c0; i < c1 && i < end; ++i) {
      const float v = rng.normal() * spec.std;
      if (i >= begin) out[i - begin] = v;
    }
  }
}

void write_random_model(const ModelConfig& config, const Tokenizer& tokenizer, const InitOptions& opts,
                        const std::string& path) {
  config.validate();
  MERLIN_CHECK(opts.type == DType::F32 || opts.type == DType::F16 || opts.type == DType::BF16,
               "init writes f32, f16 or bf16 weights (quantize afterwards for other types)");
  MERLIN_CHECK(tokenizer.vocab_size() <= config.vocab_size, "tokenizer has more tokens than the model's vocabulary");
  gguf::Writer w(path);
  config.write_gguf(w.metadata());
  w.metadata().set("general.file_type", (uint32_t)(opts.type == DType::F32 ? 0 : opts.type == DType::F16 ? 1 : 32));
  w.metadata().set("merlin.init.seed", (uint64_t)opts.seed);
  tokenizer.write_gguf(w.metadata());

  const std::vector<TensorSpec> specs = model_tensor_specs(config, opts.std);
  uint64_t total = 0;
  for (const TensorSpec& s : specs) {
    const DType t = s.dims.size() == 1 ? DType::F32 : opts.type;
    w.add_tensor(s.name, s.dims, t);
    uint64_t n = 1;
    for (uint64_t d : s.dims) n *= d;
    total += n;
  }

  ThreadPool pool(opts.n_threads > 0 ? opts.n_threads : ThreadPool::default_threads());
  const uint64_t buf_elems = 64 * kChunk;
  std::vector<float> buf(buf_elems);
  std::vector<uint8_t> bytes(buf_elems * 4);
  std::unique_ptr<Progress> progress;
  if (opts.progress) progress = std::make_unique<Progress>("init", total, "params");
  uint64_t done = 0;
  for (size_t ti = 0; ti < specs.size(); ++ti) {
    const TensorSpec& s = specs[ti];
    const DType t = s.dims.size() == 1 ? DType::F32 : opts.type;
    uint64_t n = 1;
    for (uint64_t d : s.dims) n *= d;
    for (uint64_t b = 0; b < n; b += buf_elems) {
      const uint64_t e = std::min(n, b + buf_elems);
      pool.parallel_for((int64_t)(e - b), [&](int64_t i0, int64_t i1) {
        init_values(opts.seed, ti, s, b + i0, b + i1, buf.data() + i0);
      }, (int64_t)kChunk);
      convert(buf.data(), t, e - b, bytes.data());
      w.write_tensor_data(bytes.data(), (e - b) * (t == DType::F32 ? 4 : 2));
      done += e - b;
      if (progress) progress->update(done);
    }
  }
  w.finish();
  if (progress) progress->finish();
}

}  // namespace merlin
