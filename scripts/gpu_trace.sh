#!/usr/bin/env bash
# Kernel timeline of decode steps on the GPU machine (docs/GPU.md, "Timelines"): runs `merlin bench` with
# bench/cuda_trace.cpp preloaded (CUPTI activity records of every kernel and copy, graph nodes included) and
# prints bench/cuda_trace_summary.py's charge per kernel and per position of a step. Nsight Systems is not
# on the GPU machine; this is its stand-in. CUPTI's timestamps slow each kernel boundary (base q4_0 one token
# per launch ~25 % slower, 32 tokens ~10 %) and the first kernel after a graph's start looks delayed by tens
# of microseconds: read the charges of the kernels inside a step, not the step's span.
#
#   scripts/gpu_trace.sh [BIN_DIR] MODEL [BATCH ...]     (default batches: 1 32)
#
# BIN_DIR holds merlin and libmerlin_cuda_trace.so (build/lib's); libcupti.so.13 comes from the CUDA toolkit
# or BIN_DIR/lib. SETTINGS: extra environment for the runs; N_GEN: tokens per run (default 64). Decode loops
# are off (MERLIN_CUDA_CHAIN=0) so that every step is one graph launch, split at its ids' device-to-host copy.
# Traces: $OUT/trace-x<batch>.csv.
set -u
BIN=$(realpath "${1:-build-gpu}")
MODEL=${2:?usage: gpu_trace.sh BIN_DIR MODEL [BATCH ...]}
shift 2
source "$(dirname "$0")/gpu_env.sh"
TRACE_LIB=$(ls "$BIN/libmerlin_cuda_trace.so" "$BIN/lib/libmerlin_cuda_trace.so" 2>/dev/null | head -n 1)
[ -n "$TRACE_LIB" ] || { echo "no libmerlin_cuda_trace.so in $BIN"; exit 1; }
if ! ldconfig -p 2>/dev/null | grep -q 'libcupti\.so\.13' && [ ! -f "$BIN/lib/libcupti.so.13" ]; then
  cupti=$(find /usr/local/cuda*/ /opt -name 'libcupti.so.13' 2>/dev/null | head -n 1)
  [ -n "$cupti" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$cupti")"
fi
for b in "${@:-1 32}"; do
  for bb in $b; do
    csv="$OUT/trace-x$bb.csv"
    env ${SETTINGS:-} MERLIN_CUDA_CHAIN=0 MERLIN_TRACE="$csv" LD_PRELOAD="$TRACE_LIB" "$BIN/merlin" bench --device cuda \
      -p 0 -n "${N_GEN:-64}" -r 1 --decode-batches "$bb" -m "$MODEL" 2>&1 | grep -E "cuda_trace|tg[0-9]"
    echo "== $(basename "$MODEL"), decode batch $bb ${SETTINGS:-}"
    python3 "$(dirname "$0")/../bench/cuda_trace_summary.py" "$csv" --positions
  done
done
