#!/usr/bin/env bash
# Quick performance probe for the GPU machine (docs/GPU.md): both GPU test binaries, the matrix-product
# microbenchmark (bench/cuda_matvec.cpp), and decode/prefill benchmarks of `base` q4_0 with programmatic
# dependent launch on and off, plus `macbook` q4_0 when MACBOOK=1. Cheaper than scripts/gpu_test.sh; use it
# to check a kernel change before the full run.
#
#   scripts/gpu_perf.sh [BIN_DIR]        (BIN_DIR as for gpu_test.sh, plus cuda_matvec)
set -u
BIN=$(realpath "${1:-build-gpu}")
OUT=${OUT:-$PWD/gpu-results}
MODEL_DIR=${MODEL_DIR:-/tmp/merlin-models}
export MERLIN_VOCAB_DIR=${MERLIN_VOCAB_DIR:-$BIN/gpt2}
export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p "$OUT" "$MODEL_DIR"
for t in cuda_kernels_test cuda_backend_test; do
  "$BIN/$t" --gtest_brief=1 >>"$OUT/tests.log" 2>&1 && echo "PASS $t" || echo "FAIL $t"
done
grep -E "FAILED|Failure|^\[ logits" "$OUT/tests.log" | head -30
"$BIN/cuda_matvec" | tee "$OUT/matvec.md"
B="$BIN/merlin bench --device cuda -p 512 -n 128 -r 2 --decode-batches 1,32"
"$BIN/merlin" init --preset base --type f32 -o "$MODEL_DIR/base-f32.gguf" >/dev/null 2>&1
# base q4_0 with the defaults, with the opt-in fused preparation, and without programmatic dependent launch; base f16.
"$BIN/merlin" quantize -q "$MODEL_DIR/base-f32.gguf" "$MODEL_DIR/base-q4_0.gguf" q4_0 >/dev/null 2>&1
"$BIN/merlin" quantize -q "$MODEL_DIR/base-f32.gguf" "$MODEL_DIR/base-f16.gguf" f16 >/dev/null 2>&1
for setting in "" MERLIN_CUDA_FUSE=1 MERLIN_CUDA_PDL=0; do
  echo "== base q4_0 ${setting:-defaults}"
  env $setting $B -m "$MODEL_DIR/base-q4_0.gguf" 2>/dev/null | grep -E "pp512|tg128" | tee -a "$OUT/bench.md"
done
echo "== base f16"
$B -m "$MODEL_DIR/base-f16.gguf" 2>/dev/null | grep -E "pp512|tg128" | tee -a "$OUT/bench.md"
if [ "${MACBOOK:-0}" = 1 ]; then
  "$BIN/merlin" init --preset macbook --type bf16 -o "$MODEL_DIR/macbook-bf16.gguf" >/dev/null 2>&1
  "$BIN/merlin" quantize -q "$MODEL_DIR/macbook-bf16.gguf" "$MODEL_DIR/macbook-q4_0.gguf" q4_0 >/dev/null 2>&1
  rm -f "$MODEL_DIR/macbook-bf16.gguf"
  echo "== macbook q4_0"
  "$BIN/merlin" bench --device cuda -p 512 -n 128 -r 2 --decode-batches 1,32 -m "$MODEL_DIR/macbook-q4_0.gguf" \
    2>/dev/null | tee -a "$OUT/bench.md"
fi
