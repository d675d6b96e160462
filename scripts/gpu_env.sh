# Sourced by the GPU scripts (gpu_test.sh, gpu_perf.sh, gpu_profile.sh) on the GPU machine, with BIN set to the
# binaries' folder. Sets OUT (default ./gpu-results) and MODEL_DIR (default /tmp/merlin-models) and creates
# them, points merlin at BIN/gpt2 for the vocabulary and the loader at BIN/lib (libcpp-httplib and brotli
# travel there: the GPU machine does not have our build dependencies), and makes libcublas.so.13 (opened
# with dlopen for prefill GEMMs, src/kernels/cuda/gemm.cu) findable when the loader's cache does not list
# it, from the CUDA toolkit or the nvidia-cublas Python wheel.
OUT=${OUT:-$PWD/gpu-results}
MODEL_DIR=${MODEL_DIR:-/tmp/merlin-models}
mkdir -p "$OUT" "$MODEL_DIR"
export MERLIN_VOCAB_DIR=${MERLIN_VOCAB_DIR:-$BIN/gpt2}
export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so\.13'; then
  _cublas=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets /usr/lib /opt /usr/local/lib -name 'libcublas.so.13' \
    2>/dev/null | head -n 1)
  if [ -n "$_cublas" ]; then
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(dirname "$_cublas")"
    echo "[gpu_env] cuBLAS from $(dirname "$_cublas")"
  else
    echo "[gpu_env] no libcublas.so.13 found: prefill runs on the tensor-core kernels"
  fi
  unset _cublas
fi
