// merlin train: train a model from scratch (or resume) on token shards written by `merlin prepare`.
#include <cstdio>

#include "commands.h"
#include "core/error.h"
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

int run_train(TrainArgs& a) {
  train::TrainOptions& o = a.o;
  o.model = model_config(a);
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
  app.add_option("--resume", o.resume, "checkpoint to continue from (or a directory: its latest)");
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
  return [a] { return run_train(*a); };
}

}  // namespace merlin::cli
