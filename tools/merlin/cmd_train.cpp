// merlin train: train a model from scratch (or resume) on token shards written by `merlin prepare`.
#include <cstdio>

#include "commands.h"
#include "core/error.h"
#include "train/checkpoint.h"
#include "train/tokens.h"
#include "train/trainer.h"

namespace merlin::cli {
namespace {

struct TrainArgs {
  train::TrainOptions o;
  ModelFlags model;
  int64_t vocab = 0;
  bool quiet = false;
  double min_lr = -1;
};

ModelConfig model_config(const TrainArgs& a) {
  std::optional<ModelConfig> c = model_from_flags(a.model);
  if (a.vocab) {
    c->vocab_size = a.vocab;
  } else {  // the tokenizer's, as recorded by `merlin prepare`
    const train::TokenDataset d = train::TokenDataset::open(a.o.data, "train");
    if (d.shards().front()->header().vocab_size > 0) c->vocab_size = d.shards().front()->header().vocab_size;
  }
  return *c;
}

bool given(const CLI::App& app, const char* flag) { return app.count(flag) > 0; }

// A flag left out on --resume takes the value the run was started with, so `merlin train --data D --out DIR
// --resume DIR` continues the original run (same model, schedule and data order) without repeating its flags.
void adopt_hyperparameters(const CLI::App& app, const train::TrainState& s, TrainArgs& a) {
  train::OptimConfig& p = a.o.optim;
  for (const auto& [name, v] : s.hyper) {
    auto take = [&](const char* key, const char* flag, auto& field) {
      if (name == key && !given(app, flag)) field = static_cast<std::remove_reference_t<decltype(field)>>(v);
    };
    take("lr", "--lr", p.lr);
    take("min_lr", "--min-lr", a.min_lr);
    take("warmup", "--warmup", p.warmup);
    take("steps", "--steps", p.steps);
    take("batch", "--batch", a.o.batch);
    take("seq", "--seq", a.o.seq);
    take("accum", "--accum", a.o.accum);
    take("weight_decay", "--weight-decay", p.weight_decay);
    take("grad_clip", "--grad-clip", p.grad_clip);
    take("beta1", "--beta1", p.beta1);
    take("beta2", "--beta2", p.beta2);
    take("eps", "--adam-eps", p.eps);
    take("seed", "--seed", a.o.seed);
    take("dropout", "--dropout", a.o.dropout);
    if (name == "decay_embeddings" && !given(app, "--decay-embeddings")) p.decay_embeddings = v != 0;
  }
}

bool model_flags_given(const CLI::App& app) {
  for (const char* f : {"--preset", "--dim", "--layers", "--heads", "--kv-heads", "--ffn", "--ctx", "--untied", "--vocab"})
    if (given(app, f)) return true;
  return false;
}

int run_train(const CLI::App& app, TrainArgs& a) {
  train::TrainOptions& o = a.o;
  std::optional<ModelConfig> resumed_model;
  if (!o.resume.empty()) {
    const train::Checkpoint ck = train::read_checkpoint_header(train::resolve_checkpoint(o.resume));
    adopt_hyperparameters(app, ck.state, a);
    if (!model_flags_given(app)) resumed_model = ck.config;
  }
  // Explicit model flags on a resume are checked against the checkpoint by the trainer.
  o.model = resumed_model ? *resumed_model : model_config(a);
  if (o.seq == 0) o.seq = std::min<int64_t>(256, o.model.context_length);
  o.optim.min_lr = a.min_lr >= 0 ? a.min_lr : o.optim.lr / 10;
  o.progress = !a.quiet;
  const train::TrainResult r = train::train_model(o);
  if (a.quiet) return 0;
  std::fprintf(stderr, "train: %llu steps, final loss %.4f", (unsigned long long)r.steps_done, r.last_loss);
  if (r.last_val_loss >= 0) std::fprintf(stderr, ", val loss %.4f", r.last_val_loss);
  std::fprintf(stderr, "; checkpoint %s, metrics %s/metrics.jsonl\n", r.last_checkpoint.c_str(), o.out_dir.c_str());
  return 0;
}

}  // namespace

Action add_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  train::TrainOptions& o = a->o;
  o.seq = 0;  // default: min(256, context), decided once the model is known
  add_model_flags(app, a->model);
  app.add_option("--vocab", a->vocab, "override: vocabulary size (default: the tokenizer's)")->group("");
  app.add_option("--data", o.data, "train shard, or a directory from 'merlin prepare'")->required();
  app.add_option("--val", o.val, "validation shard or directory (default: val-*.tok beside --data)");
  app.add_option("-o,--out", o.out_dir, "output directory: metrics.jsonl and checkpoints")->required();
  app.add_option("--resume", o.resume,
                 "checkpoint to continue from (or a directory: its latest); flags left out take the run's values");
  app.add_option("--steps", o.optim.steps, "optimizer steps")->capture_default_str();
  app.add_option("--batch", o.batch, "sequences per micro-batch")->capture_default_str();
  app.add_option("--seq", o.seq, "tokens per sequence (default: min(256, context))");
  app.add_option("--accum", o.accum, "micro-batches per step (gradient accumulation)")->capture_default_str();
  app.add_option("--lr", o.optim.lr, "peak learning rate")->capture_default_str();
  app.add_option("--min-lr", a->min_lr, "final learning rate of the cosine decay (default: lr/10)");
  app.add_option("--warmup", o.optim.warmup, "linear warm-up steps")->capture_default_str();
  app.add_option("--weight-decay", o.optim.weight_decay, "AdamW decoupled weight decay")->capture_default_str();
  app.add_flag("--decay-embeddings", o.optim.decay_embeddings, "apply weight decay to the embeddings too");
  app.add_option("--beta1", o.optim.beta1, "AdamW beta1")->capture_default_str();
  app.add_option("--beta2", o.optim.beta2, "AdamW beta2")->capture_default_str();
  app.add_option("--adam-eps", o.optim.eps, "AdamW epsilon")->capture_default_str();
  app.add_option("--grad-clip", o.optim.grad_clip, "clip the global gradient norm (0: off)")->capture_default_str();
  app.add_option("--dropout", o.dropout, "residual dropout on each layer's attention and MLP outputs while training")
      ->capture_default_str();
  app.add_option("--eval-every", o.eval_every, "steps between evaluations (0: never)")->capture_default_str();
  app.add_option("--eval-tokens", o.eval_tokens, "validation tokens per evaluation")->capture_default_str();
  app.add_option("--ckpt-every", o.ckpt_every, "steps between checkpoints (one is always written at the end)")
      ->capture_default_str();
  app.add_option("--keep-ckpts", o.keep_checkpoints, "checkpoints to keep (0: all)")->capture_default_str();
  app.add_option("--print-every", o.print_every, "steps between progress lines when not on a terminal")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the initialisation and of the data order")->capture_default_str();
  app.add_option("-t,--threads", o.threads, "threads (default: all cores)");
  app.add_flag("-q,--quiet", a->quiet, "no progress output");
  app.add_option("--dump", o.dump_dir, "debug: dump weights, batches and gradients of every step")->group("");
  return [a, &app] { return run_train(app, *a); };
}

}  // namespace merlin::cli
