#!/usr/bin/env bash
# CLI tests of the training commands (registered one case per ctest test by tests/train/tests.cmake).
#
#   cli_train.sh MERLIN WORKDIR setup     prepare a small dataset and a short training run (a ctest fixture)
#   cli_train.sh MERLIN WORKDIR CASE      run one case; exit 0 pass, 1 fail, 77 skip
#   cli_train.sh MERLIN WORKDIR list      print the case names
#
# Bad inputs must exit with status 1 and end stderr with one "error: ..." line naming the problem.
# Data: $MERLIN_DATA, else $MERLIN_DEFAULT_DATA_DIR (the GPT-2 vocabulary and the TinyStories text).
set -uo pipefail

MERLIN="$1"
WORK="$2"
CASE="$3"
DATA="${MERLIN_DATA:-${MERLIN_DEFAULT_DATA_DIR:-$(dirname "${BASH_SOURCE[0]}")/../../../shared/data}}"
VOCAB="$DATA/tokenizer/gpt2"
TEXT="$DATA/text/tinystories/TinyStories-train.head2MiB.txt"

CASES=(
  e2e.export_and_run e2e.plot e2e.info_checkpoint e2e.resume_extends e2e.resume_without_flags
  e2e.init_matches_merlin_init
  bad.prepare_empty bad.prepare_non_utf8 bad.prepare_bad_jsonl bad.train_data_too_small bad.train_wrong_config
  bad.train_corrupt_checkpoint bad.train_not_a_checkpoint bad.export_corrupt bad.plot_no_records
)

if [[ "$CASE" == list ]]; then
  printf '%s\n' "${CASES[@]}"
  exit 0
fi

if [[ ! -f "$VOCAB/vocab.bpe" || ! -f "$TEXT" ]]; then
  echo "skip: shared data (GPT-2 vocabulary, TinyStories) not found under $DATA"
  exit 77
fi

fail() {
  echo "FAIL: $*"
  exit 1
}

# expect_error "needle" cmd...: exit status 1, last stderr line "error: ...needle...".
expect_error() {
  local needle="$1"
  shift
  local err rc
  err="$(timeout 60 "$@" 2>&1 >/dev/null)"
  rc=$?
  echo "$ $*"
  echo "$err" | tail -n 3
  [[ $rc -eq 1 ]] || fail "exit status $rc, expected 1"
  local last
  last="$(echo "$err" | tail -n 1)"
  [[ "$last" == error:* ]] || fail "last stderr line is not 'error: ...'"
  [[ "$last" == *"$needle"* ]] || fail "error does not mention '$needle'"
  echo "ok"
}

SMALL=(--dim 32 --layers 2 --heads 4 --kv-heads 2 --ffn 64 --ctx 64)

if [[ "$CASE" == setup ]]; then
  set -e
  rm -rf "$WORK"
  mkdir -p "$WORK"
  head -c 300000 "$TEXT" >"$WORK/stories.txt"
  "$MERLIN" prepare -i "$WORK/stories.txt" -o "$WORK/data" --val-fraction 0.05 --vocab-dir "$VOCAB" -q
  "$MERLIN" train "${SMALL[@]}" --data "$WORK/data" --out "$WORK/run" --steps 6 --batch 2 --seq 32 \
    --warmup 2 --eval-every 3 --eval-tokens 256 --ckpt-every 3 --seed 1 -t 2 -q
  ls "$WORK/run"
  exit 0
fi

# Each case works in a folder of its own, since ctest runs cases in parallel (two once shared an err.txt);
# the fixture's dataset and run are linked in, read-only by convention.
CASE_DIR="$WORK/cases/$CASE"
rm -rf "$CASE_DIR" && mkdir -p "$CASE_DIR" && cd "$CASE_DIR" || exit 1
ln -s "$WORK/data" data && ln -s "$WORK/run" run || exit 1
case "$CASE" in
  e2e.export_and_run)
    for t in f32 f16 bf16; do
      "$MERLIN" export run/ckpt-000006.ckpt -o "model-$t.gguf" --type "$t" --vocab-dir "$VOCAB" || fail "export $t"
      out="$("$MERLIN" run -m "model-$t.gguf" -p "Once upon a time" -n 8 --temp 0 -t 2 2>/dev/null)" ||
        fail "merlin run on the exported $t model"
      echo "$t: $out"
      [[ "$out" == "Once upon a time"* ]] || fail "unexpected output"
    done
    ;;
  e2e.plot)
    "$MERLIN" plot run/metrics.jsonl -o loss.svg || fail "plot"
    grep -q "<svg" loss.svg && grep -q "train loss" loss.svg && grep -q "val loss" loss.svg || fail "SVG content"
    ;;
  e2e.info_checkpoint)
    # Captured first: under pipefail, grep leaving at its first match could fail `info` with EPIPE.
    info="$("$MERLIN" info run/ckpt-000006.ckpt)" || fail "merlin info on a checkpoint"
    grep -q "merlin.train.step" <<<"$info" || fail "merlin info does not show the training state"
    ;;
  e2e.resume_extends)
    # Resuming with more --steps continues the run (a longer schedule, so a warning about changed --steps).
    cp -rL run run2
    "$MERLIN" train "${SMALL[@]}" --data data --out run2 --resume run2 --steps 8 --batch 2 --seq 32 --warmup 2 \
      --eval-every 3 --eval-tokens 256 --ckpt-every 3 --seed 1 -t 2 -q 2>err.txt || fail "resume"
    grep -q "warning: steps" err.txt || fail "no warning about the changed --steps"
    [[ -f run2/ckpt-000008.ckpt ]] || fail "no checkpoint at step 8"
    [[ "$(grep -c '"loss"' run2/metrics.jsonl)" -eq 8 ]] || fail "metrics should have 8 train lines"
    ;;
  e2e.resume_without_flags)
    # --resume alone takes the model and every hyperparameter from the checkpoint: resuming the setup run
    # at step 3 must reproduce its steps 4..6 bit for bit.
    "$MERLIN" train --data data --out run3 --resume run/ckpt-000003.ckpt -t 2 -q 2>err.txt || fail "resume"
    if grep -q "warning" err.txt; then cat err.txt; fail "resume without flags warned about changed settings"; fi
    losses() { python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if "loss" in r and r["step"] > 3: print(r["step"], repr(r["loss"]))' "$1"; }
    want="$(losses run/metrics.jsonl)"
    got="$(losses run3/metrics.jsonl)"
    echo "uninterrupted: $want"
    echo "resumed:       $got"
    [[ -n "$want" && "$want" == "$got" ]] || fail "resumed losses differ from the uninterrupted run"
    ;;
  e2e.init_matches_merlin_init)
    # Training starts from exactly the weights `merlin init` writes for the same seed and dimensions.
    PY=/usr/bin/python3
    "$PY" -c "import numpy" 2>/dev/null || { echo "skip: no numpy"; exit 77; }
    "$MERLIN" init "${SMALL[@]}" --seed 7 -o init.gguf --vocab-dir "$VOCAB" 2>/dev/null || fail "init"
    "$MERLIN" train "${SMALL[@]}" --data data --out i --steps 1 --batch 2 --seq 32 --seed 7 --dump dump -q || fail "train"
    "$PY" - init.gguf dump/weights-000000.gguf "$(dirname "${BASH_SOURCE[0]}")/../reference" <<'PYEOF' || fail "weights differ"
