#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/fuzz_*.cpp) with clang + ASan/UBSan in build-fuzz/ and runs
# each for ${FUZZ_SECONDS:-60} s, two at a time, from a temporary copy of its seed corpus
# (tests/fuzz/corpus/<name>/), so runs never add files to the repository. Fails if any fuzzer finds a crash,
# a leak, UB, a timeout or an out-of-memory; the reproducer is kept in build-fuzz/fuzz-artifacts/.
#
#   bash scripts/run_fuzzers.sh [--build-only] [fuzz_gguf fuzz_tokenizer ...]
#
# Environment: FUZZ_SECONDS (per fuzzer, default 60), FUZZ_PARALLEL (default 2), MERLIN_FUZZ_BUILD_DIR
# (default build-fuzz), MERLIN_DATA (shared data, default ../shared/data beside the checkout; the tokenizer
# fuzzer reads the GPT-2 vocabulary there).
# Reproduce a crash: build-fuzz/fuzz/fuzz_gguf build-fuzz/fuzz-artifacts/fuzz_gguf-crash-...
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${MERLIN_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
SECONDS_EACH="${FUZZ_SECONDS:-60}"
PARALLEL="${FUZZ_PARALLEL:-2}"
JOBS="${MERLIN_JOBS:-$(nproc 2>/dev/null || echo 2)}"

log() { printf '[fuzz] %s\n' "$*"; }
die() { printf '[fuzz] error: %s\n' "$*" >&2; exit 1; }

build_only=0
wanted=()
for a in "$@"; do
  case "$a" in
    --build-only) build_only=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown option $a" ;;
    *) wanted+=("$a") ;;
  esac
done

if ! command -v clang >/dev/null || ! command -v clang++ >/dev/null; then
  die "clang not found (bash scripts/setup.sh deps installs clang and libclang-rt-14-dev)"
fi

t0=$SECONDS
mkdir -p "$BUILD"
CC=clang CXX=clang++ cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DMERLIN_FUZZ=ON -DMERLIN_SANITIZE=ON -DMERLIN_BUILD_BENCH=OFF -DMERLIN_BUILD_TESTS=ON -DMERLIN_CUDA=OFF >"$BUILD/configure.log" 2>&1 ||
  { cat "$BUILD/configure.log"; die "configuring $BUILD failed"; }
grep -qi clang "$BUILD/CMakeCache.txt" || die "$BUILD is configured with another compiler; remove it"
if [[ ${#wanted[@]} -eq 0 ]]; then
  cmake --build "$BUILD" --target fuzzers -j "$JOBS"
  mapfile -t targets < <(cd "$ROOT/tests/fuzz" && ls fuzz_*.cpp 2>/dev/null | sed 's/\.cpp$//')
else
  cmake --build "$BUILD" --target "${wanted[@]}" -j "$JOBS"
  targets=("${wanted[@]}")
fi
log "built ${targets[*]} in $((SECONDS - t0)) s"
[[ $build_only -eq 1 ]] && exit 0
[[ ${#targets[@]} -gt 0 ]] || die "no fuzz targets (tests/fuzz/fuzz_*.cpp)"

if [[ -z "${MERLIN_DATA:-}" && -d "$ROOT/../shared/data" ]]; then
  MERLIN_DATA="$(cd "$ROOT/../shared/data" && pwd)"
fi
export MERLIN_DATA="${MERLIN_DATA:-}"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
for s in /usr/bin/llvm-symbolizer /usr/lib/llvm-14/bin/llvm-symbolizer; do
  [[ -x $s ]] && { export ASAN_SYMBOLIZER_PATH="$s"; break; }
done

ART="$BUILD/fuzz-artifacts"
LOGS="$BUILD/fuzz-logs"
mkdir -p "$ART" "$LOGS"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

run_one() {  # name -> exit status of the fuzzer
  local name="$1" bin="$BUILD/fuzz/$1" seeds="$ROOT/tests/fuzz/corpus/${1#fuzz_}"
  local corpus="$WORK/$name"
  mkdir -p "$corpus"
  [[ -d "$seeds" ]] && cp -r "$seeds/." "$corpus/"
  "$bin" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$ART/$name-" "$corpus" >"$LOGS/$name.log" 2>&1
}

log "running ${targets[*]} for ${SECONDS_EACH} s each, ${PARALLEL} at a time (logs: $LOGS)"
declare -A rc_of=()
# Fuzzers that load the shared data (the GPT-2 vocabulary, stories260K's tokenizer) are skipped without it.
NEEDS_DATA=" fuzz_tokenizer "
have_data=0
[[ -n "$MERLIN_DATA" && -f "$MERLIN_DATA/tokenizer/gpt2/encoder.json" ]] && have_data=1
runnable=()
for name in "${targets[@]}"; do
  if [[ $have_data -eq 0 && "$NEEDS_DATA" == *" $name "* ]]; then
    log "SKIP $name: no shared data (set MERLIN_DATA or put it at ../shared/data)"
  else
    runnable+=("$name")
  fi
done
targets=("${runnable[@]}")
[[ ${#targets[@]} -gt 0 ]] || { log "fuzz: 0 passed, 0 failed (nothing to run)"; exit 0; }

for name in "${targets[@]}"; do
  [[ -x "$BUILD/fuzz/$name" ]] || die "missing fuzzer binary $BUILD/fuzz/$name"
  while [[ $(jobs -rp | wc -l) -ge $PARALLEL ]]; do wait -n || true; done
  { rc=0; run_one "$name" || rc=$?; echo "$rc" >"$WORK/$name.rc"; } &
done
wait
for name in "${targets[@]}"; do
  rc_of[$name]="$(cat "$WORK/$name.rc" 2>/dev/null || echo 1)"
done

passed=0
failed=0
for name in "${targets[@]}"; do
  stats="$(grep -E '^stat::number_of_executed_units' "$LOGS/$name.log" | awk '{print $2}' | tail -n1 || true)"
  cov="$(grep -oE 'cov: [0-9]+' "$LOGS/$name.log" | tail -n1 || true)"
  if [[ ${rc_of[$name]} -eq 0 ]]; then
    passed=$((passed + 1))
    log "PASS $name: ${stats:-?} runs, ${cov:-cov: ?}"
  else
    failed=$((failed + 1))
    log "FAIL $name: exit ${rc_of[$name]}; last lines of $LOGS/$name.log:"
    tail -n 60 "$LOGS/$name.log" | sed 's/^/    /'
    ls -1 "$ART"/"$name"-* 2>/dev/null | sed 's/^/    artifact: /' || true
  fi
done
log "fuzz: $passed passed, $failed failed ($((SECONDS - t0)) s)"
[[ $failed -eq 0 ]]
