#!/usr/bin/env bash
# CLI-level bad-input tests (registered one case per ctest test by tests/cli/tests.cmake).
#
#   bad_input.sh MERLIN WORKDIR setup          make the input files in WORKDIR (a ctest fixture)
#   bad_input.sh MERLIN WORKDIR CASE           run one case (see `list` below); exit 0 pass, 1 fail, 77 skip
#   bad_input.sh MERLIN WORKDIR list           print the case names
#
# A bad input must make merlin exit with a status in 1..125 (not killed by a signal, not a sanitizer abort),
# within 20 s, with exactly one stderr line starting with "error:", and that line must be stderr's last.
# Data: $MERLIN_DATA, else the dir given as MERLIN_DEFAULT_DATA_DIR (../shared/data beside the checkout).
set -uo pipefail

MERLIN="$1"
WORK="$2"
CASE="$3"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DATA="${MERLIN_DATA:-${MERLIN_DEFAULT_DATA_DIR:-$HERE/../../../shared/data}}"
PY=/usr/bin/python3
[[ -x $PY ]] || PY=python3
TIMEOUT="${MERLIN_CLI_TIMEOUT:-20}"

# Malformed files: every one is tried with both `merlin info` and `merlin run -m`.
FILE_CASES=(
  missing empty directory truncated wrong_magic zero_magic wrong_version version_0
  huge_tensor_count huge_kv_count huge_string_length huge_array_length
  tensor_offset_past_end tensor_offset_overflow unknown_tensor_type unknown_value_type
  dims_overflow too_many_dims alignment_zero alignment_3 partial_block
  duplicate_tensor_name duplicate_key deep_nesting
)
OTHER_CASES=(
  help run.not_a_model run.invalid_utf8_prompt run.missing_model_flag run.bad_number
  flags.unknown_top flags.unknown_subcommand flags.run_unknown flags.info_unknown
)

if [[ "$CASE" == list ]]; then
  for c in "${FILE_CASES[@]}"; do echo "info.$c"; echo "run.$c"; done
  printf '%s\n' "${OTHER_CASES[@]}"
  exit 0
fi

if [[ "$CASE" == setup ]]; then
  set -e
  rm -rf "$WORK"
  mkdir -p "$WORK/dir.gguf"
  : >"$WORK/empty.gguf"
  "$PY" "$HERE/make_bad_gguf.py" "$WORK"
  # A real model: merlin's own tiny "sanity" model, else llama2.c's stories260K from the shared data.
  if [[ -d "$DATA/tokenizer/gpt2" ]] &&
     timeout 120 "$MERLIN" init --preset sanity --seed 1 --vocab-dir "$DATA/tokenizer/gpt2" \
       -o "$WORK/model.gguf" >"$WORK/init.log" 2>&1; then
    echo "model: merlin init --preset sanity"
  elif [[ -f "$DATA/models/stories260K/stories260K.gguf" ]]; then
    echo "model: merlin init failed or no vocab ($(tail -n 1 "$WORK/init.log" 2>/dev/null)); using stories260K.gguf"
    cp "$DATA/models/stories260K/stories260K.gguf" "$WORK/model.gguf"
  else
    echo "model: none (no merlin init, no shared data); run.invalid_utf8_prompt will be skipped"
  fi
  # Truncated copies of a valid file: of the model when there is one, else of a small non-model file.
  src="$WORK/model.gguf"
  [[ -f "$src" ]] || src="$WORK/valid_not_a_model.gguf"
  "$PY" "$HERE/make_bad_gguf.py" --truncate "$src" "$WORK/truncated"
  ls "$WORK"
  exit 0
fi

[[ -d "$WORK" ]] || { echo "missing $WORK: the cli.setup fixture did not run"; exit 1; }
cd "$WORK" || exit 1
FAILED=0

# run_cmd DESC CMD... -> sets RC, OUT, ERR files
run_cmd() {
  TEST_OUT="$WORK/.out.$$"
  TEST_ERR="$WORK/.err.$$"
  timeout -k 5 "$TIMEOUT" "$@" >"$TEST_OUT" 2>"$TEST_ERR" </dev/null
  RC=$?
}

show_stderr() {
  echo "    --- stderr (first 15 lines) ---"
  head -n 15 "$TEST_ERR" | sed 's/^/    | /'
  echo "    --- stdout (first 5 lines) ---"
  head -n 5 "$TEST_OUT" | sed 's/^/    | /'
}

