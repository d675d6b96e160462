#!/usr/bin/env bash
# Where one kernel's instructions go, per SASS instruction, on the GPU machine (docs/GPU.md, "Benchmarks"):
# runs `merlin bench` eagerly (MERLIN_CUDA_GRAPHS=0) on the `base` model under Nsight Compute with the
# SourceCounters section for one launch of the kernels whose demangled name matches KERNEL_REGEX, and prints
# the executed warp instructions and stall samples by opcode and the busiest instructions with their
# neighbours (bench/ncu_sass_summary.py). Clocks are not locked: read counts and proportions, not times.
#
#   scripts/gpu_sass.sh BIN_DIR KERNEL_REGEX [BATCH]      (e.g. 'mm_kernel<2, 4, .*, 2>' : base's q4_0 head)
#
# TYPE (default q4_0): base's weight type, built into MODEL_DIR as gpu_profile.sh does; MODEL: another model
# file instead. MERLIN (default merlin): the binary in BIN_DIR (e.g. a second build for an A/B). SKIP
# (default 20): matching launches skipped first. SETTINGS: extra environment. TAG: names the results,
# $OUT/sass-<tag>.ncu-rep and .csv.
set -u
BIN=$(realpath "${1:-build-gpu}")
RE=${2:?usage: gpu_sass.sh BIN_DIR KERNEL_REGEX [BATCH]}
B=${3:-32}
source "$(dirname "$0")/gpu_env.sh"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
TYPE=${TYPE:-q4_0}
M=${MODEL:-$MODEL_DIR/base-$TYPE.gguf}
[ -n "${MODEL:-}" ] || [ -f "$MODEL_DIR/base-f32.gguf" ] || "$BIN/${MERLIN:-merlin}" init --preset base --type f32 -o "$MODEL_DIR/base-f32.gguf" >/dev/null
[ -f "$M" ] || "$BIN/${MERLIN:-merlin}" quantize -q "$MODEL_DIR/base-f32.gguf" "$M" "$TYPE" >/dev/null
tag=${TAG:-$(echo "$RE" | tr -c 'A-Za-z0-9' '_' | cut -c1-40)-x$B}
rep="$OUT/sass-$tag"
env ${SETTINGS:-} MERLIN_CUDA_GRAPHS=0 timeout 300 "$NCU" --clock-control none --kernel-name-base demangled \
  --kernel-name "regex:$RE" --launch-skip "${SKIP:-20}" --launch-count 1 \
  --section SourceCounters --section InstructionStats --section WarpStateStats --section LaunchStats \
  --import-source no -f -o "$rep" \
  "$BIN/${MERLIN:-merlin}" bench -m "$M" --device cuda -p 0 -n 16 -r 1 --decode-batches "$B" >"$rep.log" 2>&1
[ -f "$rep.ncu-rep" ] || { echo "gpu_sass: no report (see $rep.log)"; tail -5 "$rep.log"; exit 1; }
"$NCU" -i "$rep.ncu-rep" --page details --print-units base 2>&1 | grep -E 'mm_kernel|Executed Instructions |Issued Warp|Registers Per|Block Limit|Warp Cycles Per Issued|Grid Size' | head -20
"$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.csv" 2>"$rep.err" || { cat "$rep.err"; exit 1; }
python3 "$(dirname "$0")/../bench/ncu_sass_summary.py" "$rep.csv"
