// merlin bench: llama-bench-style throughput rows (runtime/bench.h), memory bandwidth, and the per-format
// table of a preset (`--preset base --types f32,q8_0,...`), which builds the models itself and measures each
// in its own process, since peak RSS (VmHWM) never goes down within one.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "core/error.h"
#include "core/sys.h"
#include "model/init.h"
#include "runtime/backend.h"
#include "runtime/bandwidth.h"
#include "runtime/bench.h"
#include "runtime/model.h"
#include "runtime/quantize_model.h"
#include "tokenizer/tokenizer.h"

namespace merlin::cli {
namespace {

using nlohmann::json;

struct BenchArgs {
  std::vector<std::string> models;
  int n_prompt = 512, n_gen = 128, reps = 5, threads = 2, batch = 512;
  std::string output = "md", kv_type = "f16", preset, types = "f32,q8_0,q4_0,q4_k,mxfp4,tq2_0", vocab_dir;
  std::string device = "cpu", decode_batches = "1";
  bool no_kv_cache = false, bandwidth = false;
};

void log_line(const std::string& s) { std::fprintf(stderr, "[bench] %s\n", s.c_str()); }

std::vector<int> parse_int_list(const std::string& list) {
  std::vector<int> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    MERLIN_CHECK(!item.empty() && *end == 0 && v >= 1 && v <= 4096, "bad number '", item, "' in --decode-batches");
    out.push_back((int)v);
  }
  MERLIN_CHECK(!out.empty(), "--decode-batches is empty");
  return out;
}

json bench_file(const std::string& path, const BenchArgs& a) {
  auto model = Model::load(path);
  BenchOptions o;
  o.n_prompt = a.n_prompt;
  o.n_gen = a.n_gen;
  o.reps = a.reps;
  o.n_threads = a.threads;
  o.n_batch = a.batch;
  o.kv_cache = !a.no_kv_cache;
  o.kv_type = parse_kv_type(a.kv_type);
  o.device = a.device;
  o.decode_batches = parse_int_list(a.decode_batches);
  o.log = [&](const std::string& s) { log_line(std::filesystem::path(path).filename().string() + ": " + s); };
  json j = {{"model", std::filesystem::path(path).filename().string()},
            {"size_bytes", model->weight_bytes()},
            {"weight_bytes_per_token", weight_bytes_per_token(*model)},
            {"params", model->config().n_params()},
            {"type", dtype_name(model->weight_type())},
            {"threads", a.threads},
            {"kv_cache", o.kv_cache},
            {"kv_type", a.kv_type},
            {"device", a.device}};
  BenchDevice dev;
  for (const BenchTest& t : bench_model(*model, o, &dev))
    j["tests"].push_back({{"test", t.name}, {"n_prompt", t.n_prompt}, {"n_gen", t.n_gen}, {"batch", t.batch},
                          {"avg_ts", t.mean}, {"stddev_ts", t.sd}, {"median_ts", t.median}, {"samples_ts", t.tps},
                          {"bytes_per_step", t.bytes_per_step}, {"roofline_ts", t.roofline_tps}});
  if (a.device != "cpu") {
    j["device_name"] = dev.name;
    j["copy_gbps"] = dev.copy_gbps;
    j["gpu_memory_bytes"] = dev.memory_in_use;
  }
  j["peak_rss_bytes"] = peak_rss_bytes();  // after this model's tests: models run in turn only grow it
  return j;
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

std::string params_str(uint64_t n) { return n >= 1000000000 ? fmt("%.2f B", n / 1e9) : fmt("%.2f M", n / 1e6); }

// GPU rows: the CPU table's columns (threads and RSS replaced by the device's) plus each tg row's
// bandwidth roofline and the fraction of it reached.
void print_gpu_rows(const json& all) {
  std::printf("| model | size | params | type | device | KV | test | t/s | roofline t/s | of roofline | GPU memory |\n");
  std::printf("| --- | ---: | ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: |\n");
  for (const json& m : all) {
    const std::string kv = m["kv_cache"].get<bool>() ? m["kv_type"].get<std::string>() : "none";
    for (const json& t : m["tests"]) {
      const double roof = t["roofline_ts"].get<double>();
      std::printf("| %s | %s | %s | %s | %s | %s | %s | %.2f ± %.2f | %s | %s | %s |\n",
                  m["model"].get<std::string>().c_str(), format_bytes(m["size_bytes"]).c_str(),
                  params_str(m["params"]).c_str(), m["type"].get<std::string>().c_str(),
                  m["device"].get<std::string>().c_str(), kv.c_str(), t["test"].get<std::string>().c_str(),
                  t["avg_ts"].get<double>(), t["stddev_ts"].get<double>(), roof > 0 ? fmt("%.0f", roof).c_str() : "-",
                  roof > 0 ? fmt("%.0f %%", 100.0 * t["median_ts"].get<double>() / roof).c_str() : "-",
                  format_bytes(m["gpu_memory_bytes"]).c_str());
    }
  }
  for (const json& m : all) {
    std::printf("\n%s: %s, copy bandwidth %.0f GB/s (read + write); roofline = bytes of weights and K/V read per "
                "decode step / that bandwidth\n", m["model"].get<std::string>().c_str(),
                m["device_name"].get<std::string>().c_str(), m["copy_gbps"].get<double>());
    break;
  }
}

void print_rows(const json& all) {
  if (!all.empty() && all[0].value("device", std::string("cpu")) != "cpu") return print_gpu_rows(all);
  std::printf("| model | size | params | type | threads | KV | test | t/s | peak RSS |\n");
  std::printf("| --- | ---: | ---: | --- | ---: | --- | --- | ---: | ---: |\n");
  for (const json& m : all) {
    const std::string kv = m["kv_cache"].get<bool>() ? m["kv_type"].get<std::string>() : "none";
    for (const json& t : m["tests"])
      std::printf("| %s | %s | %s | %s | %d | %s | %s | %.2f ± %.2f | %s |\n", m["model"].get<std::string>().c_str(),
                  format_bytes(m["size_bytes"]).c_str(), params_str(m["params"]).c_str(),
                  m["type"].get<std::string>().c_str(), m["threads"].get<int>(), kv.c_str(),
                  t["test"].get<std::string>().c_str(), t["avg_ts"].get<double>(), t["stddev_ts"].get<double>(),
                  format_bytes(m["peak_rss_bytes"]).c_str());
  }
}

int bench_files(const BenchArgs& a) {
  json all = json::array();
  for (const std::string& m : a.models) all.push_back(bench_file(m, a));
  if (a.output == "json") std::printf("%s\n", all.dump(2).c_str());
  else print_rows(all);
  return 0;
}

int bench_bandwidth(const BenchArgs& a) {
  log_line("summing a 1 GiB buffer, median of 5 passes");
  const double one = read_bandwidth_gbps(1), many = a.threads > 1 ? read_bandwidth_gbps(a.threads) : one;
  if (a.output == "json") {
    std::printf("%s\n", json{{"read_gbps_1_thread", one}, {"threads", a.threads}, {"read_gbps", many}}.dump(2).c_str());
  } else {
    std::printf("| threads | read bandwidth |\n| ---: | ---: |\n| 1 | %.1f GB/s |\n", one);
    if (a.threads > 1) std::printf("| %d | %.1f GB/s |\n", a.threads, many);
  }
  return 0;
}

// Runs this executable with `args` and returns its stdout; stderr (the child's progress) passes through.
std::string run_self(const std::vector<std::string>& args) {
  int fd[2];
  MERLIN_CHECK(pipe(fd) == 0, "pipe failed");
  const pid_t pid = fork();
  MERLIN_CHECK(pid >= 0, "fork failed");
  if (pid == 0) {
    dup2(fd[1], STDOUT_FILENO);
    close(fd[0]);
    close(fd[1]);
    std::vector<char*> argv;
    for (const std::string& s : args) argv.push_back(const_cast<char*>(s.c_str()));
    argv.push_back(nullptr);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  close(fd[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fd[0], buf, sizeof buf)) > 0;) out.append(buf, (size_t)n);
  close(fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  MERLIN_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "benchmark child process failed: merlin ",
               args.size() > 3 ? args[3] : "");
  return out;
}

json bench_in_child(const std::string& path, const BenchArgs& a, bool kv_cache) {
  std::vector<std::string> args = {"merlin", "bench", "-m", path, "-p", std::to_string(a.n_prompt), "-n",
                                   std::to_string(a.n_gen), "-r", std::to_string(a.reps), "-t",
                                   std::to_string(a.threads), "-b", std::to_string(a.batch), "-o", "json",
                                   "--kv-type", a.kv_type, "--device", a.device, "--decode-batches",
                                   a.decode_batches};
  if (!kv_cache) args.push_back("--no-kv-cache");
  return json::parse(run_self(args)).at(0);
}

// A directory removed with everything in it when the scope ends.
struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "merlin-bench-XXXXXX").string();
    MERLIN_CHECK(mkdtemp(tmpl.data()) != nullptr, "cannot create a temporary directory");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

std::vector<DType> parse_types(const std::string& list) {
  std::vector<DType> types;
  std::stringstream ss(list);
  for (std::string name; std::getline(ss, name, ',');) {
    const std::optional<DType> t = parse_quant_type(name);
    MERLIN_CHECK(t.has_value(), "unknown type '", name, "' in --types (types: ", quant_type_names(), ")");
    types.push_back(*t);
  }
  MERLIN_CHECK(!types.empty(), "--types is empty");
  return types;
}

double test_tps(const json& m, char kind) {
  for (const json& t : m["tests"])
    if (t["test"].get<std::string>()[0] == kind) return t["median_ts"];
  return 0;
}

struct PresetRow {
  std::string config;
  json m;
};

void print_preset_table(const std::vector<PresetRow>& rows, double gbps, const BenchArgs& a) {
  std::printf("| configuration | file size | tokens/s (tg%d, median) | pp%d t/s (median) | peak memory | tg roofline t/s "
              "| of roofline |\n", a.n_gen, a.n_prompt);
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const PresetRow& r : rows) {
    const double tg = test_tps(r.m, 't'), pp = test_tps(r.m, 'p');
    const double roof = gbps * 1e9 / r.m["weight_bytes_per_token"].get<double>();
    const bool cached = r.m["kv_cache"].get<bool>();
    std::printf("| %s | %s | %.2f | %.1f | %s | %s | %s |\n", r.config.c_str(), format_bytes(r.m["size_bytes"]).c_str(),
                tg, pp, format_bytes(r.m["peak_rss_bytes"]).c_str(), cached ? fmt("%.1f", roof).c_str() : "-",
                cached ? fmt("%.0f %%", 100.0 * tg / roof).c_str() : "-");
  }
  std::printf("\nroofline: %d-thread read bandwidth %.1f GB/s / weight bytes read per token\n", a.threads, gbps);
}