import sys
sys.path.insert(0, sys.argv[3])
import numpy as np
from gguf_reader import GGUFReader
a, b = GGUFReader(sys.argv[1]), GGUFReader(sys.argv[2])
assert sorted(a.tensors) == sorted(b.tensors), "tensor names differ"
for name in a.tensors:
    assert np.array_equal(np.asarray(a.tensor(name)), np.asarray(b.tensor(name))), name
print("%d tensors identical" % len(a.tensors))
PYEOF
    ;;
  bad.prepare_empty)
    : >empty.txt
    expect_error "empty" "$MERLIN" prepare -i empty.txt -o out --vocab-dir "$VOCAB" -q
    ;;
  bad.prepare_non_utf8)
    printf 'Once upon a time, caf\xe9.\n' >latin1.txt
    expect_error "invalid UTF-8" "$MERLIN" prepare -i latin1.txt -o out --vocab-dir "$VOCAB" -q
    ;;
  bad.prepare_bad_jsonl)
    printf '{"text": "fine"}\n{"text": unquoted}\n' >bad.jsonl
    expect_error "line 2" "$MERLIN" prepare -i bad.jsonl --format jsonl -o out --vocab-dir "$VOCAB" -q
    ;;
  bad.train_data_too_small)
    printf 'A tiny story.\n<|endoftext|>\nAnother one.\n' >tiny.txt
    "$MERLIN" prepare -i tiny.txt -o tiny --val-fraction 0 --vocab-dir "$VOCAB" -q || fail "prepare"
    expect_error "smaller than one batch" "$MERLIN" train "${SMALL[@]}" --data tiny --out t --steps 2 -q
    ;;
  bad.train_wrong_config)
    expect_error "different model" "$MERLIN" train --dim 64 --layers 2 --heads 4 --ffn 64 --ctx 64 --data data \
      --out w --resume run/ckpt-000006.ckpt --steps 8 --seq 32 -q
    ;;
  bad.train_corrupt_checkpoint)
    cp run/ckpt-000006.ckpt flipped.ckpt
    size=$(stat -c %s flipped.ckpt)
    printf '\x55' | dd of=flipped.ckpt bs=1 seek=$((size - 1000)) conv=notrunc status=none
    expect_error "corrupt" "$MERLIN" train "${SMALL[@]}" --data data --out c --resume flipped.ckpt --steps 8 --seq 32 -q
    head -c 5000 run/ckpt-000006.ckpt >truncated.ckpt
    expect_error "not a valid checkpoint" "$MERLIN" train "${SMALL[@]}" --data data --out c --resume truncated.ckpt \
      --steps 8 --seq 32 -q
    ;;
  bad.train_not_a_checkpoint)
    "$MERLIN" export run/ckpt-000006.ckpt -o model.gguf --vocab-dir "$VOCAB" 2>/dev/null || fail "export"
    expect_error "not a training checkpoint" "$MERLIN" train "${SMALL[@]}" --data data --out n --resume model.gguf \
      --steps 8 --seq 32 -q
    ;;
  bad.export_corrupt)
    head -c 100 run/ckpt-000006.ckpt >short.ckpt
    expect_error "not a valid checkpoint" "$MERLIN" export short.ckpt -o x.gguf --vocab-dir "$VOCAB"
    ;;
  bad.plot_no_records)
    echo '{"note": 1}' >m.jsonl
    expect_error "no loss records" "$MERLIN" plot m.jsonl -o x.svg
    echo 'not json' >m2.jsonl
    expect_error "not a JSON object" "$MERLIN" plot m2.jsonl -o x.svg
    ;;
  *)
    fail "unknown case $CASE"
    ;;
esac
echo "PASS $CASE"
