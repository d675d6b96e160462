#include "train/checkpoint.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "format/gguf.h"

namespace merlin::train {
namespace {

constexpr uint32_t kCheckpointVersion = 1;
const std::string kPrefix = "merlin.train.";

// Word-wise multiplicative hash: every step is a bijection of the state, so changing any single word
// of the input always changes the result.
class Hash {
 public:
  void add(const void* data, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      mix(w);
    }
    uint64_t tail = 0;
    std::memcpy(&tail, p + i, n - i);
    mix(tail ^ ((uint64_t)(n - i) << 56));
  }
  template <typename T>
  void add_value(T v) {
    add(&v, sizeof v);
  }
  uint64_t value() const { return h_ ^ (h_ >> 29); }

 private:
  void mix(uint64_t w) { h_ = ((h_ ^ w) * 0x100000001b3ull) + 0x9e3779b97f4a7c15ull; }
  uint64_t h_ = 0xcbf29ce484222325ull;
};

uint64_t checksum(const TrainState& s, const ParamLayout& layout, const float* p, const float* m, const float* v) {
  Hash h;
  h.add_value(s.step);
  for (uint64_t w : s.data_rng.s) h.add_value(w);
  h.add_value(s.data_rng.spare);
  h.add_value((uint8_t)s.data_rng.has_spare);
  for (const float* buf : {p, m, v}) h.add(buf, layout.total() * sizeof(float));
  return h.value();
}

uint64_t get_u64(const gguf::Metadata& md, const std::string& key, const std::string& path) {
  const gguf::Value* v = md.find(kPrefix + key);
  MERLIN_CHECK(v, path, ": not a training checkpoint (no ", kPrefix + key, ")");
  MERLIN_CHECK(v->type() == gguf::ValueType::U64, path, ": corrupt checkpoint (", kPrefix + key, " has the wrong type)");
  return std::get<uint64_t>(v->v);
}

double get_f64(const gguf::Metadata& md, const std::string& key, const std::string& path) {
  const gguf::Value* v = md.find(kPrefix + key);
  MERLIN_CHECK(v && v->type() == gguf::ValueType::F64, path, ": corrupt checkpoint (", kPrefix + key,
               " is missing or has the wrong type)");
  return std::get<double>(v->v);
}

void read_tensor(const gguf::File& f, const std::string& name, const ParamTensor& t, float* dst) {
  const gguf::TensorInfo* info = f.find_tensor(name);
  MERLIN_CHECK(info, f.path(), ": corrupt checkpoint (tensor ", name, " is missing)");
  MERLIN_CHECK(info->type == DType::F32 && info->dims == t.dims, f.path(), ": corrupt checkpoint (tensor ", name,
               " has the wrong type or shape)");
  std::memcpy(dst, info->data, t.size * sizeof(float));
}

}  // namespace

std::string checkpoint_name(uint64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "ckpt-%06llu.ckpt", (unsigned long long)step);
  return buf;
}

void save_checkpoint(const std::string& path, const ModelConfig& c, const ParamLayout& layout, const TrainState& s,
                     const float* params, const float* m, const float* v) {
  gguf::Writer w(path);
  gguf::Metadata& md = w.metadata();
  c.write_gguf(md);
  md.set(kPrefix + "version", kCheckpointVersion);
  md.set(kPrefix + "tied_embeddings", c.tied_embeddings);
  md.set(kPrefix + "step", (uint64_t)s.step);
  for (int i = 0; i < 4; ++i) md.set(kPrefix + "rng." + std::to_string(i), (uint64_t)s.data_rng.s[i]);
  md.set(kPrefix + "rng.spare", s.data_rng.spare);
  md.set(kPrefix + "rng.has_spare", s.data_rng.has_spare);
  md.set(kPrefix + "elapsed", s.elapsed);
  md.set(kPrefix + "tokenizer", s.tokenizer);
  for (const auto& [k, val] : s.hyper) md.set(kPrefix + "hyper." + k, val);
  md.set(kPrefix + "checksum", checksum(s, layout, params, m, v));
  const char* prefixes[3] = {"", "adam.m.", "adam.v."};
  const float* bufs[3] = {params, m, v};
  for (const char* p : prefixes)
    for (const ParamTensor& t : layout.tensors()) w.add_tensor(p + t.name, t.dims, DType::F32);
  for (const float* buf : bufs)
    for (const ParamTensor& t : layout.tensors()) w.write_tensor_data(buf + t.offset, t.size * sizeof(float));
  w.finish();
}