int bench_preset(const BenchArgs& a) {
  std::optional<ModelConfig> c = preset(a.preset);
  MERLIN_CHECK(c.has_value(), "unknown preset '", a.preset, "' (sanity, experiment, base, iphone, macbook)");
  const std::vector<DType> types = parse_types(a.types);
  const std::string dir = find_gpt2_vocab_dir(a.vocab_dir);
  auto tok = Tokenizer::from_gpt2_files(dir + "/encoder.json", dir + "/vocab.bpe");
  c->vocab_size = tok->vocab_size();
  TempDir tmp;
  const std::string f32 = tmp.path + "/" + a.preset + "-f32.gguf";
  log_line(cat("writing a random ", a.preset, " model (", c->n_params() / 1e6, " M parameters) to ", f32));
  InitOptions io;
  io.n_threads = a.threads;
  write_random_model(*c, *tok, io, f32);
  log_line(cat("measuring read bandwidth with ", a.threads, " threads"));
  const double gbps = read_bandwidth_gbps(a.threads);
  std::vector<PresetRow> rows;
  for (DType t : types) {
    std::string path = f32;
    if (t != DType::F32) {
      path = tmp.path + "/" + a.preset + "-" + dtype_name(t) + ".gguf";
      log_line(cat("quantizing to ", dtype_name(t)));
      QuantizeOptions qo;
      qo.type = t;
      qo.n_threads = a.threads;
      for (const TensorPlan& p : quantize_model(f32, path, qo).tensors)
        if (!p.note.empty()) log_line(p.name + ": " + p.note);
    } else {
      log_line("f32 without KV cache (every step recomputes the sequence)");
      rows.push_back({"f32, no KV cache", bench_in_child(path, a, false)});
    }
    log_line(cat(dtype_name(t), " + KV cache"));
    rows.push_back({cat(dtype_name(t), " + KV cache"), bench_in_child(path, a, true)});
    if (t != DType::F32) std::filesystem::remove(path);
  }
  print_preset_table(rows, gbps, a);
  return 0;
}

