#!/usr/bin/env bash
# Packs the CUDA build's binaries for the GPU machine (docs/GPU.md, "Build"): strips merlin, the six GPU test
# binaries, cuda_matvec (and libmerlin_cuda_trace.so where built) into one folder with gpt2/ (encoder.json,
# vocab.bpe) and lib/ (cpp-httplib and brotli: the GPU machine lacks our build dependencies), and writes one
# xz archive with a large dictionary (the statically linked binaries share most of their bytes). Carry
# PACK_DIR; on the device: mkdir -p build-gpu && tar xJf build-gpupack/bin.tar.xz -C build-gpu.
#
#   scripts/gpu_pack.sh [BUILD_DIR] [PACK_DIR]      (defaults build-cuda, build-gpupack)
#
# NAMES: the build's binaries to pack (default: all of the above). EXTRA: more executables (paths) to pack
# beside them, e.g. a second merlin renamed for an A/B (the tree plus the archive must stay under 64 MiB).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD=$(realpath "${1:-$ROOT/build-cuda}")
PACK=$(realpath -m "${2:-$ROOT/build-gpupack}")
VOCAB=${MERLIN_VOCAB_DIR:-${MERLIN_CACHE:-$HOME/.cache/merlin}/gpt2}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/gpt2" "$stage/lib" "$PACK"
NAMES=${NAMES:-merlin cuda_kernels_test cuda_matvec1_test cuda_matvec_few_test cuda_sample_test cuda_gemm_test cuda_attention_test \
cuda_backend_test cuda_matvec libmerlin_cuda_trace.so}
for name in $NAMES; do
  f=$(find "$BUILD" -name "$name" -type f -perm -u+x 2>/dev/null | head -n 1)
  [ -n "$f" ] && strip -o "$stage/$name" "$f"
done
for f in ${EXTRA:-}; do strip -o "$stage/$(basename "$f")" "$f"; done
[ -f "$stage/merlin" ] || { echo "gpu_pack: no merlin under $BUILD" >&2; exit 1; }
cp "$VOCAB/encoder.json" "$VOCAB/vocab.bpe" "$stage/gpt2/"
for l in libcpp-httplib.so.0.11 libbrotlienc.so.1 libbrotlidec.so.1 libbrotlicommon.so.1; do
  cp -L "/usr/lib/x86_64-linux-gnu/$l" "$stage/lib/"
done
# merlin first and the EXTRA binaries right after it: xz's 64 MiB window then sees the bytes they share.
order=(merlin)
for f in ${EXTRA:-}; do order+=("$(basename "$f")"); done
for f in "$stage"/*; do
  n=$(basename "$f")
  [[ " ${order[*]} " == *" $n "* ]] || order+=("$n")
done
XZ_OPT="-9e -T1" tar -cJf "$PACK/bin.tar.xz.tmp" -C "$stage" "${order[@]}"
mv "$PACK/bin.tar.xz.tmp" "$PACK/bin.tar.xz"
ls -l "$PACK/bin.tar.xz" | awk '{printf "gpu_pack: %s (%.1f MB)\n", $NF, $5 / 1e6}'
