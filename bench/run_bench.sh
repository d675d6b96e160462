#!/usr/bin/env bash
# Median of N `merlin run` invocations: prompt t/s, generation t/s and peak RSS, with and without the KV cache.
# Usage: [KV_TYPE=f16|f32|q8_0] bench/run_bench.sh [MODEL.gguf] [runs=5] [threads=2] [n_gen=128]
# Without MODEL it writes a random `base` F32 model into a temp dir first. Unsets OPENBLAS_CORETYPE for the
# benchmarked commands only.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
merlin=${MERLIN_BIN:-$root/build/bin/merlin}
model=${1:-}
runs=${2:-5}
threads=${3:-2}
ngen=${4:-128}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -z "$model" ]; then
  model=$tmp/base-f32.gguf
  "$merlin" init --preset base --seed 1 -o "$model" 2>/dev/null
fi
prompt="Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends and her dog."

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

bench_mode() {  # $1 = label, rest = extra flags
  local label=$1; shift
  : >"$tmp/pp"; : >"$tmp/tg"; : >"$tmp/rss"
  for _ in $(seq "$runs"); do
    line=$(env -u OPENBLAS_CORETYPE "$merlin" run -m "$model" -p "$prompt" -n "$ngen" --temp 0 --ignore-eos \
           -t "$threads" --kv-type "${KV_TYPE:-f16}" "$@" 2>&1 >/dev/null | grep '^\[merlin\]')
    echo "$line" | sed -E 's/.*prompt: [0-9]+ tokens, ([0-9.]+) t\/s.*/\1/' >>"$tmp/pp"
    echo "$line" | sed -E 's/.*generation: [0-9]+ tokens, ([0-9.]+) t\/s.*/\1/' >>"$tmp/tg"
    echo "$line" | sed -E 's/.*peak RSS: ([0-9.]+ [KMG]iB).*/\1/' >>"$tmp/rss"
  done
  printf '| %-22s | %8s | %8s | %s |\n' "$label" "$(median <"$tmp/pp")" "$(median <"$tmp/tg")" "$(sort -g "$tmp/rss" | tail -1)"
}

echo "model: $model, $threads threads, $ngen generated tokens, median of $runs runs, $(date -u +%F) commit $(git -C "$root" rev-parse --short HEAD)"
printf '| %-22s | %8s | %8s | %s |\n' "mode" "pp t/s" "tg t/s" "peak RSS (max)"
printf '|%s|%s|%s|%s|\n' "------------------------" "----------" "----------" "------"
bench_mode "KV cache"
bench_mode "no KV cache" --no-kv-cache