namespace {

std::unique_ptr<gguf::File> open_checkpoint(const std::string& path) {
  MERLIN_CHECK(std::filesystem::is_regular_file(path), path, ": no such checkpoint");
  std::unique_ptr<gguf::File> f;
  try {
    f = gguf::File::open(path);
  } catch (const Error& e) {
    fail(path, ": not a valid checkpoint: ", e.what());
  }
  const gguf::Metadata& md = f->metadata();
  MERLIN_CHECK(md.contains(kPrefix + "version"), path, ": not a training checkpoint (a model? resume needs a .ckpt "
                                                       "written by 'merlin train')");
  MERLIN_CHECK(md.get_int(kPrefix + "version", 0) == kCheckpointVersion, path, ": unsupported checkpoint version");
  return f;
}

Checkpoint read_header(const gguf::File& f, const std::string& path) {
  const gguf::Metadata& md = f.metadata();
  Checkpoint ck;
  ck.config = ModelConfig::from_gguf(md);
  const gguf::Value* tied = md.find(kPrefix + "tied_embeddings");
  ck.config.tied_embeddings = tied ? tied->as_bool(kPrefix + "tied_embeddings") : true;
  ck.config.validate();
  TrainState& s = ck.state;
  s.step = get_u64(md, "step", path);
  for (int i = 0; i < 4; ++i) s.data_rng.s[i] = get_u64(md, "rng." + std::to_string(i), path);
  s.data_rng.spare = get_f64(md, "rng.spare", path);
  s.data_rng.has_spare = md.at(kPrefix + "rng.has_spare").as_bool(kPrefix + "rng.has_spare");
  s.elapsed = get_f64(md, "elapsed", path);
  s.tokenizer = md.get_string(kPrefix + "tokenizer", "gpt2");
  const std::string hyper_prefix = kPrefix + "hyper.";
  for (const auto& [k, val] : md.entries())
    if (k.rfind(hyper_prefix, 0) == 0) s.hyper.emplace_back(k.substr(hyper_prefix.size()), val.as_double(k));
  return ck;
}

}  // namespace

Checkpoint read_checkpoint_header(const std::string& path) { return read_header(*open_checkpoint(path), path); }

Checkpoint load_checkpoint(const std::string& path) {
  const std::unique_ptr<gguf::File> f = open_checkpoint(path);
  const gguf::Metadata& md = f->metadata();
  Checkpoint ck = read_header(*f, path);
  const TrainState& s = ck.state;
  const ParamLayout layout(ck.config);
  ck.params.resize(layout.total());
  ck.m.resize(layout.total());
  ck.v.resize(layout.total());
  for (const ParamTensor& t : layout.tensors()) {
    read_tensor(*f, t.name, t, ck.params.data() + t.offset);
    read_tensor(*f, "adam.m." + t.name, t, ck.m.data() + t.offset);
    read_tensor(*f, "adam.v." + t.name, t, ck.v.data() + t.offset);
  }
  const uint64_t want = get_u64(md, "checksum", path);
  MERLIN_CHECK(checksum(s, layout, ck.params.data(), ck.m.data(), ck.v.data()) == want, path,
               ": checkpoint is corrupt (checksum mismatch)");
  return ck;
}

void check_same_model(const ModelConfig& a, const ModelConfig& b, const std::string& path) {
  auto describe = [](const ModelConfig& c) {
    return cat("dim ", c.dim, ", layers ", c.n_layers, ", heads ", c.n_heads, "/", c.n_kv_heads, ", ffn ", c.ffn_dim,
               ", vocab ", c.vocab_size, ", context ", c.context_length, ", rope ", c.rot_dims(), "@", c.rope_theta,
               ", eps ", c.norm_eps, c.tied_embeddings ? ", tied" : ", untied");
  };
  const bool same = a.dim == b.dim && a.n_layers == b.n_layers && a.n_heads == b.n_heads &&
                    a.n_kv_heads == b.n_kv_heads && a.ffn_dim == b.ffn_dim && a.vocab_size == b.vocab_size &&
                    a.context_length == b.context_length && a.rot_dims() == b.rot_dims() &&
                    a.rope_theta == b.rope_theta && a.norm_eps == b.norm_eps && a.tied_embeddings == b.tied_embeddings;
  MERLIN_CHECK(same, path, " was written for a different model (", describe(a), ") than the one requested (",
               describe(b), ")");
}

std::string latest_checkpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  std::string best;
  unsigned long long best_step = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("ckpt-", 0) != 0 || e.path().extension() != ".ckpt") continue;
    char* end = nullptr;
    const unsigned long long step = std::strtoull(n.c_str() + 5, &end, 10);
    if (end == n.c_str() + 5 || std::string(end) != ".ckpt") continue;
    if (best.empty() || step > best_step) {
      best = e.path().string();
      best_step = step;
    }
  }
  return best;
}

std::string resolve_checkpoint(const std::string& file_or_dir) {
  if (!std::filesystem::is_directory(file_or_dir)) return file_or_dir;
  std::string path = latest_checkpoint(file_or_dir);
  MERLIN_CHECK(!path.empty(), "--resume ", file_or_dir, ": no ckpt-*.ckpt in this directory");
  return path;
}

}  // namespace merlin::train
