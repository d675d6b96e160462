// Quantized matmul kernels, one thread unless the name says threads:2 (rows split in two, as the runtime
// does). Single-thread rates are per CPU second (steadier on a shared machine); threads:2 rates are per
// wall-clock second.
//   gemv/TYPE/LEVEL/ROWSxK:   one token, reported as GB/s of weight bytes (bytes_per_second).
//   gemm/TYPE/LEVEL/512x768x768: 512 tokens, reported as GOP/s (2 * rows * k * tokens per call).
//   quantize_act/ACT/LEVEL: float activations to Q8_0 / Q8_K.
//   vnni_peak: back-to-back 512-bit vpdpbusd on 12 independent accumulators, the int8 rate the quantized
//     GEMM tiles are measured against (GOP/s, 2 per multiply-add); only where the avx512 level runs.
// LEVEL avx512_packed: the load-time row-interleaved layout (MatmulKernel::packed) where a type has one.
// Run with --benchmark_repetitions=3 --benchmark_report_aggregates_only=true for medians.
#include <benchmark/benchmark.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant.h"

using namespace merlin;
using namespace merlin::kernels;

namespace {

const DType kTypes[] = {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ1_0, DType::TQ2_0};
const KernelLevel kLevels[] = {KernelLevel::Scalar, KernelLevel::Avx2, KernelLevel::Avx512};

std::vector<float> gaussian(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& f : v) f = d(rng);
  return v;
}

// rows x k weights: 64 distinct quantized rows repeated (quantizing 50257 rows of Q4_K would dominate
// start-up; the kernels' speed does not depend on the values).
std::vector<uint8_t> make_weights(DType type, int64_t rows, int64_t k) {
  const size_t row_bytes = dtype_row_bytes(type, (uint64_t)k);
  const int64_t distinct = rows < 64 ? rows : 64;
  const auto f = gaussian((size_t)(distinct * k), 1, 0.05f);
  std::vector<uint8_t> w(row_bytes * rows);
  for (int64_t r = 0; r < distinct; ++r) quant_quantize_row(type, &f[r * k], &w[r * row_bytes], k);
  for (int64_t r = distinct; r < rows; ++r) std::memcpy(&w[r * row_bytes], &w[(r % distinct) * row_bytes], row_bytes);
  return w;
}

struct Problem {
  const MatmulKernel* kern;
  std::vector<uint8_t> w, x;
  std::vector<float> y;
  int64_t rows, k, n_tokens;
  size_t w_row, x_row;
  bool packed;

  Problem(DType type, KernelLevel level, int64_t rows_, int64_t k_, int64_t n_tokens_, bool packed_ = false)
      : kern(quant_matmul_kernel(type, level)), rows(rows_), k(k_), n_tokens(n_tokens_), packed(packed_) {
    w = make_weights(type, rows, k);
    w_row = dtype_row_bytes(type, (uint64_t)k);
    if (packed) {
      std::vector<uint8_t> p(kern->packed->bytes(rows, k));
      kern->packed->repack(w.data(), w_row, rows, k, p.data());
      w.swap(p);
    }
    x_row = dtype_row_bytes(kern->act_type, (uint64_t)k);
    x.resize(x_row * n_tokens);
    const auto xf = gaussian((size_t)(n_tokens * k), 2, 1.0f);
    kern->quantize_act(xf.data(), n_tokens, k, x.data());
    y.resize((size_t)(rows * n_tokens));
  }

  void run(int64_t r0, int64_t r1) {
    if (packed) return kern->packed->rows(w.data(), 0, r0, r1, x.data(), x_row, n_tokens, k, y.data(), rows);
    kern->rows(w.data(), w_row, r0, r1, x.data(), x_row, n_tokens, k, y.data(), rows);
  }

  // Splits rows in multiples of 16 over `threads` threads, like the runtime's pool.
  void run_threads(int threads) {
    if (threads == 1) return run(0, rows);
    std::vector<std::thread> pool;
    const int64_t units = (rows + 15) / 16;
    for (int t = 0; t < threads; ++t) {
      const int64_t a = std::min(rows, units * t / threads * 16), b = std::min(rows, units * (t + 1) / threads * 16);
      pool.emplace_back([this, a, b] { run(a, b); });
    }
    for (auto& th : pool) th.join();
  }
};

void bm_gemv(benchmark::State& state, DType type, KernelLevel level, int64_t rows, int64_t k, bool packed) {
  Problem p(type, level, rows, k, 1, packed);
  for (auto _ : state) {
    p.run(0, rows);
    benchmark::DoNotOptimize(p.y.data());
  }
  state.SetBytesProcessed((int64_t)state.iterations() * (int64_t)(p.w_row * rows));
}

