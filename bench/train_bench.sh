#!/usr/bin/env bash
# Training throughput: `merlin train` vs the same model, batch and step in PyTorch (tests/train/torch_train.py),
# both on THREADS threads (default 2), for the sanity and experiment presets.
#
#   bash bench/train_bench.sh [BUILD_DIR]          (default: build)
#
# Environment: MERLIN_DATA (shared data: TinyStories text + GPT-2 vocabulary), THREADS, PRESETS
# ("sanity experiment"), STEPS_sanity / STEPS_experiment, BATCH_<preset>, SEQ_<preset>, REPEAT (default 1:
# run each side that many times, alternating, and keep the best, which on a shared machine is the run least
# disturbed by other work).
# tokens/s is the median over the timed steps (the first step, which pages everything in, is left out);
# it counts input tokens (batch x seq) per optimizer step, forward + backward + clipping + AdamW.
# Both runs use `env -u OPENBLAS_CORETYPE` so neither inherits a CPU-type override meant for other tools.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
MERLIN="$BUILD/bin/merlin"
DATA="${MERLIN_DATA:-$ROOT/../shared/data}"
THREADS="${THREADS:-2}"
REPEAT="${REPEAT:-1}"
PRESETS="${PRESETS:-sanity experiment}"
PY=/usr/bin/python3
STEPS_sanity="${STEPS_sanity:-20}" BATCH_sanity="${BATCH_sanity:-8}" SEQ_sanity="${SEQ_sanity:-64}"
STEPS_experiment="${STEPS_experiment:-6}" BATCH_experiment="${BATCH_experiment:-8}" SEQ_experiment="${SEQ_experiment:-256}"

[[ -x "$MERLIN" ]] || { echo "error: $MERLIN not built (ninja -C $BUILD merlin)" >&2; exit 1; }
[[ -f "$DATA/tokenizer/gpt2/vocab.bpe" ]] || { echo "error: no GPT-2 vocabulary under $DATA" >&2; exit 1; }
WORK="$(mktemp -d /tmp/merlin-train-bench-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

"$MERLIN" prepare -i "$DATA/text/tinystories/TinyStories-train.head2MiB.txt" -o "$WORK/data" --val-fraction 0 \
  --vocab-dir "$DATA/tokenizer/gpt2" -q 2>/dev/null

have_torch=0
"$PY" -c "import torch" 2>/dev/null && have_torch=1

median_tokens_per_s() {  # metrics.jsonl -> median tokens_per_s over steps >= 2
  "$PY" -c '
import json, statistics, sys
v = [j["tokens_per_s"] for j in map(json.loads, open(sys.argv[1])) if "tokens_per_s" in j and j["step"] >= 2]
print("%.0f" % statistics.median(v))' "$1"
}

echo "# $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg), $THREADS threads, $(date -u +%Y-%m-%dT%H:%MZ)"
printf '%-11s %6s %5s %6s %14s %14s %8s\n' preset batch seq steps merlin_tok/s torch_tok/s ratio
best() { awk -v a="$1" -v b="$2" 'BEGIN { print (b == "-" || a + 0 > b + 0) ? a : b }'; }

for p in $PRESETS; do
  steps_var="STEPS_$p" batch_var="BATCH_$p" seq_var="SEQ_$p"
  steps="${!steps_var}" batch="${!batch_var}" seq="${!seq_var}"
  ours="-" theirs="-" ratio="-"
  for ((r = 0; r < REPEAT; ++r)); do
    rm -rf "$WORK/run-$p"
    env -u OPENBLAS_CORETYPE "$MERLIN" train --preset "$p" --data "$WORK/data" --out "$WORK/run-$p" --steps "$steps" \
      --batch "$batch" --seq "$seq" --eval-every 0 --ckpt-every 0 -t "$THREADS" -q
    ours="$(best "$(median_tokens_per_s "$WORK/run-$p/metrics.jsonl")" "$ours")"
    if [[ $have_torch == 1 ]]; then
      t="$(env -u OPENBLAS_CORETYPE "$PY" "$ROOT/tests/train/torch_train.py" --preset "$p" \
        --data "$WORK/data/train-00000.tok" --batch "$batch" --seq "$seq" --steps "$steps" --threads "$THREADS" |
        "$PY" -c 'import json, sys; print("%.0f" % json.load(sys.stdin)["tokens_per_s"])')"
      theirs="$(best "$t" "$theirs")"
    fi
  done
  [[ "$theirs" != "-" ]] && ratio="$(awk -v a="$ours" -v b="$theirs" 'BEGIN { printf "%.2fx", a / b }')"
  printf '%-11s %6s %5s %6s %14s %14s %8s\n' "$p" "$batch" "$seq" "$steps" "$ours" "$theirs" "$ratio"
done
