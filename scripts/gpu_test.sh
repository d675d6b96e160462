#!/usr/bin/env bash
# GPU tests, compute-sanitizer and CUDA benchmarks in one go, for the GPU machine (docs/GPU.md).
#
#   scripts/gpu_test.sh [BIN_DIR] [STAGES]
#
# BIN_DIR holds merlin, cuda_kernels_test, cuda_matvec1_test, cuda_matvec_few_test, cuda_sample_test, cuda_gemm_test and cuda_backend_test (and gpt2/ with encoder.json + vocab.bpe for
# `merlin init`; cuda_matvec for the matvec stage); default build-gpu. STAGES: comma-separated subset of
# tests,sanitize,serve,serve-load,sample,matvec,bench-base,bench-big (default tests,sanitize,serve,bench-base). `sample`
# times `merlin run` on the default model: greedy, and sampled with rows cut into slices and with one CTA per row. `matvec` times
# the matrix products alone on one 16384 x 4096 and one 4096 x 16384 matrix per weight type (matvec.md). `serve` starts `merlin serve --device cuda` on a loopback port and sends
# one completion and one streaming chat request. Results go to $OUT (default ./gpu-results): tests.log, sanitize.log,
# bench-*.md/json. BIG_PRESETS (default "iphone macbook") and BIG_TYPES (default "bf16 q8_0 q4_0 q4_k mxfp4 tq2_0")
# choose what bench-big builds; models are written to $MODEL_DIR (default /tmp/merlin-models) one at a time.
set -u
BIN=$(realpath "${1:-build-gpu}")
STAGES=",${2:-tests,sanitize,serve,bench-base},"
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
source "$(dirname "$0")/gpu_env.sh"
status=0
has() { [[ $STAGES == *",$1,"* ]]; }
log() { echo "[gpu_test] $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

if has tests; then
  for t in "$BIN"/cuda_kernels_test "$BIN"/cuda_matvec1_test "$BIN"/cuda_matvec_few_test "$BIN"/cuda_sample_test "$BIN"/cuda_gemm_test "$BIN"/cuda_attention_test "$BIN"/cuda_backend_test; do
    if "$t" --gtest_brief=1 >>"$OUT/tests.log" 2>&1; then log "PASS $(basename "$t")"; else log "FAIL $(basename "$t")"; status=1; fi
  done
  # The batched RMSNorm fold is on by default: the backend's parity and paged tests once more with it off.
  if MERLIN_CUDA_NORM_FOLD_MM=0 "$BIN"/cuda_backend_test --gtest_brief=1 --gtest_filter='CudaBackend.Logits*:CudaBackend.Paged*:CudaBackend.Greedy*' \
      >>"$OUT/tests.log" 2>&1; then log "PASS cuda_backend_test (MERLIN_CUDA_NORM_FOLD_MM=0)"; else log "FAIL cuda_backend_test (MERLIN_CUDA_NORM_FOLD_MM=0)"; status=1; fi
  # Steps of 2-3 tokens of the large models take the single-token kernels' multi-token instances
  # (matvec_few_pays), which the test models' short rows never do: the backend's subsets once more with them
  # in every 2-4-token step where they fit.
  if MERLIN_CUDA_FEW=1 "$BIN"/cuda_backend_test --gtest_brief=1 \
      --gtest_filter='CudaBackend.Logits*:CudaBackend.Paged*:CudaBackend.Greedy*:CudaBackend.Graph*:CudaBackend.Decode*' \
      >>"$OUT/tests.log" 2>&1; then log "PASS cuda_backend_test (MERLIN_CUDA_FEW=1)"; else log "FAIL cuda_backend_test (MERLIN_CUDA_FEW=1)"; status=1; fi
  # The test models' short FFN rows (768) have the down product compute SwiGLU while staging; rows over 4,096
  # (iphone's) get the separate SwiGLU kernel instead: that path for the Q8_0-reading formats too; with it the
  # gate/up products take the SwiGLU epilogue, so the single-token instance families are compared on it as well.
  if MERLIN_CUDA_GLU_STAGE=0 "$BIN"/cuda_backend_test --gtest_brief=1 --gtest_filter='CudaBackend.Logits*:CudaBackend.Greedy*:CudaBackend.Decode*:CudaBackend.SingleToken*' \
      >>"$OUT/tests.log" 2>&1; then log "PASS cuda_backend_test (MERLIN_CUDA_GLU_STAGE=0)"; else log "FAIL cuda_backend_test (MERLIN_CUDA_GLU_STAGE=0)"; status=1; fi
  # The batched SwiGLU epilogue runs by default only in steps of 17+ tokens over short rows: the backend's
  # parity, paged, graph and decode subsets once more with it in every batched step where it fits.
  if MERLIN_CUDA_GLU_MM=1 "$BIN"/cuda_backend_test --gtest_brief=1 \
      --gtest_filter='CudaBackend.Logits*:CudaBackend.Paged*:CudaBackend.Greedy*:CudaBackend.Graph*:CudaBackend.Decode*' \
      >>"$OUT/tests.log" 2>&1; then log "PASS cuda_backend_test (MERLIN_CUDA_GLU_MM=1)"; else log "FAIL cuda_backend_test (MERLIN_CUDA_GLU_MM=1)"; status=1; fi
  # Q8_0 / Q4_0 products of 17+ tokens read half activations by default (the H kernels): the same subsets
  # once more on the int8 kernels everywhere.
  if MERLIN_CUDA_HALF_MM=0 "$BIN"/cuda_backend_test --gtest_brief=1 \
      --gtest_filter='CudaBackend.Logits*:CudaBackend.Paged*:CudaBackend.Greedy*:CudaBackend.Graph*:CudaBackend.Decode*' \
      >>"$OUT/tests.log" 2>&1; then log "PASS cuda_backend_test (MERLIN_CUDA_HALF_MM=0)"; else log "FAIL cuda_backend_test (MERLIN_CUDA_HALF_MM=0)"; status=1; fi
  # The test models' QKV products are too small for the H kernels, so their down products never write the
  # half-plane RMSNorm fold (Fold::Half, base's 32-token steps): the same subsets with every 17+-token
  # product on the H kernels, which makes the paged batch's down products take it.
  if MERLIN_CUDA_HALF_MM=2 "$BIN"/cuda_backend_test --gtest_brief=1 \
      --gtest_filter='CudaBackend.Logits*:CudaBackend.Paged*:CudaBackend.Greedy*:CudaBackend.Graph*:CudaBackend.Decode*' \
      >>"$OUT/tests.log" 2>&1; then log "PASS cuda_backend_test (MERLIN_CUDA_HALF_MM=2)"; else log "FAIL cuda_backend_test (MERLIN_CUDA_HALF_MM=2)"; status=1; fi
  grep -E "^\[ (logits|default|gemm|flash) \]|FAILED|Failure|error" "$OUT/tests.log" | head -60
fi

if has sanitize; then
  # memcheck over the kernel tests and the backend's graph / paged paths (the slow whole-model parity tests
  # run the same kernels and are left out to keep the run short).
  for spec in "cuda_kernels_test:CudaKernels.*" "cuda_matvec1_test:CudaMatvec1.*:CudaMatmulNorm.*:CudaMatmulSwiGlu.*:CudaMatmulHalf.*" "cuda_matvec_few_test:CudaMatvecFew.*" "cuda_sample_test:CudaSample.*" "cuda_gemm_test:CudaGemm.*" "cuda_attention_test:CudaFlash*:CudaAttention.Q8*" "cuda_backend_test:CudaBackend.GraphReplay*:CudaBackend.Paged*:CudaBackend.GreedyIds*:CudaBackend.SampledIds*:CudaBackend.DecodeGreedy*:CudaBackend.DecodeSample*"; do
    bin=${spec%%:*}; filter=${spec#*:}
    if "$SAN" --tool memcheck --error-exitcode 3 "$BIN/$bin" --gtest_brief=1 --gtest_filter="$filter" \
        >>"$OUT/sanitize.log" 2>&1; then log "memcheck clean: $bin ($filter)"; else log "memcheck FAILED: $bin"; status=1; fi
  done
  grep -E "ERROR SUMMARY" "$OUT/sanitize.log"
fi

# One completion and one streaming chat request against `merlin serve --device cuda`; prints what failed.
serve_smoke() {
  local port=${SERVE_PORT:-18089}
  "$BIN/merlin" serve -m models/merlin-default.gguf --device "${SERVE_DEVICE:-cuda}" --host 127.0.0.1 --port "$port" --parallel 4 \
    >"$OUT/serve.log" 2>&1 &
  local pid=$!
  python3 - "$port" <<'PY' >>"$OUT/serve.log" 2>&1
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120).read().decode()
for _ in range(240):  # the model loads and the weights upload first
    try:
        urllib.request.urlopen(base + "/health", timeout=2); break
    except Exception:
        time.sleep(0.5)
c = json.loads(post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}))
text = c["choices"][0]["text"]
assert c["usage"]["completion_tokens"] > 0 and text, c
print("[serve] completion:", repr(text))
s = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24,
                                   "stream": True})