void bm_gemm(benchmark::State& state, DType type, KernelLevel level, int64_t n_tokens, int64_t rows, int64_t k,
             int threads, bool packed) {
  Problem p(type, level, rows, k, n_tokens, packed);
  for (auto _ : state) {
    p.run_threads(threads);
    benchmark::DoNotOptimize(p.y.data());
  }
  state.counters["GOP/s"] = benchmark::Counter(2.0 * rows * k * n_tokens / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void bm_quantize_act(benchmark::State& state, DType type, KernelLevel level, int64_t n_tokens, int64_t k) {
  const MatmulKernel* kern = quant_matmul_kernel(type, level);
  const auto xf = gaussian((size_t)(n_tokens * k), 3, 1.0f);
  std::vector<uint8_t> out(dtype_row_bytes(kern->act_type, (uint64_t)k) * n_tokens);
  for (auto _ : state) {
    kern->quantize_act(xf.data(), n_tokens, k, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed((int64_t)state.iterations() * n_tokens * k);
}

#if defined(__x86_64__)
// 12 chains: enough to cover the instruction's latency at two per cycle (8 already reach ~93 % here).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void bm_vnni_peak(benchmark::State& state) {
  constexpr int kChains = 12;
  constexpr int64_t kIters = 1 << 14;
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5), acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_epi32(j);
  for (auto _ : state) {
    for (int64_t i = 0; i < kIters; ++i) {
#pragma GCC unroll 12
      for (int j = 0; j < kChains; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
      asm volatile("" : "+v"(a));  // keeps the loop from being folded
    }
  }
  alignas(64) int32_t lanes[kChains][16];
  for (int j = 0; j < kChains; ++j) _mm512_store_si512(lanes[j], acc[j]);
  benchmark::DoNotOptimize(lanes);
  state.counters["GOP/s"] = benchmark::Counter(2.0 * 64 * kChains * kIters / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}
#endif

void register_all() {
  const KernelLevel best = best_kernel_level();
#if defined(__x86_64__)
  if (best >= KernelLevel::Avx512) benchmark::RegisterBenchmark("vnni_peak", bm_vnni_peak)->Unit(benchmark::kMicrosecond);
#endif
  for (KernelLevel level : kLevels) {
    if (level > best) continue;
    for (DType type : kTypes)
      for (bool packed : {false, true}) {
        if (packed && quant_matmul_kernel(type, level)->packed == nullptr) continue;
        const std::string lv = std::string(kernel_level_name(level)) + (packed ? "_packed" : "");
        const std::string tn = dtype_name(type);
        for (auto [rows, k] : {std::pair<int64_t, int64_t>{768, 768}, {2048, 768}, {50257, 768}}) {
          benchmark::RegisterBenchmark(
              ("gemv/" + tn + "/" + lv + "/" + std::to_string(rows) + "x" + std::to_string(k)).c_str(), bm_gemv, type,
              level, rows, k, packed)
              ->Unit(benchmark::kMicrosecond);
        }
        for (int threads : {1, 2}) {
          if (level == KernelLevel::Scalar && threads == 2) continue;
          auto* b = benchmark::RegisterBenchmark(
              ("gemm/" + tn + "/" + lv + "/512x768x768/threads:" + std::to_string(threads)).c_str(), bm_gemm, type,
              level, 512, 768, 768, threads, packed);
          b->Unit(benchmark::kMillisecond);
          if (threads > 1) b->UseRealTime();  // worker threads' CPU time is not the main thread's
          // A 32-sequence decode step's gate/up product (the server's many-client case).
          auto* d = benchmark::RegisterBenchmark(
              ("gemm/" + tn + "/" + lv + "/32x4096x768/threads:" + std::to_string(threads)).c_str(), bm_gemm, type,
              level, 32, 4096, 768, threads, packed);
          d->Unit(benchmark::kMicrosecond);
          if (threads > 1) d->UseRealTime();
        }
      }
    const std::string lv = kernel_level_name(level);
    for (DType act : {DType::Q8_0, DType::Q4_K}) {  // Q4_K's kernel quantizes to Q8_K
      const std::string an = act == DType::Q8_0 ? "q8_0" : "q8_k";
      benchmark::RegisterBenchmark(("quantize_act/" + an + "/" + lv + "/512x768").c_str(), bm_quantize_act, act, level,
                                   512, 768)
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
