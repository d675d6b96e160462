// merlin quantize: rewrite a GGUF model with its weights in another type (see runtime/quantize_model.h).
#include <cstdio>

#include "commands.h"
#include "core/error.h"
#include "core/sys.h"
#include "runtime/quantize_model.h"

namespace merlin::cli {
namespace {

struct QuantizeArgs {
  std::string in, out, type;
  std::vector<std::string> overrides;
  bool keep_embeddings_q8 = false, quiet = false;
  int threads = 0;
};

int quantize(const QuantizeArgs& a) {
  QuantizeOptions o;
  const std::optional<DType> t = parse_quant_type(a.type);
  MERLIN_CHECK(t.has_value(), "unknown type '", a.type, "' (types: ", quant_type_names(), ")");
  o.type = *t;
  for (const std::string& s : a.overrides) o.overrides.push_back(parse_quantize_override(s));
  o.keep_embeddings_q8 = a.keep_embeddings_q8;
  o.n_threads = a.threads;
  o.progress = !a.quiet;
  const QuantizeResult r = quantize_model(a.in, a.out, o);
  for (const TensorPlan& p : r.tensors) {
    if (!p.note.empty()) std::fprintf(stderr, "quantize: %s: %s\n", p.name.c_str(), p.note.c_str());
  }
  if (!a.quiet) {
    for (const TensorPlan& p : r.tensors)
      std::fprintf(stderr, "  %-32s %-6s -> %-6s %10s -> %10s\n", p.name.c_str(), dtype_name(p.from),
                   dtype_name(p.to), format_bytes(p.bytes_in).c_str(), format_bytes(p.bytes_out).c_str());
  }
  uint64_t n_weights = 0;
  for (const TensorPlan& p : r.tensors) n_weights += p.n_elements;
  std::fprintf(stderr, "quantize: %s -> %s (%s): %s -> %s (%.2f bits/weight) in %.1fs\n", a.in.c_str(), a.out.c_str(),
               dtype_name(o.type), format_bytes(r.bytes_in).c_str(), format_bytes(r.bytes_out).c_str(),
               n_weights ? 8.0 * (double)r.bytes_out / (double)n_weights : 0.0, r.seconds);
  return 0;
}

}  // namespace

Action add_quantize(CLI::App& app) {
  auto a = std::make_shared<QuantizeArgs>();
  app.add_option("input", a->in, "GGUF model to read")->required();
  app.add_option("output", a->out, "GGUF file to write")->required();
  app.add_option("type", a->type, "f32 | f16 | bf16 | q8_0 | q4_0 | q4_k | mxfp4 | tq1_0 | tq2_0")->required();
  app.add_option("--override", a->overrides,
                 "PATTERN=TYPE: tensors whose name matches the regex get TYPE (first match wins; repeatable)");
  app.add_flag("--keep-embeddings-q8", a->keep_embeddings_q8, "store token_embd and output in q8_0");
  app.add_option("-t,--threads", a->threads, "threads (default: all cores)")->check(CLI::Range(0, 1024));
  app.add_flag("-q,--quiet", a->quiet, "no progress bar or per-tensor table");
  return [a] { return quantize(*a); };
}

}  // namespace merlin::cli
