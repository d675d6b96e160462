#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "core/error.h"
#include "core/sys.h"
#include "core/thread_pool.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/network.h"
#include "train/tokens.h"
#include "train/train_debug.h"

namespace merlin::train {
namespace {

namespace fs = std::filesystem;

std::vector<std::pair<std::string, double>> hyperparameters(const TrainOptions& o) {
  const OptimConfig& p = o.optim;
  return {{"lr", p.lr},           {"min_lr", p.min_lr},         {"warmup", (double)p.warmup},
          {"steps", (double)p.steps}, {"batch", (double)o.batch},   {"seq", (double)o.seq},
          {"accum", (double)o.accum}, {"weight_decay", p.weight_decay}, {"grad_clip", p.grad_clip},
          {"beta1", p.beta1},     {"beta2", p.beta2},           {"eps", p.eps},
          {"decay_embeddings", p.decay_embeddings ? 1.0 : 0.0}, {"seed", (double)o.seed},
          {"dropout", (double)o.dropout}};
}

void validate(const TrainOptions& o) {
  o.model.validate();
  MERLIN_CHECK(o.batch > 0 && o.seq > 0 && o.accum > 0, "--batch, --seq and --accum must be positive");
  MERLIN_CHECK(o.seq <= o.model.context_length, "--seq ", o.seq, " exceeds the model's context length ",
               o.model.context_length, " (raise --ctx)");
  MERLIN_CHECK(o.optim.steps > 0, "--steps must be positive");
  MERLIN_CHECK(o.optim.lr > 0 && o.optim.min_lr >= 0 && o.optim.min_lr <= o.optim.lr,
               "need --lr > 0 and 0 <= --min-lr <= --lr");
  MERLIN_CHECK(o.optim.warmup >= 0 && o.optim.weight_decay >= 0 && o.optim.grad_clip >= 0,
               "--warmup, --weight-decay and --grad-clip must not be negative");
  MERLIN_CHECK(o.optim.beta1 >= 0 && o.optim.beta1 < 1 && o.optim.beta2 >= 0 && o.optim.beta2 < 1 && o.optim.eps > 0,
               "AdamW needs 0 <= beta < 1 and eps > 0");
  MERLIN_CHECK(o.dropout >= 0.0f && o.dropout < 1.0f, "--dropout must be in [0, 1)");
  MERLIN_CHECK(!o.out_dir.empty(), "--out DIR is required");
  MERLIN_CHECK(o.model.vocab_size <= 65536, "token shards hold 16-bit ids: the vocabulary must be at most 65536");
}

std::optional<TokenDataset> open_val(const TrainOptions& o) {
  if (!o.val.empty()) return TokenDataset::open(o.val, "val");
  if (!fs::is_directory(o.data)) return std::nullopt;
  for (const auto& e : fs::directory_iterator(o.data)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("val-", 0) == 0 && e.path().extension() == ".tok") return TokenDataset::open(o.data, "val");
  }
  return std::nullopt;
}

class Trainer {
 public:
  explicit Trainer(const TrainOptions& o);
  TrainResult run();

 private:
  void start_fresh();
  void resume_from(const std::string& path);
  double train_step(int64_t step);  // returns the mean loss
  void evaluate(uint64_t step);
  void checkpoint(uint64_t step);
  void prune_checkpoints();
  void report(uint64_t step, double loss, double lr, double norm, double tok_s);
  [[noreturn]] void diverged(const char* what, double value, uint64_t step);
  bool progress_is_live() const { return o_.progress && live_; }
  double elapsed() const { return prior_elapsed_ + (now_seconds() - start_time_); }