int bench(const BenchArgs& a) {
  MERLIN_CHECK(a.output == "md" || a.output == "json", "-o must be md or json");
  if (a.bandwidth) return bench_bandwidth(a);
  if (!a.preset.empty()) return bench_preset(a);
  MERLIN_CHECK(!a.models.empty(), "give -m MODEL, --preset NAME or --bandwidth");
  return bench_files(a);
}

}  // namespace

Action add_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  app.add_option("-m,--model", a->models, "GGUF model file (repeatable)");
  app.add_option("-p,--n-prompt", a->n_prompt, "prompt tokens of the pp test (0: none)")->check(CLI::Range(0, 1 << 20));
  app.add_option("-n,--n-gen", a->n_gen, "generated tokens of the tg test (0: none)")->check(CLI::Range(0, 1 << 20));
  app.add_option("-r,--repetitions", a->reps, "timed runs of each test")->check(CLI::Range(1, 1000));
  app.add_option("-t,--threads", a->threads, "threads")->check(CLI::Range(1, 1024));
  app.add_option("-b,--batch", a->batch, "tokens per forward pass in the pp test")->check(CLI::Range(1, 1 << 20));
  app.add_option("-o,--output", a->output, "md | json");
  app.add_option("--kv-type", a->kv_type, "KV cache type: f32 | f16 | q8_0");
  app.add_flag("--no-kv-cache", a->no_kv_cache, "tg: recompute the whole sequence every step");
  app.add_option("--preset", a->preset, "build this preset's model in every --types format and print the table");
  app.add_option("--types", a->types, "formats for --preset, comma-separated");
  app.add_option("--vocab-dir", a->vocab_dir, "directory with GPT-2 encoder.json and vocab.bpe (--preset)");
  app.add_flag("--bandwidth", a->bandwidth, "measure memory read bandwidth (1 and -t threads)");
  app.add_option("--device", a->device, "cpu (default) | cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--decode-batches", a->decode_batches,
                 "tg tests: sequences decoding greedily together, comma-separated (e.g. 1,32)");
  return [a] { return bench(*a); };
}

}  // namespace merlin::cli
