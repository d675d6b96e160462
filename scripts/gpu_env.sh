# Sourced by scripts/gpu_test.sh and scripts/gpu_perf.sh on the GPU machine: makes libcublas.so.13 (opened with
# dlopen for prefill GEMMs, src/kernels/cuda/gemm.cu) findable when the loader's cache does not list it, from
# the CUDA toolkit or the nvidia-cublas Python wheel.
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