chunks = [json.loads(l[6:]) for l in s.splitlines() if l.startswith("data: ") and l != "data: [DONE]"]
assert s.rstrip().endswith("data: [DONE]") and chunks, s[:500]
print("[serve] stream:", len(chunks), "chunks:", repr("".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)))
PY
  local rc=$?
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  return $rc
}

bench() {  # bench MODEL_FILE LABEL
  "$BIN/merlin" bench -m "$1" --device cuda -p 512 -n 128 -r 3 --decode-batches 1,32 -o json \
    >"$OUT/bench-$2.json" 2>>"$OUT/bench.log" || { log "bench FAILED: $2"; status=1; return; }
  python3 - "$OUT/bench-$2.json" "$2" <<'PY' | tee -a "$OUT/bench.md"
import json, sys
m = json.load(open(sys.argv[1]))[0]
for t in m["tests"]:
    roof = t["roofline_ts"]
    frac = f'{100 * t["median_ts"] / roof:.0f} %' if roof else "-"
    print(f'| {sys.argv[2]} | {m["type"]} | {t["test"]} | {t["median_ts"]:.1f} | {roof:.0f} | {frac} | {m["gpu_memory_bytes"] / 2**30:.2f} GiB | {m["copy_gbps"]:.0f} |')
PY
}

