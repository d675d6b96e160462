#!/usr/bin/python3
"""Test fixture: writes a random-init model with `MERLIN_BIN init`, finding the GPT-2 vocabulary in the data dir.

    init_model.py MERLIN_BIN OUT.gguf DEFAULT_DATA_DIR [init options...]

The data dir is $MERLIN_DATA when set, else DEFAULT_DATA_DIR; the vocabulary is DATA/tokenizer/gpt2.
Exit status: 0 written, 1 init failed, 77 skipped (vocabulary missing). Needs no numpy or torch.
"""

import os
import subprocess
import sys

SKIP = 77


def main():
    if len(sys.argv) < 4:
        print(__doc__)
        return 2
    merlin, out, default_data = sys.argv[1:4]
    extra = sys.argv[4:]
    if os.path.exists(out):
        os.remove(out)  # never let a stale model from an earlier run stand in for this one (nor when skipping)
    data = os.environ.get("MERLIN_DATA") or default_data
    vocab = os.path.join(data, "tokenizer", "gpt2")
    if not (os.path.isfile(os.path.join(vocab, "encoder.json")) and os.path.isfile(os.path.join(vocab, "vocab.bpe"))):
        print("SKIP: GPT-2 vocabulary not found in %s (set MERLIN_DATA to the shared data directory)" % vocab)
        return SKIP
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    argv = [merlin, "init", "-o", out, "--vocab-dir", vocab] + extra
    print(" ".join(argv))
    sys.stdout.flush()
    rc = subprocess.call(argv)
    if rc != 0:
        print("FAIL: merlin init exited with status %d" % rc)
        return 1
    if not os.path.isfile(out):
        print("FAIL: merlin init exited 0 but wrote no %s" % out)
        return 1
    print("wrote %s (%d bytes)" % (out, os.path.getsize(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
