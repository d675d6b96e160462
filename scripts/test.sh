#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: ctest (unit, CLI and reference tests), then the
# libFuzzer targets for ${FUZZ_SECONDS:-60} s each. Exits non-zero if anything failed.
#
#   bash scripts/test.sh
#
# Environment: MERLIN_DATA (shared data; default ../shared/data beside the checkout), FUZZ_SECONDS
# (0 skips the fuzzers), CTEST_JOBS (default 2), and scripts/setup.sh's variables.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${MERLIN_BUILD_DIR:-$ROOT/build}"
cd "$ROOT" || exit 1
if [[ -z "${MERLIN_DATA:-}" && -d "$ROOT/../shared/data" ]]; then
  MERLIN_DATA="$(cd "$ROOT/../shared/data" && pwd)"
  export MERLIN_DATA
fi

t0=$SECONDS
bash "$ROOT/scripts/setup.sh" all || { echo "test.sh: setup/build failed" >&2; exit 1; }
# llama.cpp (prebuilt, from npm) for the interoperability tests; they skip if this fails.
bash "$ROOT/tests/interop/install.sh" || echo "test.sh: llama.cpp interop install failed; interop tests will skip" >&2
# The official OpenAI SDK for the server's integration tests; they skip if this fails.
bash "$ROOT/tests/serve/install.sh" || echo "test.sh: openai SDK install failed; server SDK tests will skip" >&2
t_setup=$((SECONDS - t0))

t1=$SECONDS
ctest_rc=0
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${CTEST_JOBS:-2}" 2>&1 | tee "$BUILD_DIR/ctest.log"
ctest_rc=${PIPESTATUS[0]}
t_ctest=$((SECONDS - t1))

t2=$SECONDS
fuzz_rc=0
if [[ "${FUZZ_SECONDS:-60}" != 0 ]]; then
  bash "$ROOT/scripts/run_fuzzers.sh" 2>&1 | tee "$BUILD_DIR/fuzz.log"
  fuzz_rc=${PIPESTATUS[0]}
else
  echo "[fuzz] skipped (FUZZ_SECONDS=0)" | tee "$BUILD_DIR/fuzz.log"
fi
t_fuzz=$((SECONDS - t2))

# Summary last, ending with ctest's own closing lines (CI reads the closing lines of ctest's output).
{
  echo
  echo "==== summary ===="
  echo "setup+build ${t_setup} s, ctest ${t_ctest} s (exit ${ctest_rc}), fuzzers ${t_fuzz} s (exit ${fuzz_rc})"
  if [[ -n "${MERLIN_CI_START:-}" ]]; then
    echo "total since .ci/run started: $(( $(date +%s) - MERLIN_CI_START )) s"
  fi
  grep -E '^\[fuzz\] (PASS|FAIL|fuzz:|skipped)' "$BUILD_DIR/fuzz.log" || true
  # ctest's "The following tests FAILED:" block, if any, then "N% tests passed, N tests failed out of M"
  # and "Total Test time (real) = ...".
  sed -n '/^The following tests FAILED:/,$p' "$BUILD_DIR/ctest.log" | grep -vE '^(Total Test time|Errors while running CTest)' || true
  grep -E '^[0-9]+% tests passed' "$BUILD_DIR/ctest.log" | tail -n 1 || true
  grep -E '^Total Test time' "$BUILD_DIR/ctest.log" | tail -n 1 || true
} | tee "$BUILD_DIR/test-summary.txt"

[[ $ctest_rc -eq 0 && $fuzz_rc -eq 0 ]]
