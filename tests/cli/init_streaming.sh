#!/usr/bin/env bash
# merlin init streams to disk: writing the 124M-parameter `base` preset (about 250 MB in bf16) must not hold
# the model in memory, and the same seed must give the same bytes whatever the thread count.
set -euo pipefail
merlin=$1
data=${MERLIN_DATA:-${MERLIN_DEFAULT_DATA_DIR:-}}
vocab=$data/tokenizer/gpt2
[[ -f $vocab/encoder.json ]] || { echo "skip: GPT-2 vocabulary not found under $data"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

log=$("$merlin" init --preset base --type bf16 --seed 3 --vocab-dir "$vocab" -o "$tmp/base.gguf" 2>&1)
rss=$(echo "$log" | sed -nE 's/.*peak RSS ([0-9.]+) MiB.*/\1/p')
size=$(stat -c %s "$tmp/base.gguf")
echo "base bf16: $size bytes written, peak RSS ${rss} MiB"
[[ -n $rss ]] || { echo "FAIL: no peak RSS line in: $log"; exit 1; }
awk -v r="$rss" 'BEGIN { exit !(r < 96) }' || { echo "FAIL: peak RSS $rss MiB is not bounded (limit 96 MiB)"; exit 1; }
# Output captured first: under pipefail, grep leaving at its first match could fail `info` with EPIPE.
info=$("$merlin" info "$tmp/base.gguf")
grep -q "parameters: 123551232" <<<"$info" || { echo "FAIL: wrong parameter count"; exit 1; }

"$merlin" init --preset sanity --seed 9 -t 1 --vocab-dir "$vocab" -o "$tmp/a.gguf" 2>/dev/null
"$merlin" init --preset sanity --seed 9 -t 2 --vocab-dir "$vocab" -o "$tmp/b.gguf" 2>/dev/null
"$merlin" init --preset sanity --seed 10 -t 2 --vocab-dir "$vocab" -o "$tmp/c.gguf" 2>/dev/null
cmp -s "$tmp/a.gguf" "$tmp/b.gguf" || { echo "FAIL: same seed, different bytes with 1 and 2 threads"; exit 1; }
! cmp -s "$tmp/a.gguf" "$tmp/c.gguf" || { echo "FAIL: different seeds gave the same model"; exit 1; }
left=$(ls "$tmp")
grep -q tmp <<<"$left" && { echo "FAIL: temporary file left behind"; exit 1; }
echo PASS
