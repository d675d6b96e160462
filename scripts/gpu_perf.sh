#!/usr/bin/env bash
# Quick performance probe for the GPU machine (docs/GPU.md): the GPU test binaries, the matrix-product
# microbenchmark (bench/cuda_matvec.cpp), and decode/prefill benchmarks of `base` under the A/B settings in
# SETTINGS, plus `macbook` when MACBOOK=1. Cheaper than scripts/gpu_test.sh; use it to check a kernel change
# before the full run.
#
#   scripts/gpu_perf.sh [BIN_DIR]        (BIN_DIR as for gpu_test.sh, plus cuda_matvec)
#
# SETTINGS: ';'-separated environment settings to compare, an empty entry being the defaults, e.g.
#   SETTINGS=";MERLIN_CUDA_GEMM_MIN=0;MERLIN_CUDA_NT4_CAP=0"  (defaults, no cuBLAS, uncapped 32-token product)
# Unset or empty: ";MERLIN_CUDA_GEMM_MIN=0". SETTINGS=";" runs the defaults only.
# BASE_TYPES (default "f16 q4_0"), MACBOOK_TYPES (default "q4_0"), TESTS=0 skips the tests, MATVEC=0 the
# microbenchmark, PP (default 512) the prefill length (0: none), BATCHES (default 1,32) the decode batch sizes,
# KEEP_MODELS=1 keeps the model files in MODEL_DIR for the next call (and reuses them).
set -u
BIN=$(realpath "${1:-build-gpu}")
source "$(dirname "$0")/gpu_env.sh"
IFS=';' read -r -a settings <<<"${SETTINGS:-;MERLIN_CUDA_GEMM_MIN=0}"
[ ${#settings[@]} -eq 0 ] && settings=("")
if [ "${TESTS:-1}" = 1 ]; then
  for t in cuda_kernels_test cuda_matvec1_test cuda_matvec_few_test cuda_sample_test cuda_gemm_test cuda_attention_test cuda_backend_test; do
    "$BIN/$t" --gtest_brief=1 >>"$OUT/tests.log" 2>&1 && echo "PASS $t" || echo "FAIL $t"
  done
  grep -E "FAILED|Failure|^\[ (logits|gemm|flash) " "$OUT/tests.log" | head -80
fi
[ "${MATVEC:-1}" = 1 ] && "$BIN/cuda_matvec" | tee "$OUT/matvec.md"
B="$BIN/merlin bench --device cuda -p ${PP:-512} -n 128 -r ${REPS:-2} --decode-batches ${BATCHES:-1,32}"
run_settings() {  # run_settings MODEL LABEL
  for setting in "${settings[@]}"; do
    echo "== $2 ${setting:-defaults}"
    env $setting $B -m "$1" 2>>"$OUT/bench.log" | grep -E "pp512|tg128" | tee -a "$OUT/bench.md"
  done
}
keep() { [ "${KEEP_MODELS:-0}" = 1 ]; }
if [ -n "${BASE_TYPES-f16 q4_0}" ]; then
  [ -f "$MODEL_DIR/base-f32.gguf" ] || "$BIN/merlin" init --preset base --type f32 -o "$MODEL_DIR/base-f32.gguf" >/dev/null 2>&1
  for ty in ${BASE_TYPES-f16 q4_0}; do
    f="$MODEL_DIR/base-$ty.gguf"
    [ -f "$f" ] || "$BIN/merlin" quantize -q "$MODEL_DIR/base-f32.gguf" "$f" "$ty" >/dev/null 2>&1
    run_settings "$f" "base $ty"
    keep || rm -f "$f"
  done
  keep || rm -f "$MODEL_DIR/base-f32.gguf"
fi
if [ "${MACBOOK:-0}" = 1 ]; then
  [ -f "$MODEL_DIR/macbook-bf16.gguf" ] ||
    "$BIN/merlin" init --preset macbook --type bf16 -o "$MODEL_DIR/macbook-bf16.gguf" >/dev/null 2>&1
  for ty in ${MACBOOK_TYPES:-q4_0}; do
    f="$MODEL_DIR/macbook-$ty.gguf"
    [ "$ty" = bf16 ] || [ -f "$f" ] || "$BIN/merlin" quantize -q "$MODEL_DIR/macbook-bf16.gguf" "$f" "$ty" >/dev/null 2>&1
    run_settings "$f" "macbook $ty"
    [ "$ty" = bf16 ] || keep || rm -f "$f"
  done
  keep || rm -f "$MODEL_DIR/macbook-bf16.gguf"
fi
