#!/usr/bin/env bash
# Interleaved A/B of `merlin serve` throughput: configurations run in turn (A, B, A, B, ...) so that a noisy
# machine disturbs both alike. Each configuration is a merlin binary, optionally followed by environment
# settings and, after " -- ", extra `merlin serve` flags ("build/bin/merlin MERLIN_HEAD_SCREEN=0",
# "build/bin/merlin -- --kv-type q8_0"). Per repetition and configuration it starts the server (--parallel 32
# -t 2), warms it up, and prints aggregate generated tok/s per client count. Not a test.
#   bash bench/serve_ab.sh MODEL "1 32" REPS "BIN_A [VAR=V ...] [-- FLAGS]" "BIN_B ..." ...
# Environment: NTOK (tokens per request, default 128), TEMP (the requests' temperature, default 0: greedy).
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=$1; levels=$2; reps=$3; shift 3
ntok=${NTOK:-128}
temp=${TEMP:-0}
for rep in $(seq 1 "$reps"); do
  for cfg in "$@"; do
    log=$(mktemp)
    flags=""
    head=$cfg
    if [[ $cfg == *" -- "* ]]; then flags=${cfg#* -- }; head=${cfg%% -- *}; fi
    bin=${head%% *}; envs=${head#* }; [[ $envs == "$head" ]] && envs=""
    # shellcheck disable=SC2086
    env -u OPENBLAS_CORETYPE $envs "$bin" serve -m "$model" --port 0 --parallel 32 -t 2 -q $flags 2>"$log" &
    pid=$!
    port=""
    for _ in $(seq 1 600); do
      port=$(grep -o 'listening on http://[^:]*:[0-9]*' "$log" | grep -o '[0-9]*$' || true)
      [[ -n $port ]] && break
      sleep 0.05
    done
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 0.05; done
    node "$root/bench/serve_load.mjs" "http://127.0.0.1:$port" -c 1 -r 1 -n 16 >/dev/null
    out="rep $rep [$cfg]"
    for c in $levels; do
      line=$(node "$root/bench/serve_load.mjs" "http://127.0.0.1:$port" -c "$c" -n "$ntok" -t "$temp")
      out="$out c$c=$(node -p "JSON.parse(process.argv[1]).tokens_per_second" "$line")"
    done
    echo "$out"
    kill "$pid"; wait "$pid" 2>/dev/null; rm -f "$log"
  done
done
