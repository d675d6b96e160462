#include "runtime/bench.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/error.h"
#include "core/rng.h"
#include "core/sys.h"
#include "runtime/backend.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#ifdef MERLIN_HAVE_CUDA
#include "kernels/cuda/cuda_api.h"
#endif

namespace merlin {
namespace {

void summarize(BenchTest& t) {
  double s = 0;
  for (double x : t.tps) s += x;
  t.mean = t.tps.empty() ? 0 : s / (double)t.tps.size();
  double v = 0;
  for (double x : t.tps) v += (x - t.mean) * (x - t.mean);
  t.sd = t.tps.size() > 1 ? std::sqrt(v / (double)(t.tps.size() - 1)) : 0;
  std::vector<double> sorted = t.tps;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  t.median = n == 0 ? 0 : n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

std::vector<int32_t> random_tokens(const Model& m, int n, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> ids((size_t)n);
  for (int32_t& id : ids) id = (int32_t)(rng.next_u64() % (uint64_t)m.config().vocab_size);
  return ids;
}

double run_pp(const Model& m, Backend& b, const std::vector<int32_t>& tokens) {
  b.clear_sequence(0);
  const double t0 = now_seconds();
  prefill(m, b, tokens, 0, 0, false);
  return (double)tokens.size() / (now_seconds() - t0);
}

// Decode steps sample greedily through decode_greedy, as generate() does: a GPU backend returns token ids,
// not logits rows, and may run several steps per round trip (each step feeds the previous step's id).
double run_tg(const Model& m, Backend& b, const std::vector<int32_t>& tokens, bool kv_cache) {
  const int64_t vocab = m.config().vocab_size;
  b.clear_sequence(0);
  const double t0 = now_seconds();
  if (kv_cache) {
    const int n = b.decode_greedy(tokens[0], 0, 0, (int)tokens.size(), vocab, [](int32_t) { return true; });
    MERLIN_CHECK(n == (int)tokens.size(), "decode_greedy stopped after ", n, " of ", tokens.size(), " steps");
    return (double)tokens.size() / (now_seconds() - t0);
  }
  for (size_t i = 0; i < tokens.size(); ++i) {  // no cache: every token recomputes its whole prefix
    b.clear_sequence(0);
    prefill(m, b, std::vector<int32_t>(tokens.begin(), tokens.begin() + (long)i + 1), 0, 0, false);
  }
  return (double)tokens.size() / (now_seconds() - t0);
}

// B sequences decode N tokens together greedily from B different first tokens (decode_greedy_batch: step i
// feeds every sequence's step i - 1 id at position i; the CUDA backend runs the steps in device-side loops, as
// decode_greedy does for the batch-1 row).
double run_tg_batch(Backend& b, const std::vector<int32_t>& tokens, int n_seqs, size_t vocab) {
  std::vector<int32_t> first((size_t)n_seqs), pos((size_t)n_seqs, 0), seqs((size_t)n_seqs);
  std::vector<int32_t> ids(tokens.size() * (size_t)n_seqs);
  for (int s = 0; s < n_seqs; ++s) {
    b.clear_sequence(s);
    first[(size_t)s] = tokens[(size_t)s % tokens.size()];
    seqs[(size_t)s] = s;
  }
  const double t0 = now_seconds();
  b.decode_greedy_batch(first, pos, seqs, (int)tokens.size(), (int64_t)vocab, ids.data());
  return (double)tokens.size() * n_seqs / (now_seconds() - t0);
}

double kv_elem_bytes(DType t) { return t == DType::F32 ? 4.0 : t == DType::F16 ? 2.0 : 34.0 / 32.0; }

}  // namespace

uint64_t weight_bytes_per_token(const Model& model) {
  uint64_t n = 0;
  const bool tied = model.file().find_tensor("output.weight") == nullptr;
  for (const auto& t : model.file().tensors())
    if (tied || t.name != "token_embd.weight") n += t.n_bytes;
  return n;
}

std::vector<BenchTest> bench_model(const Model& model, const BenchOptions& o, BenchDevice* device) {
  const int ctx_needed = std::max(o.n_prompt, o.n_gen);
  MERLIN_CHECK(ctx_needed <= model.config().context_length, "a test of ", ctx_needed,
               " tokens does not fit in the model's context of ", model.config().context_length,
               " tokens (use smaller -p / -n)");
  BackendOptions bo;
  bo.n_threads = o.n_threads;
  bo.n_ctx = std::max(1, ctx_needed);
  bo.max_batch = std::max(1, std::min(o.n_batch, std::max(o.n_prompt, o.kv_cache ? 1 : o.n_gen)));
  bo.kv_type = o.kv_type;
  bo.long_decode = true;  // steady state, as llama-bench measures it: the warm-up pays the one-time costs
  int max_seqs = 1;
  for (int b : o.decode_batches) max_seqs = std::max(max_seqs, b);
  bo.n_seq = max_seqs;
  bo.max_batch = std::max(bo.max_batch, max_seqs);
  double gbps = 0;
#ifdef MERLIN_HAVE_CUDA
  if (o.device == "cuda") {
    MERLIN_CHECK(cuda::gpu_available(), "no usable CUDA GPU for --device cuda");
    if (o.log) o.log("measuring device copy bandwidth");
    gbps = cuda::copy_bandwidth_gbps();
    if (device) {
      device->name = cuda::device_name();
      device->copy_gbps = gbps;
    }
  }
#endif
  auto backend = make_backend(o.device, model, bo);
  std::vector<BenchTest> out;
  auto measure = [&](const std::string& name, int np, int ng, const std::function<double()>& once) {
    BenchTest t;
    t.name = name;
    t.n_prompt = np;
    t.n_gen = ng;
    once();  // warm-up
    for (int r = 0; r < std::max(1, o.reps); ++r) {
      t.tps.push_back(once());
      if (o.log) o.log(cat(name, " run ", r + 1, "/", o.reps, ": ", (int)t.tps.back(), " t/s"));
    }
    summarize(t);
    out.push_back(t);
  };
  if (o.n_prompt > 0) {
    const std::vector<int32_t> toks = random_tokens(model, o.n_prompt, o.seed);
    measure(cat("pp", o.n_prompt), o.n_prompt, 0, [&] { return run_pp(model, *backend, toks); });
  }
  if (o.n_gen > 0) {
    std::vector<int32_t> toks = random_tokens(model, o.n_gen, o.seed + 1);
    if (model.tokenizer().bos_id() >= 0) toks[0] = model.tokenizer().bos_id();
    const ModelConfig& c = model.config();
    const double kv_row = kv_elem_bytes(o.kv_type) * (double)c.kv_dim() * 2.0 * (double)c.n_layers;
    for (int nb : o.decode_batches) {
      const size_t first = out.size();
      if (nb <= 1) {
        measure(cat("tg", o.n_gen), 0, o.n_gen, [&] { return run_tg(model, *backend, toks, o.kv_cache); });
      } else {
        MERLIN_CHECK(o.kv_cache, "batched decode needs the KV cache");
        measure(cat("tg", o.n_gen, " x", nb), 0, o.n_gen,
                [&] { return run_tg_batch(*backend, toks, nb, (size_t)c.vocab_size); });
      }
      BenchTest& t = out[first];
      t.batch = std::max(1, nb);
      // Mean K/V rows read per step: positions 0..n_gen-1 attend to pos + 1 rows each.
      t.bytes_per_step = (double)weight_bytes_per_token(model) + t.batch * kv_row * (o.n_gen + 1) / 2.0;
      if (gbps > 0 && o.kv_cache) t.roofline_tps = t.batch * gbps * 1e9 / t.bytes_per_step;
    }
  }
#ifdef MERLIN_HAVE_CUDA
  if (device && o.device == "cuda") device->memory_in_use = cuda::device_memory_in_use();
#else
  (void)device;  // only a CUDA build reports device figures
#endif
  return out;
}

}  // namespace merlin