# expect_error DESC CMD...
expect_error() {
  local desc="$1"
  shift
  run_cmd "$@"
  local problem=""
  local n_err last
  n_err=$(grep -c '^error:' "$TEST_ERR")
  last=$(tail -n 1 "$TEST_ERR")
  if [[ $RC -eq 124 || $RC -eq 137 ]]; then
    problem="did not finish within ${TIMEOUT}s (exit $RC)"
  elif [[ $RC -eq 0 ]]; then
    problem="exited 0 (expected an error)"
  elif [[ $RC -gt 125 ]]; then
    problem="exit status $RC (killed by signal $((RC - 128))?)"
  elif grep -qE 'Sanitizer|runtime error:|terminate called|Segmentation fault|Aborted|core dumped' "$TEST_ERR"; then
    problem="crash/sanitizer output on stderr (exit $RC)"
  elif [[ $n_err -ne 1 ]]; then
    problem="$n_err stderr lines start with 'error:' (want exactly 1; exit $RC)"
  elif [[ "$last" != error:* ]]; then
    problem="the 'error:' line is not the last stderr line (exit $RC)"
  fi
  if [[ -n "$problem" ]]; then
    echo "FAIL $desc: $problem"
    echo "    command: $*"
    show_stderr
    FAILED=1
  else
    echo "ok   $desc: exit $RC, $(grep '^error:' "$TEST_ERR")"
  fi
}

# expect_ok DESC CMD...  (exit 0 and something on stdout)
expect_ok() {
  local desc="$1"
  shift
  run_cmd "$@"
  if [[ $RC -ne 0 ]]; then
    echo "FAIL $desc: exit $RC (expected 0)"
    echo "    command: $*"
    show_stderr
    FAILED=1
  elif [[ ! -s "$TEST_OUT" ]]; then
    echo "FAIL $desc: exit 0 but nothing on stdout"
    FAILED=1
  else
    echo "ok   $desc"
  fi
}

file_for() {  # case -> the file(s) to try
  case "$1" in
    missing) echo "$WORK/does-not-exist.gguf" ;;
    empty) echo "$WORK/empty.gguf" ;;
    directory) echo "$WORK/dir.gguf" ;;
    truncated) ls "$WORK"/truncated.*.gguf ;;
    *) echo "$WORK/$1.gguf" ;;
  esac
}

MODEL="$WORK/model.gguf"
case "$CASE" in
  info.* | run.*)
    sub="${CASE%%.*}"
    what="${CASE#*.}"
    if [[ " ${FILE_CASES[*]} " == *" $what "* ]]; then
      for f in $(file_for "$what"); do
        if [[ $what != missing && ! -e $f ]]; then
          echo "FAIL setup did not make $f"
          FAILED=1
          continue
        fi
        if [[ $sub == info ]]; then
          expect_error "info $(basename "$f")" "$MERLIN" info "$f"
        else
          expect_error "run -m $(basename "$f")" "$MERLIN" run -m "$f" -p "Once upon a time" -n 4
        fi
      done
    else
      case "$what" in
        not_a_model)
          expect_error "run -m valid GGUF without a model" "$MERLIN" run -m valid_not_a_model.gguf -p hi -n 4 ;;
        invalid_utf8_prompt)
          [[ -f "$MODEL" ]] || { echo "skip: no valid model (see cli.setup)"; exit 77; }
          expect_error "run with prompt \\xff\\xfe" "$MERLIN" run -m "$MODEL" -p "$(printf '\xff\xfe')" -n 4
          expect_error "run with prompt a\\xc3(" "$MERLIN" run -m "$MODEL" -p "$(printf 'a\xc3(')" -n 4 ;;
        missing_model_flag)
          expect_error "run without -m" "$MERLIN" run -p hi -n 4 ;;
        bad_number)
          [[ -f "$MODEL" ]] || MODEL="$WORK/valid_not_a_model.gguf"
          expect_error "run -n abc" "$MERLIN" run -m "$MODEL" -p hi -n abc ;;
        *) echo "unknown case $CASE"; exit 1 ;;
      esac
    fi
    ;;
  help)
    expect_ok "merlin --help" "$MERLIN" --help
    for sub in run info init logits; do
      expect_ok "merlin $sub --help" "$MERLIN" "$sub" --help
    done
    ;;
  flags.unknown_top) expect_error "merlin --bogus-flag" "$MERLIN" --bogus-flag ;;
  flags.unknown_subcommand) expect_error "merlin frobnicate" "$MERLIN" frobnicate ;;
  flags.run_unknown)
    expect_error "merlin run --bogus-flag" "$MERLIN" run -m valid_not_a_model.gguf -p hi --bogus-flag ;;
  flags.info_unknown)
    expect_error "merlin info --bogus-flag" "$MERLIN" info --bogus-flag valid_not_a_model.gguf ;;
  *)
    echo "unknown case '$CASE' (see: $0 MERLIN WORKDIR list)"
    exit 1
    ;;
esac
rm -f "$WORK/.out.$$" "$WORK/.err.$$"
exit $FAILED