  const TrainOptions& o_;
  ThreadPool pool_;
  TokenDataset data_;
  std::optional<TokenDataset> val_;
  Network net_;
  AdamW opt_;
  BatchSampler sampler_;
  std::unique_ptr<MetricsLog> metrics_;
  std::unique_ptr<DebugDump> dump_;
  std::vector<int32_t> tokens_;  // [accum][batch][seq+1]
  uint64_t start_step_ = 0;
  double prior_elapsed_ = 0, start_time_ = 0;
  TrainResult result_;
  bool live_ = stderr_is_terminal();
};

Trainer::Trainer(const TrainOptions& o)
    : o_(o), pool_(o.threads > 0 ? o.threads : ThreadPool::default_threads()), data_(TokenDataset::open(o.data, "train")),
      val_(open_val(o)), net_(o.model, o.batch, o.seq, pool_), opt_(net_.layout(), o.optim),
      sampler_(data_, o.seq, o.batch, o.model.vocab_size, o.seed * 0x9e3779b97f4a7c15ull + 0x243f6a8885a308d3ull),
      tokens_(o.accum * o.batch * (o.seq + 1)) {
  MERLIN_CHECK(!val_ || eval_windows(*val_, o.seq) > 0, "validation data (", val_->describe(),
               ") is shorter than one sequence of ", o.seq + 1, " tokens");
  fs::create_directories(o.out_dir);
  if (!o.resume.empty()) {
    resume_from(resolve_checkpoint(o.resume));
  } else {
    // Pruning and `--resume DIR` go by step numbers, so another run's checkpoints must not share the directory.
    MERLIN_CHECK(latest_checkpoint(o.out_dir).empty(), o.out_dir, " already holds checkpoints (",
                 latest_checkpoint(o.out_dir), "); continue that run with --resume ", o.out_dir,
                 " or choose another --out");
    start_fresh();
  }
  metrics_ = std::make_unique<MetricsLog>(o.out_dir + "/metrics.jsonl", !o.resume.empty(), start_step_);
  if (!o.dump_dir.empty()) dump_ = std::make_unique<DebugDump>(o.dump_dir, net_);
}

void Trainer::start_fresh() { init_params(o_.model, net_.layout(), o_.seed, net_.params().data(), pool_.size()); }

void Trainer::resume_from(const std::string& path) {
  Checkpoint ck = load_checkpoint(path);
  check_same_model(ck.config, o_.model, path);
  MERLIN_CHECK(ck.state.tokenizer == data_.tokenizer(), path, " was trained on '", ck.state.tokenizer,
               "' tokens but the data is '", data_.tokenizer(), "'");
  for (const auto& [name, now] : hyperparameters(o_))
    for (const auto& [ck_name, was] : ck.state.hyper)
      if (name == ck_name && was != now)
        std::fprintf(stderr, "warning: %s is %g now but was %g in %s; the resumed run will not match the original\n",
                     name.c_str(), now, was, path.c_str());
  MERLIN_CHECK(ck.state.step <= (uint64_t)o_.optim.steps, path, " is at step ", ck.state.step, ", past --steps ",
               o_.optim.steps);
  net_.params() = std::move(ck.params);
  opt_.m() = std::move(ck.m);
  opt_.v() = std::move(ck.v);
  sampler_.set_state(ck.state.data_rng);
  start_step_ = ck.state.step;
  prior_elapsed_ = ck.state.elapsed;
  result_.last_checkpoint = path;
  if (o_.progress)
    std::fprintf(stderr, "train: resumed from %s at step %llu\n", path.c_str(), (unsigned long long)start_step_);
}

TrainResult Trainer::run() {
  const int64_t steps = o_.optim.steps;
  start_time_ = now_seconds();
  if (o_.progress)
    std::fprintf(stderr, "train: %.2f M parameters, %s, %lld steps of %lld x %lld x %lld tokens, %d threads\n",
               (double)net_.layout().total() / 1e6, data_.describe().c_str(), (long long)steps, (long long)o_.accum,
               (long long)o_.batch, (long long)o_.seq, pool_.size());
  if (dump_ && start_step_ == 0) dump_->weights(0);
  if (start_step_ == 0 && val_ && o_.eval_every > 0) evaluate(0);
  for (int64_t step = (int64_t)start_step_; step < steps; ++step) {
    const double t0 = now_seconds();
    const double lr = lr_at(o_.optim, step);
    const double loss = train_step(step);
    const double norm = global_norm(pool_, net_.grads().data(), net_.grads().size());
    if (!std::isfinite(norm)) diverged("gradient norm", norm, step + 1);
    if (dump_) dump_->gradients(step);
    clip_gradient(pool_, net_.grads().data(), net_.grads().size(), norm, o_.optim.grad_clip);
    opt_.step(pool_, net_.params().data(), net_.grads().data(), step + 1, lr);
    const uint64_t done = step + 1;
    const double tok_s = (double)tokens_.size() / (double)(o_.seq + 1) * o_.seq / (now_seconds() - t0);
    metrics_->write({{"step", done}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm}, {"tokens_per_s", tok_s},
                     {"elapsed", elapsed()}});
    result_.steps_done = done;
    result_.last_loss = loss;
    if (dump_) dump_->weights(done);
    report(done, loss, lr, norm, tok_s);
    if (val_ && o_.eval_every > 0 && (done % o_.eval_every == 0 || done == (uint64_t)steps)) evaluate(done);
    if ((o_.ckpt_every > 0 && done % o_.ckpt_every == 0) || done == (uint64_t)steps) checkpoint(done);
  }
  if (progress_is_live()) std::fprintf(stderr, "\n");
  return result_;
}

double Trainer::train_step(int64_t step) {
  net_.zero_grads();
  const int64_t per_micro = o_.batch * (o_.seq + 1);
  const double tokens = (double)(o_.accum * o_.batch * o_.seq);
  const float scale = (float)(1.0 / tokens);
  double sum = 0;
  for (int64_t a = 0; a < o_.accum; ++a) {
    sampler_.next(tokens_.data() + a * per_micro);
    // A micro-batch's masks depend only on (seed, step, micro-batch), so a resumed run draws the same ones.
    net_.set_dropout(o_.dropout, (o_.seed * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)step << 20) ^ (uint64_t)a);
    sum += net_.forward_backward(tokens_.data() + a * per_micro, o_.batch, scale);
  }
  if (dump_) dump_->batch(step, tokens_);
  const double loss = sum / tokens;
  if (!std::isfinite(loss)) diverged("loss", loss, step + 1);
  return loss;
}

