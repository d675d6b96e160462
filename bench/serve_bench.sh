#!/usr/bin/env bash
# Server throughput: aggregate generated tokens/s and time to first token (p50/p99) of `merlin serve` at
# 1, 4, 16 and 32 concurrent streaming clients (bench/serve_load.mjs), for the default model and for the
# `base` preset at Q4_0 (random weights, written into a temp dir). Not a test; results go to docs/BENCHMARKS.md.
#   bash bench/serve_bench.sh [default|base|all] [max_tokens=128]
# Environment: MERLIN_BIN (default build/bin/merlin), THREADS (default 2), LEVELS (default "1 4 16 32"),
# STREAM (default 1; 0: non-streaming requests, whose TTFT column is then the whole request's time),
# CLIENT (default node: bench/serve_load.mjs; cpp: bench/serve_load.cpp's binary beside MERLIN_BIN, which takes
# less of the two cores the server shares with it: the default model +23-27 % at one client, +10-16 % at 32),
# SERVE_ARGS (extra `merlin serve` options, e.g. "--stream-interval-ms 0").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
merlin=${MERLIN_BIN:-$root/build/bin/merlin}
which=${1:-all}
max_tokens=${2:-128}
threads=${THREADS:-2}
levels=${LEVELS:-1 4 16 32}
stream_flag=""
[[ ${STREAM:-1} == 0 ]] && stream_flag="--no-stream"
command -v node >/dev/null || { echo "serve_bench.sh: node is needed for the load generator" >&2; exit 1; }
tmp=$(mktemp -d)
server_pid=""
cleanup() {
  [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

start_server() {  # start_server MODEL: --port 0, then the port from the startup line, then /health
  # shellcheck disable=SC2086
  env -u OPENBLAS_CORETYPE "$merlin" serve -m "$1" --port 0 --parallel 32 -t "$threads" -q ${SERVE_ARGS:-} \
    2>"$tmp/server.log" &
  server_pid=$!
  for _ in $(seq 1 600); do
    port=$(grep -o 'listening on http://[^:]*:[0-9]*' "$tmp/server.log" | grep -o '[0-9]*$' || true)
    [[ -n $port ]] && break
    sleep 0.05
  done
  [[ -n $port ]] || { cat "$tmp/server.log"; exit 1; }
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 0.05; done
}

stop_server() {
  kill "$server_pid"
  wait "$server_pid" || true
  server_pid=""
}

# load URL ARGS...: one load level through the chosen client, as one JSON line with serve_load.mjs's fields.
load() {
  if [[ ${CLIENT:-node} != cpp ]]; then
    node "$root/bench/serve_load.mjs" "$@"
    return
  fi
  local args=() stream=1
  for a in "$@"; do [[ $a == --no-stream ]] && stream=0 || args+=("$a"); done
  [[ $stream == 1 ]] && args+=(--stream)
  "$(dirname "$merlin")/serve_load" "${args[@]}" -t 0 | node -e '
    const r = JSON.parse(require("fs").readFileSync(0, "utf8")), ms = (s) => +(1000 * (s ?? 0)).toFixed(1);
    console.log(JSON.stringify({clients: r.clients, requests: r.requests, tokens: r.tokens, seconds: +r.seconds.toFixed(2),
      tokens_per_second: +r.tokens_per_s.toFixed(1), ttft_p50_ms: ms(r.ttft_p50_s ?? r.latency_p50_s),
      ttft_p99_ms: ms(r.ttft_p99_s ?? r.latency_p99_s),
      per_request_tokens_per_second_p50: +(r.per_request_tokens_per_s_p50 ?? 0).toFixed(1)}));'
}

bench_model() {  # bench_model LABEL MODEL
  start_server "$2"
  echo
  echo "$1: $(head -n 1 "$tmp/server.log" | sed 's/^merlin serve: //')"
  echo
  echo "| clients | requests | generated tokens | wall s | aggregate tok/s | vs 1 client | TTFT p50 ms | TTFT p99 ms | per-request tok/s p50 |"
  echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
  local base=""
  # One untimed request first: page in the weights, warm the allocator.
  load "http://127.0.0.1:$port" -c 1 -r 1 -n 16 >/dev/null
  for c in $levels; do
    line=$(load "http://127.0.0.1:$port" -c "$c" -n "$max_tokens" $stream_flag)
    tps=$(node -p "JSON.parse(process.argv[1]).tokens_per_second" "$line")
    [[ -z $base ]] && base=$tps
    node -e '
      const r = JSON.parse(process.argv[1]), base = Number(process.argv[2]);
      console.log(`| ${r.clients} | ${r.requests} | ${r.tokens} | ${r.seconds} | ${r.tokens_per_second} | ${(r.tokens_per_second / base).toFixed(2)}x | ${r.ttft_p50_ms} | ${r.ttft_p99_ms} | ${r.per_request_tokens_per_second_p50} |`);
    ' "$line" "$base"
  done
  stop_server
}

echo "merlin serve benchmark, $(date -u '+%F %H:%M UTC'), commit $(git -C "$root" rev-parse --short HEAD), $threads threads, $max_tokens tokens per request (ignore_eos, greedy, $([[ -n $stream_flag ]] && echo non-streaming || echo streaming)), load average $(cut -d' ' -f1-3 /proc/loadavg)"
if [[ $which == default || $which == all ]]; then
  bench_model "models/merlin-default.gguf" "$root/models/merlin-default.gguf"
fi
if [[ $which == base || $which == all ]]; then
  "$merlin" init --preset base --seed 1 -o "$tmp/base-f32.gguf" >/dev/null 2>&1
  "$merlin" quantize "$tmp/base-f32.gguf" "$tmp/base-q4_0.gguf" q4_0 >/dev/null 2>&1
  rm -f "$tmp/base-f32.gguf"
  bench_model "base preset, Q4_0 (random weights)" "$tmp/base-q4_0.gguf"
fi