if has serve; then
  if serve_smoke; then log "PASS serve --device cuda (completion + streaming chat)"; else log "FAIL serve --device cuda (see serve.log)"; status=1; fi
  grep "^\[serve\]" "$OUT/serve.log"
fi

# Aggregate tokens/s of `merlin serve --device cuda` on `base` Q4_0 at 1, 4, 16 and 32 clients (BIN/serve_load,
# bench/serve_load.cpp; scripts/gpu_serve_load.py where it was not built, whose Python client tops out near 10k
# tok/s; 128 tokens per request): greedy, then temperature 1 without and with top-k / top-p / min-p and with top-p alone, sampled on the
# device and, for comparison, on the host (MERLIN_SERVE_BACKEND_SAMPLING=0: the logits rows come back).
serve_load() {
  local port=${SERVE_PORT:-18090} model="$MODEL_DIR/base-q4_0.gguf"
  [ -f "$model" ] || { "$BIN/merlin" init --preset base --type f32 -o "$MODEL_DIR/base-f32.gguf" &&
    "$BIN/merlin" quantize -q "$MODEL_DIR/base-f32.gguf" "$model" q4_0 && rm -f "$MODEL_DIR/base-f32.gguf"; } \
    >>"$OUT/serve-load.log" 2>&1
  for setting in "" MERLIN_SERVE_BACKEND_SAMPLING=0; do
    env $setting "$BIN/merlin" serve -m "$model" --device cuda --port "$port" --parallel 32 >>"$OUT/serve-load.log" 2>&1 &
    local pid=$!
    python3 -c "import time,urllib.request as u
for _ in range(240):
    try: u.urlopen('http://127.0.0.1:$port/health', timeout=2); break
    except Exception: time.sleep(0.5)"
    for sampling in "-t 0" "-t 1" "-t 1 --top-k 40 --top-p 0.95 --min-p 0.05" "-t 1 --top-p 0.9"; do
      [ "$sampling" = "-t 0" ] && [ -n "$setting" ] && continue
      for c in 1 4 16 32; do
        if [ -x "$BIN/serve_load" ]; then
          out=$("$BIN/serve_load" "http://127.0.0.1:$port" -c "$c" -r $((c < 8 ? 16 : 4 * c)) -n 128 $sampling)
        else
          out=$(python3 "$(dirname "$0")/gpu_serve_load.py" "http://127.0.0.1:$port" -c "$c" -r $((c < 8 ? 16 : 4 * c)) \
            -n 128 $sampling)
        fi
        echo "${setting:-defaults} $out" | tee -a "$OUT/serve-load.md"
      done
    done
    kill "$pid"; wait "$pid" 2>/dev/null
  done
}
if has serve-load; then serve_load; fi