void Trainer::evaluate(uint64_t step) {
  const uint64_t windows = std::min<uint64_t>(eval_windows(*val_, o_.seq), std::max<int64_t>(1, o_.eval_tokens / o_.seq));
  std::vector<int32_t> buf(o_.batch * (o_.seq + 1));
  net_.set_dropout(0.0f, 0);  // the validation loss of the whole model
  double sum = 0;
  for (uint64_t w0 = 0; w0 < windows; w0 += o_.batch) {
    const int64_t rows = (int64_t)std::min<uint64_t>(o_.batch, windows - w0);
    for (int64_t r = 0; r < rows; ++r)
      copy_eval_window(*val_, o_.seq, w0 + r, o_.model.vocab_size, buf.data() + r * (o_.seq + 1));
    sum += net_.forward_loss(buf.data(), rows);
  }
  const double n = (double)(windows * o_.seq), loss = sum / n;
  const double bpt = val_->bytes_per_token();
  nlohmann::ordered_json rec = {{"step", step}, {"val_loss", loss}, {"val_ppl", std::exp(loss)}, {"val_tokens", (uint64_t)n}};
  if (bpt > 0) rec["val_bpb"] = loss / (std::log(2.0) * bpt);
  rec["elapsed"] = elapsed();
  metrics_->write(rec);
  result_.last_val_loss = loss;
  if (o_.progress) {
    if (progress_is_live()) std::fprintf(stderr, "\n");
    std::fprintf(stderr, "eval step %llu: val_loss %.4f  ppl %.2f", (unsigned long long)step, loss, std::exp(loss));
    if (bpt > 0) std::fprintf(stderr, "  bpb %.4f", loss / (std::log(2.0) * bpt));
    std::fprintf(stderr, "\n");
  }
}

void Trainer::checkpoint(uint64_t step) {
  TrainState s;
  s.step = step;
  s.data_rng = sampler_.state();
  s.elapsed = elapsed();
  s.tokenizer = data_.tokenizer();
  s.hyper = hyperparameters(o_);
  const std::string path = o_.out_dir + "/" + checkpoint_name(step);
  save_checkpoint(path, o_.model, net_.layout(), s, net_.params().data(), opt_.m().data(), opt_.v().data());
  result_.last_checkpoint = path;
  prune_checkpoints();
}

void Trainer::prune_checkpoints() {
  if (o_.keep_checkpoints <= 0) return;
  std::vector<std::pair<uint64_t, fs::path>> found;
  for (const auto& e : fs::directory_iterator(o_.out_dir)) {
    const std::string n = e.path().filename().string();
    unsigned long long step = 0;
    char tail[8] = {};
    if (std::sscanf(n.c_str(), "ckpt-%llu.%5s", &step, tail) == 2 && std::string(tail) == "ckpt" &&
        n == checkpoint_name(step))
      found.emplace_back(step, e.path());
  }
  std::sort(found.begin(), found.end());
  for (size_t i = 0; i + o_.keep_checkpoints < found.size(); ++i) fs::remove(found[i].second);
}

std::string format_duration(double s) {
  char buf[32];
  const long t = (long)s;
  std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  return buf;
}

void Trainer::report(uint64_t step, double loss, double lr, double norm, double tok_s) {
  if (!o_.progress) return;
  const uint64_t steps = (uint64_t)o_.optim.steps, here = step - start_step_;
  const bool due = step == steps || here == 1 || (o_.print_every > 0 && step % o_.print_every == 0);
  if (!live_ && !due) return;
  const double eta = (now_seconds() - start_time_) / (double)here * (double)(steps - step);
  std::fprintf(stderr, "%sstep %llu/%llu  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s  ETA %s%s",
               live_ ? "\r" : "", (unsigned long long)step, (unsigned long long)steps, loss, lr, norm, tok_s,
               format_duration(eta).c_str(), live_ ? "   " : "\n");
  std::fflush(stderr);
}

void Trainer::diverged(const char* what, double value, uint64_t step) {
  if (progress_is_live()) std::fprintf(stderr, "\n");
  fail("training diverged: the ", what, " is ", value, " at step ", step, "; stopped without saving. ",
       result_.last_checkpoint.empty() ? std::string("No checkpoint was written yet")
                                       : "The last good checkpoint is " + result_.last_checkpoint,
       " (try a lower --lr or --grad-clip)");
}

}  // namespace

TrainResult train_model(const TrainOptions& o) {
  validate(o);
  Trainer t(o);
  return t.run();
}

}  // namespace merlin::train
