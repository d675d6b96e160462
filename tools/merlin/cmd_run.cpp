// merlin run: stream generated text to stdout, then one timing line on stderr.
#include <cstdio>

#include "commands.h"
#include "core/error.h"
#include "core/sys.h"
#include "core/thread_pool.h"
#include "runtime/backend.h"
#include "runtime/generate.h"
#include "runtime/model.h"

namespace merlin::cli {
namespace {

struct RunArgs {
  std::string model, prompt, prompt_ids, kv_type = "f16", device = "cpu";
  int n_predict = 128, threads = 0, ctx = 0;
  bool no_kv_cache = false, output_ids = false, ignore_eos = false, no_echo = false, raw_pieces = false;
  SamplerOptions sampling;
};

std::vector<int32_t> prompt_tokens(const Model& model, const RunArgs& a) {
  const Tokenizer& tok = model.tokenizer();
  if (!a.prompt_ids.empty()) return parse_id_list(a.prompt_ids);
  const std::string bad = utf8_error(a.prompt);
  MERLIN_CHECK(bad.empty(), "the prompt is not valid UTF-8: ", bad);
  std::vector<int32_t> ids;
  if (tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  const std::vector<int32_t> body = tok.encode(a.prompt, false);
  ids.insert(ids.end(), body.begin(), body.end());
  // A model without BOS still needs one token to start from: GPT-2 uses <|endoftext|>.
  if (ids.empty()) ids.push_back(tok.bos_id() >= 0 ? tok.bos_id() : tok.eos_id());
  MERLIN_CHECK(!ids.empty() && ids[0] >= 0, "empty prompt and the model has no BOS/EOS token to start from");
  return ids;
}

// --raw-pieces prints what llama-cli prints: each token's piece as the vocabulary stores it (the space
// SentencePiece prefixes to the first word after BOS is kept), written with printf("%s"), so a piece
// holding a NUL byte (the <0x00> token) prints nothing from there on.
std::string piece(const Tokenizer& tok, int32_t id, int32_t prev, bool raw) {
  if (!raw) return tok.decode_token(id, prev);
  constexpr int32_t kMidText = -2;  // any token but "start" or BOS: decode_token keeps the leading space
  std::string s = tok.decode_token(id, kMidText);
  return s.substr(0, s.find('\0'));
}

void print_bytes(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

constexpr int kLongDecodeTokens = 2048;

int run(const RunArgs& a) {
  auto model = Model::load(a.model);
  BackendOptions bo;
  bo.n_threads = a.threads;
  bo.n_ctx = a.ctx;
  bo.kv_type = parse_kv_type(a.kv_type);
  // Deeper decode loops pay for their capture after ~2,000 tokens (docs/GPU.md); only a run that cannot stop
  // early is known to get there.
  bo.long_decode = a.ignore_eos && a.n_predict >= kLongDecodeTokens;
  auto backend = make_backend(a.device, *model, bo);
  const std::vector<int32_t> prompt = prompt_tokens(*model, a);
  MERLIN_CHECK((int)prompt.size() < backend->n_ctx(), "prompt of ", prompt.size(),
               " tokens does not fit in the context of ", backend->n_ctx(), " tokens");

  const Tokenizer& tok = model->tokenizer();
  int32_t prev = -1;
  if (!a.output_ids && !a.no_echo) {
    for (int32_t id : prompt) {
      print_bytes(piece(tok, id, prev, a.raw_pieces));
      prev = id;
    }
  } else {
    prev = prompt.back();
  }
  GenerateOptions go;
  go.n_predict = a.n_predict;
  go.use_kv_cache = !a.no_kv_cache;
  go.stop_at_eos = !a.ignore_eos;
  go.sampling = a.sampling;
  bool first = true;
  const GenerateStats st = generate(*model, *backend, prompt, go, [&](int32_t id) {
    if (a.output_ids) {
      std::printf(first ? "%d" : " %d", id);
      std::fflush(stdout);
    } else {
      print_bytes(piece(tok, id, prev, a.raw_pieces));
    }
    first = false;
    prev = id;
    return true;
  });
  std::printf("\n");
  std::fflush(stdout);
  const double pp = st.prompt_seconds > 0 ? st.n_prompt / st.prompt_seconds : 0;
  const double tg = st.n_generated > 1 && st.gen_seconds > 0 ? (st.n_generated - 1) / st.gen_seconds : 0;
  std::fprintf(stderr,
               "[merlin] prompt: %d tokens, %.1f t/s | generation: %d tokens, %.1f t/s | stop: %s | "
               "peak RSS: %s | %s, %d threads%s\n",
               st.n_prompt, pp, st.n_generated, tg, st.stop_reason.c_str(), format_bytes(peak_rss_bytes()).c_str(),
               backend->name().c_str(), a.threads > 0 ? a.threads : ThreadPool::default_threads(), a.no_kv_cache ? ", no KV cache" : "");
  return 0;
}

}  // namespace

Action add_run(CLI::App& app) {
  auto a = std::make_shared<RunArgs>();
  app.add_option("-m,--model", a->model, "GGUF model file")->required();
  app.add_option("-p,--prompt", a->prompt, "prompt text");
  app.add_option("--prompt-ids", a->prompt_ids, "prompt as comma-separated token ids (no BOS added)");
  app.add_option("-n,--n-predict", a->n_predict, "tokens to generate")->check(CLI::Range(0, 1 << 24));
  app.add_option("-t,--threads", a->threads, "threads (default: all cores)")->check(CLI::Range(0, 1024));
  app.add_option("-c,--ctx", a->ctx, "context size (default: the model's)")->check(CLI::Range(0, 1 << 20));
  app.add_option("--temp", a->sampling.temperature, "temperature (0: greedy)")->check(CLI::Range(0.0, 100.0));
  app.add_option("--top-k", a->sampling.top_k, "top-k (0: off)")->check(CLI::Range(0, 1 << 24));
  app.add_option("--top-p", a->sampling.top_p, "top-p (1: off)")->check(CLI::Range(0.0, 1.0));
  app.add_option("--min-p", a->sampling.min_p, "min-p (0: off)")->check(CLI::Range(0.0, 1.0));
  app.add_option("--repeat-penalty", a->sampling.repeat_penalty, "repetition penalty (1: off)")->check(CLI::Range(0.0, 100.0));
  app.add_option("--repeat-last-n", a->sampling.repeat_last_n, "tokens the penalty looks back")->check(CLI::Range(0, 1 << 20));
  app.add_option("--seed", a->sampling.seed, "sampling seed (same seed, same text)");
  app.add_option("--kv-type", a->kv_type, "KV cache type: f16 (default) | f32 | q8_0");
  app.add_option("--device", a->device, "cpu (default) | cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--no-kv-cache", a->no_kv_cache, "recompute the whole sequence every step");
  app.add_flag("--ignore-eos", a->ignore_eos, "keep generating after end-of-text");
  app.add_flag("--no-echo", a->no_echo, "do not print the prompt");
  app.add_flag("--output-ids", a->output_ids, "print generated token ids instead of text");
  app.add_flag("--raw-pieces", a->raw_pieces, "print token pieces exactly as llama-cli does (keeps the prompt's leading space)");
  return [a] { return run(*a); };
}

}  // namespace merlin::cli