# `merlin run` generation tok/s on the default model (512 tokens, 3 runs each): greedy, default sampling
# (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), temperature 1 unfiltered, and top-p 0.9 alone; the
# sampled ones with sample_rows' slices (default) and with one CTA per row (MERLIN_CUDA_SAMPLE_SPLIT=0).
run_sample() {
  local args="-m models/merlin-default.gguf --device cuda -p 'Once upon a time' -n 512 --ignore-eos --seed 7"
  for case in "greedy|--temp 0|" "default sampling||" "temperature 1|--temp 1 --top-k 0 --top-p 1 --min-p 0|" \
              "top-p 0.9|--temp 1 --top-k 0 --top-p 0.9 --min-p 0|" "default sampling, one CTA per row||MERLIN_CUDA_SAMPLE_SPLIT=0" \
              "temperature 1, one CTA per row|--temp 1 --top-k 0 --top-p 1 --min-p 0|MERLIN_CUDA_SAMPLE_SPLIT=0" \
              "top-p 0.9, one CTA per row|--temp 1 --top-k 0 --top-p 0.9 --min-p 0|MERLIN_CUDA_SAMPLE_SPLIT=0"; do
    IFS='|' read -r name extra setting <<<"$case"
    local rates=""
    for rep in 1 2 3; do
      rates="$rates $(eval env $setting "$BIN/merlin" run $args $extra 2>&1 >/dev/null | grep -oE 'generation: [0-9]+ tokens, [0-9.]+' | grep -oE '[0-9.]+$')"
    done
    echo "| $name | $rates |" | tee -a "$OUT/sample.md"
  done
}
if has sample; then run_sample; fi

if has matvec; then
  "$BIN/cuda_matvec" | tee "$OUT/matvec.md" || { log "matvec FAILED"; status=1; }
fi

if has bench-base; then
  echo "| model | type | test | t/s (median) | roofline t/s | of roofline | GPU memory | copy GB/s |" >>"$OUT/bench.md"
  bench models/merlin-default.gguf default-f16
  "$BIN/merlin" init --preset base --type f32 -o "$MODEL_DIR/base-f32.gguf" >>"$OUT/bench.log" 2>&1
  for ty in f16 bf16 q8_0 q4_0 q4_k mxfp4 tq2_0; do
    "$BIN/merlin" quantize -q "$MODEL_DIR/base-f32.gguf" "$MODEL_DIR/base-$ty.gguf" "$ty" >>"$OUT/bench.log" 2>&1
    bench "$MODEL_DIR/base-$ty.gguf" "base-$ty"
    rm -f "$MODEL_DIR/base-$ty.gguf"
  done
  rm -f "$MODEL_DIR/base-f32.gguf"
fi

if has bench-big; then
  for preset in ${BIG_PRESETS:-iphone macbook}; do
    # bf16 straight from init (an f32 macbook would be 29 GB), then each type quantized from it in turn.
    "$BIN/merlin" init --preset "$preset" --type bf16 -o "$MODEL_DIR/$preset-bf16.gguf" >>"$OUT/bench.log" 2>&1
    for ty in ${BIG_TYPES:-bf16 q8_0 q4_0 q4_k mxfp4 tq2_0}; do
      f="$MODEL_DIR/$preset-$ty.gguf"
      [ "$ty" = bf16 ] || "$BIN/merlin" quantize -q "$MODEL_DIR/$preset-bf16.gguf" "$f" "$ty" >>"$OUT/bench.log" 2>&1
      bench "$f" "$preset-$ty"
      [ "$ty" = bf16 ] || rm -f "$f"
    done
    rm -f "$MODEL_DIR/$preset-bf16.gguf"
  done
fi
log "exit status $status"
exit $status
