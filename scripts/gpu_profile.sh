#!/usr/bin/env bash
# Per-kernel GPU time of decode steps on the GPU machine (docs/GPU.md): runs `merlin bench` eagerly
# (MERLIN_CUDA_GRAPHS=0) under Nsight Compute's gpu__time_duration metric and sums the time per kernel name.
# Kernels are replayed one at a time with clocks not locked, so absolute times are inflated and nothing
# overlaps (no programmatic dependent launch): read the proportions, not the microseconds.
#
#   scripts/gpu_profile.sh [BIN_DIR]
#
# TYPE (default q4_0): the `base` model's weight type, built with `merlin init` + `merlin quantize` into
# MODEL_DIR (default /tmp/merlin-models) unless there. BATCHES (default "1 32"): decode batch sizes, one
# profile each. SETTINGS: extra environment for every run (e.g. "MERLIN_CUDA_ROPE_FUSE=0"). SKIP / COUNT:
# kernels skipped (warm-up) and profiled per run (defaults 1500 / 560: about 5 decode steps of `base`).
# GRID=1 keys the sum by kernel name and grid size (e.g. the head apart from the other products).
# Results: $OUT (default ./gpu-results)/profile-x<batch>.csv and the summary on stdout.
set -u
BIN=$(realpath "${1:-build-gpu}")
source "$(dirname "$0")/gpu_env.sh"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
TYPE=${TYPE:-q4_0}
M="$MODEL_DIR/base-$TYPE.gguf"
[ -f "$MODEL_DIR/base-f32.gguf" ] || "$BIN/merlin" init --preset base --type f32 -o "$MODEL_DIR/base-f32.gguf" >/dev/null
[ -f "$M" ] || "$BIN/merlin" quantize -q "$MODEL_DIR/base-f32.gguf" "$M" "$TYPE" >/dev/null

summarize() {  # summarize CSV STEPS: time per kernel name, largest first
  python3 - "$1" "${GRID:-0}" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if len(rows) < 2:
    print("no kernels profiled"); sys.exit()
hdr = rows[0]
ki, ui, vi = hdr.index("Kernel Name"), hdr.index("Metric Unit"), hdr.index("Metric Value")
gi = hdr.index("Grid Size") if sys.argv[2] == "1" and "Grid Size" in hdr else -1
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
tot, cnt = collections.defaultdict(float), collections.Counter()
for r in rows[1:]:
    us = float(r[vi].replace(",", "")) * scale[r[ui]]
    name = r[ki][:100] if gi < 0 else f"{r[ki][:80]} grid {r[gi]}"
    tot[name] += us
    cnt[name] += 1
total = sum(tot.values())
for name, us in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{us:10.1f} us {cnt[name]:5d} x {us / cnt[name]:7.2f} us {100 * us / total:5.1f} %  {name}")
print(f"total {total:.1f} us over {sum(cnt.values())} kernels")
PY
}

for b in ${BATCHES:-1 32}; do
  csv="$OUT/profile-x$b.csv"
  env ${SETTINGS:-} MERLIN_CUDA_GRAPHS=0 timeout 300 "$NCU" --clock-control none --metrics gpu__time_duration.sum \
    --csv --launch-skip "${SKIP:-1500}" --launch-count "${COUNT:-560}" \
    "$BIN/merlin" bench -m "$M" --device cuda -p 0 -n 16 -r 1 --decode-batches "$b" >"$csv" 2>"$OUT/profile-x$b.err"
  echo "== base $TYPE, decode batch $b ${SETTINGS:-}"
  summarize "$csv"
done
