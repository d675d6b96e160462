// CPU float-kernel benchmarks.
//   gemv/<level>/<type>/<rows>x<k>/threads:N  one token; bytes_per_second counts weight bytes streamed.
//     Weights rotate over enough copies to exceed the L3 cache, as in a real decode step where every matrix
//     of the model is read once per token.
//   gemm/<level>/<type>/<rows>x<k>/tokens:T/threads:N  prefill; FLOPS counts 2*rows*k*T per iteration.
// N > 1 splits rows over a merlin::ThreadPool the way the runtime does (64-row aligned chunks).
#include <array>
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels.h"

namespace {

using merlin::DType;
using merlin::KernelLevel;
namespace mk = merlin::kernels;

constexpr size_t kColdBytes = 256ull << 20;  // well past the 32 MB L3

size_t elem_bytes(DType t) { return t == DType::F32 ? 4 : 2; }

std::vector<uint8_t> random_weights(DType type, int64_t rows, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<uint8_t> out((size_t)(rows * k) * elem_bytes(type));
  for (int64_t i = 0; i < rows * k; ++i) {
    const float v = dist(rng);
    if (type == DType::F32) {
      std::memcpy(&out[(size_t)i * 4], &v, 4);
    } else {
      const uint16_t h = type == DType::F16 ? merlin::f32_to_fp16(v) : merlin::f32_to_bf16(v);
      std::memcpy(&out[(size_t)i * 2], &h, 2);
    }
  }
  return out;
}

merlin::ThreadPool& pool(int n_threads) {
  static std::unique_ptr<merlin::ThreadPool> p;
  if (!p || p->size() != n_threads) p = std::make_unique<merlin::ThreadPool>(n_threads);
  return *p;
}

struct Shape {
  KernelLevel level;
  DType type;
  int64_t rows, k, tokens;
  int threads;
};

void run_matmul(benchmark::State& state, Shape s, bool cold) {
  const mk::MatmulKernel* kern = mk::kernels_for(s.level).matmul(s.type);
  const size_t row_bytes = (size_t)s.k * elem_bytes(s.type);
  const size_t matrix_bytes = row_bytes * (size_t)s.rows;
  const size_t copies = cold ? (kColdBytes + matrix_bytes - 1) / matrix_bytes : 1;
  std::vector<std::vector<uint8_t>> weights;
  weights.push_back(random_weights(s.type, s.rows, s.k, 1));
  for (size_t c = 1; c < copies; ++c) weights.push_back(weights[0]);
  // Activations 64-byte aligned like the runtime's scratch: a large std::vector starts 16 bytes past a page,
  // which splits every vector load of an activation row across two cache lines.
  std::vector<float> x_buf((size_t)(s.tokens * s.k) + 16, 0.5f), y((size_t)(s.tokens * s.rows));
  float* const x_data = x_buf.data() + (64 - reinterpret_cast<uintptr_t>(x_buf.data()) % 64) % 64 / sizeof(float);
  merlin::ThreadPool& tp = pool(s.threads);
  size_t next = 0;
  for (auto _ : state) {
    const uint8_t* w = weights[next].data();
    next = next + 1 == copies ? 0 : next + 1;
    tp.parallel_for(
        s.rows,
        [&](int64_t r0, int64_t r1) {
          kern->rows(w, row_bytes, r0, r1, x_data, (size_t)s.k * 4, s.tokens, s.k, y.data(), s.rows);
        },
        64);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed((int64_t)state.iterations() * (int64_t)matrix_bytes);
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * (double)s.rows * (double)s.k * (double)s.tokens, benchmark::Counter::kIsIterationInvariantRate);
}

std::string shape_name(const char* kind, const Shape& s) {
  std::string n = std::string(kind) + "/" + merlin::kernel_level_name(s.level) + "/" + merlin::dtype_name(s.type) + "/" +
                  std::to_string(s.rows) + "x" + std::to_string(s.k);
  if (s.tokens > 1) n += "/tokens:" + std::to_string(s.tokens);
  return n + "/threads:" + std::to_string(s.threads);
}

void register_all() {
  const KernelLevel best = merlin::best_kernel_level();
  const int64_t gemv_shapes[][2] = {{768, 768}, {2048, 768}, {768, 2048}, {50257, 768}};
  const int64_t gemm_shapes[][2] = {{768, 768}, {2048, 768}, {2304, 768}, {768, 2048}};
  for (KernelLevel level : {KernelLevel::Scalar, KernelLevel::Avx2, KernelLevel::Avx512}) {
    if (level > best) continue;
    for (DType type : {DType::F32, DType::F16, DType::BF16}) {
      for (int threads : {1, 2}) {
        for (const auto& rk : gemv_shapes) {
          const Shape s{level, type, rk[0], rk[1], 1, threads};
          benchmark::RegisterBenchmark(shape_name("gemv", s).c_str(), [s](benchmark::State& st) { run_matmul(st, s, true); })
              ->UseRealTime();
        }
        if (level == KernelLevel::Scalar) continue;  // minutes per iteration set; the oracle is not a target
        for (const auto& rk : gemm_shapes) {
          const Shape s{level, type, rk[0], rk[1], 512, threads};
          benchmark::RegisterBenchmark(shape_name("gemm", s).c_str(), [s](benchmark::State& st) { run_matmul(st, s, false); })
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond);
        }
        // A 32-sequence server decode step of the default model (d256 ffn1024): the output head's k and the FFN down's.
        for (const auto& rk : {std::array<int64_t, 2>{8192, 256}, std::array<int64_t, 2>{256, 1024}}) {
          const Shape s{level, type, rk[0], rk[1], 32, threads};
          benchmark::RegisterBenchmark(shape_name("gemm", s).c_str(), [s](benchmark::State& st) { run_matmul(st, s, false); })
              ->UseRealTime();
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("kernel_levels", merlin::cpu_features_string());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
