#!/usr/bin/env bash
# `merlin serve` over raw HTTP with curl: the SSE wire format, every error status (400, 401, 404, 405, 413,
# 503 with Retry-After), X-Request-Id, a client that disconnects mid-stream, startup time and SIGTERM.
#   bash tests/serve/http.sh MERLIN_BIN MODEL.gguf
# Exit: 0 pass, 1 fail, 77 skip (no curl, no python3 or no model).
set -uo pipefail
BIN=${1:?usage: http.sh MERLIN_BIN MODEL.gguf}
MODEL=${2:?usage: http.sh MERLIN_BIN MODEL.gguf}
command -v curl >/dev/null || { echo "SKIP: curl not found"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: python3 not found"; exit 77; }
[[ -f $MODEL ]] || { echo "SKIP: $MODEL not found"; exit 77; }

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
FAILS=0
ok() { echo "ok   $1"; }
fail() { echo "FAIL $1${2:+
     $2}"; FAILS=$((FAILS + 1)); }
expect() {  # expect WHAT WANT GOT
  if [[ "$2" == "$3" ]]; then ok "$1"; else fail "$1" "got '$3', want '$2'"; fi
}

# [THREADS=N] start_server NAME ARGS...: runs `merlin serve --port 0 -t N` (default 2), reads the port from its startup line, polls /health.
start_server() {
  local name=$1; shift
  local log="$WORK/$name.log"
  "$BIN" serve -m "$MODEL" --port 0 -t "${THREADS:-2}" "$@" 2>"$log" >/dev/null &
  local pid=$!
  PIDS+=("$pid")
  local port=""
  for _ in $(seq 1 600); do
    port=$(grep -o 'listening on http://[^:]*:[0-9]*' "$log" | grep -o '[0-9]*$')
    [[ -n $port ]] && break
    kill -0 "$pid" 2>/dev/null || { cat "$log"; echo "FAIL server $name did not start"; exit 1; }
    sleep 0.05
  done
  [[ -n $port ]] || { cat "$log"; echo "FAIL server $name: no port"; exit 1; }
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 0.05
  done
  eval "${name}_PORT=$port ${name}_PID=$pid ${name}_LOG=$log"
}

# post URL BODY [curl args...] -> prints the status code; the body goes to $WORK/body, headers to $WORK/headers.
post() {
  local url=$1 body=$2; shift 2
  curl -s -o "$WORK/body" -D "$WORK/headers" -w '%{http_code}' -H 'Content-Type: application/json' --data-binary "$body" "$@" "$url"
}

# The error body must be OpenAI's {"error": {"message", "type", "param", "code"}}; prints "type/param/code".
error_fields() {
  python3 - "$WORK/body" <<'PY'
import json, sys
e = json.load(open(sys.argv[1]))["error"]
assert set(e) == {"message", "type", "param", "code"} and e["message"], e
print(f"{e['type']}/{e['param']}/{e['code']}")
PY
}

metric() {  # metric PORT NAME
  curl -s "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 == n { print $2 }'
}

wait_metric() {  # wait_metric PORT NAME VALUE: up to 5 s
  for _ in $(seq 1 100); do
    [[ "$(metric "$1" "$2")" == "$3" ]] && return 0
    sleep 0.05
  done
  return 1
}

start_server main
U="http://127.0.0.1:$main_PORT"
ready=$(grep -o 'ready in [0-9.]* s' "$main_LOG" | grep -o '[0-9.]*')
if python3 -c "import sys; sys.exit(0 if float('$ready') < 1.0 else 1)"; then ok "starts in $ready s"; else fail "startup took $ready s"; fi
# Many clients connecting at once must not overflow the listen queue (cpp-httplib's own is 5 deep: the
# kernel drops the extra SYNs and those clients wait a second to retry). A listening socket's Send-Q is
# its backlog.
if command -v ss >/dev/null; then
  backlog=$(ss -ltnH "sport = :$main_PORT" | awk '{ print $3; exit }')
  if [[ $backlog =~ ^[0-9]+$ ]] && ((backlog >= 64)); then ok "listen backlog $backlog"; else fail "listen backlog" "got '$backlog', want >= 64"; fi
fi

echo "--- SSE wire format"
curl -sN -D "$WORK/sse_headers" -H 'Content-Type: application/json' \
  -d '{"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}' \
  "$U/v1/completions" > "$WORK/sse"
expect "content type" "text/event-stream" "$(grep -i '^content-type:' "$WORK/sse_headers" | tr -d '\r' | cut -d' ' -f2 | cut -d';' -f1)"
python3 - "$WORK/sse" <<'PY' && ok "completion SSE: data lines, blank-line separated, JSON chunks, usage, [DONE] last" || fail "completion SSE framing" "$(cat "$WORK/sse")"
import json, sys
raw = open(sys.argv[1], "rb").read().decode("utf-8")
assert raw.endswith("data: [DONE]\n\n"), raw[-40:]
events = raw.split("\n\n")[:-1]
assert all(e.startswith("data: ") and "\n" not in e for e in events), events
chunks = [json.loads(e[6:]) for e in events[:-1]]
assert all(c["object"] == "text_completion" for c in chunks)
assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
assert chunks[-2]["choices"][0]["finish_reason"] == "length"
assert len({c["id"] for c in chunks}) == 1
PY
curl -sN -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": true}' "$U/v1/chat/completions" > "$WORK/sse_chat"
python3 - "$WORK/sse_chat" <<'PY' && ok "chat SSE: role chunk first, empty delta with finish_reason last, [DONE]" || fail "chat SSE framing" "$(cat "$WORK/sse_chat")"
import json, sys
raw = open(sys.argv[1]).read()
assert raw.endswith("data: [DONE]\n\n")
chunks = [json.loads(e[6:]) for e in raw.split("\n\n")[:-2]]
assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
assert all(c["object"] == "chat.completion.chunk" for c in chunks)
PY

echo "--- 400"
check_400() {  # check_400 WHAT ENDPOINT BODY WANT_TYPE/PARAM/CODE
  local status
  status=$(post "$U$2" "$3")
  if [[ $status == 400 ]]; then expect "$1: 400 $4" "$4" "$(error_fields)"; else fail "$1" "status $status: $(cat "$WORK/body")"; fi
}
check_400 "malformed JSON" /v1/completions '{"prompt": "x",' "invalid_request_error/None/invalid_json"
check_400 "not an object" /v1/chat/completions '[1, 2]' "invalid_request_error/None/invalid_json"
check_400 "invalid UTF-8" /v1/completions $'{"prompt": "\xff"}' "invalid_request_error/None/invalid_json"
check_400 "wrong type" /v1/completions '{"prompt": "x", "temperature": "hot"}' "invalid_request_error/temperature/invalid_type"
check_400 "wrong type (stream)" /v1/chat/completions '{"messages": [{"role": "user", "content": "x"}], "stream": 1}' "invalid_request_error/stream/invalid_type"
check_400 "missing messages" /v1/chat/completions '{"model": "m"}' "invalid_request_error/messages/missing_required_parameter"
check_400 "missing prompt" /v1/completions '{"model": "m"}' "invalid_request_error/prompt/missing_required_parameter"
check_400 "max_tokens 0" /v1/completions '{"prompt": "x", "max_tokens": 0}' "invalid_request_error/max_tokens/invalid_value"
check_400 "max_tokens beyond the context" /v1/completions '{"prompt": "x", "max_tokens": 100000}' "invalid_request_error/prompt/context_length_exceeded"
long=$(python3 -c 'import json; print(json.dumps({"prompt": " the" * 600}))')
check_400 "prompt longer than the context" /v1/completions "$long" "invalid_request_error/prompt/context_length_exceeded"
check_400 "token id out of range" /v1/completions '{"prompt": [1, 99999999]}' "invalid_request_error/prompt/invalid_value"
check_400 "n out of range" /v1/completions '{"prompt": "x", "n": 0}' "invalid_request_error/n/invalid_value"
check_400 "logit_bias id out of range" /v1/completions '{"prompt": "x", "logit_bias": {"99999999": 5}}' "invalid_request_error/logit_bias/invalid_value"
check_400 "logit_bias value out of range" /v1/chat/completions '{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -101}}' "invalid_request_error/logit_bias/invalid_value"
check_400 "tokenize without content" /tokenize '{}' "invalid_request_error/content/missing_required_parameter"

echo "--- 404, 405, 413, X-Request-Id"
status=$(curl -s -o "$WORK/body" -w '%{http_code}' "$U/v1/nothing")
expect "unknown route: 404" "404" "$status"
expect "unknown route: OpenAI error body" "invalid_request_error/None/unknown_url" "$(error_fields)"
status=$(curl -s -o "$WORK/body" -D "$WORK/headers" -w '%{http_code}' "$U/v1/chat/completions")
expect "GET on a POST route: 405" "405" "$status"
expect "405 names the allowed method" "Allow: POST" "$(grep -i '^allow:' "$WORK/headers" | tr -d '\r')"
status=$(curl -s -o "$WORK/body" -w '%{http_code}' -X POST "$U/health")
expect "POST on a GET route: 405" "405" "$status"
head -c 5000000 /dev/zero | tr '\0' 'a' > "$WORK/big"
status=$(curl -s -o "$WORK/body" -w '%{http_code}' -H 'Content-Type: application/json' --data-binary @"$WORK/big" "$U/v1/completions")
expect "5 MB body: 413" "413" "$status"
expect "413 body" "invalid_request_error/None/request_too_large" "$(error_fields)"
status=$(curl -s -o "$WORK/body" -w '%{http_code}' -H 'Transfer-Encoding: chunked' -H 'Content-Type: application/json' --data-binary @"$WORK/big" "$U/v1/completions")
expect "5 MB chunked body: 413" "413" "$status"
status=$(post "$U/v1/completions" '{"prompt": 1}' -H 'X-Request-Id: abc-123')
expect "X-Request-Id echoed on errors" "X-Request-Id: abc-123" "$(grep -i '^x-request-id:' "$WORK/headers" | tr -d '\r')"
expect "server still healthy after bad input" "200" "$(curl -s -o /dev/null -w '%{http_code}' "$U/health")"

echo "--- a client that disconnects mid-stream"
used0=$(metric "$main_PORT" merlin_kv_blocks_used)
# The client hangs up right after the first event (head exits, curl's next write fails), long before the
# 480 tokens could be generated even on a fast machine, so the server must see the disconnect.
curl -sN -H 'Content-Type: application/json' \
  -d '{"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": true, "stream": true}' "$U/v1/completions" |
  head -n 1 > /dev/null
if wait_metric "$main_PORT" merlin_requests_running 0 && wait_metric "$main_PORT" merlin_kv_blocks_used "$used0"; then
  ok "its sequence is cancelled and its KV blocks freed"
else
  fail "disconnect did not free the sequence" "running $(metric "$main_PORT" merlin_requests_running), used $(metric "$main_PORT" merlin_kv_blocks_used)"
fi
grep -q '| disconnected$' "$main_LOG" && ok "logged as disconnected" || fail "no 'disconnected' log line"

echo "--- 401"
echo "sk-test-key" > "$WORK/key"
start_server auth --api-key-file "$WORK/key"
A="http://127.0.0.1:$auth_PORT"
expect "no key: 401" "401" "$(post "$A/v1/completions" '{"prompt": "x", "max_tokens": 1}')"
expect "401 body" "authentication_error/None/invalid_api_key" "$(error_fields)"
expect "wrong key: 401" "401" "$(post "$A/v1/completions" '{"prompt": "x", "max_tokens": 1}' -H 'Authorization: Bearer nope')"
expect "wrong key on /v1/models: 401" "401" "$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer sk-test-keyX' "$A/v1/models")"
expect "right key: 200" "200" "$(post "$A/v1/completions" '{"prompt": "x", "max_tokens": 1}' -H 'Authorization: Bearer sk-test-key')"
expect "/health needs no key" "200" "$(curl -s -o /dev/null -w '%{http_code}' "$A/health")"

echo "--- 503 when the queue is full"
# One thread and the longest generation the context allows keep the first request running for a second
# or more even on a fast machine, while the checks below take a fraction of that.
THREADS=1 start_server busy --parallel 1 --max-queue 1
B="http://127.0.0.1:$busy_PORT"
long_stream() {
  curl -sN -H 'Content-Type: application/json' \
    -d '{"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": true, "stream": true}' "$B/v1/completions" > /dev/null &
  PIDS+=($!)
}
long_stream
wait_metric "$busy_PORT" merlin_requests_running 1 || fail "first request not running"
long_stream
wait_metric "$busy_PORT" merlin_requests_waiting 1 || fail "second request not queued"
status=$(post "$B/v1/completions" '{"prompt": "x", "max_tokens": 1}')
expect "queue full: 503" "503" "$status"
expect "503 body" "server_error/None/queue_full" "$(error_fields)"
expect "503 has Retry-After" "Retry-After: 1" "$(grep -i '^retry-after:' "$WORK/headers" | tr -d '\r')"
kill "${PIDS[-1]}" "${PIDS[-2]}" 2>/dev/null
if wait_metric "$busy_PORT" merlin_requests_running 0 && wait_metric "$busy_PORT" merlin_requests_waiting 0 &&
   wait_metric "$busy_PORT" merlin_kv_blocks_used 0; then
  ok "both streams cancelled on disconnect, all blocks free"
else
  fail "blocks not freed after disconnect" "$(curl -s "$B/metrics" | grep -E '^merlin_(kv|requests)')"
fi
expect "serves again after the queue drained" "200" "$(post "$B/v1/completions" '{"prompt": "x", "max_tokens": 1}')"

echo "--- SIGTERM"
for name in main auth busy; do
  pid_var=${name}_PID
  kill -TERM "${!pid_var}"
  wait "${!pid_var}"
  expect "$name server exits 0 on SIGTERM" "0" "$?"
done

if (( FAILS )); then
  echo "--- main server log (tail)"; tail -n 30 "$main_LOG"
  echo "$FAILS check(s) failed"; exit 1
fi
echo "all checks passed"
