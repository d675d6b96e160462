#!/usr/bin/python3
"""Validates the PyTorch reference (gguf_reader.py + model.py) against outputs of other implementations.

Checks, on the shared data directory ($MERLIN_DATA, else ../shared/data beside the checkout):
  1. stories260K.gguf, greedy from "Once upon a time" == llama2.c run.c's output (temperature 0, 100 steps).
  2. tiny-llama-conformance tiny-f32.gguf (GQA, untied output), greedy 24 == llama-cli's output bytes;
     tiny-f16.gguf gives the same bytes as well (llama.cpp's f16 run does too).
  3. tiny-f32 ln(perplexity) over TinyStories-valid.head201.txt, 128-token windows scored on the second half,
     == llama-perplexity's within 1e-3 (this checks whole logit vectors, not just their argmax).
  4. F16/BF16 dequantization: the tiny-f16 / tiny-bf16 tensors equal tiny-f32's rounded to nearest-even.
  5. Internal consistency: full-sequence logits == token-by-token KV-cache logits; greedy with and without
     the cache agree.
Exit status: 0 all passed, 1 a check failed, 77 skipped (torch/numpy or the data missing).
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = 77


def data_dir():
    """$MERLIN_DATA, else --data-dir DIR from the command line, else ../shared/data beside the checkout."""
    d = os.environ.get("MERLIN_DATA")
    if d:
        return d
    if "--data-dir" in sys.argv[1:-1]:
        return sys.argv[sys.argv.index("--data-dir") + 1]
    return os.path.normpath(os.path.join(HERE, "..", "..", "..", "shared", "data"))


try:
    import numpy as np
    import torch
except ImportError as e:  # pragma: no cover
    print("SKIP: the reference needs numpy and torch (%s); run with /usr/bin/python3 on Debian" % e)
    sys.exit(SKIP)

sys.path.insert(0, HERE)
from gguf_reader import GGUFReader  # noqa: E402
from model import ReferenceModel, decode  # noqa: E402
from spm_tokenizer import SPMTokenizer  # noqa: E402

PROMPT_IDS = [1, 403, 407, 261, 378]  # BOS + " Once upon a time" in the stories260K vocabulary


class Checks:
    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.skipped = 0

    def ok(self, name, cond, detail=""):
        if cond:
            self.passed += 1
            print("PASS %s %s" % (name, detail))
        else:
            self.failed += 1
            print("FAIL %s %s" % (name, detail))
        sys.stdout.flush()

    def skip(self, name, why):
        self.skipped += 1
        print("SKIP %s: %s" % (name, why))


def check_stories260k(C, dd):
    d = os.path.join(dd, "models", "stories260K")
    gguf = os.path.join(d, "stories260K.gguf")
    ref = os.path.join(d, "llama2c_run_t0.0_prompt_once_n100.out.txt")
    if not (os.path.exists(gguf) and os.path.exists(ref)):
        C.skip("stories260k_llama2c", "missing %s or %s" % (gguf, ref))
        return
    m = ReferenceModel.from_gguf(gguf)
    vocab = m.reader.get("tokenizer.ggml.tokens")
    tok = SPMTokenizer.from_reader(m.reader)
    C.ok("stories260k_tokenize_prompt", tok.encode("Once upon a time") == PROMPT_IDS,
         str(tok.encode("Once upon a time")))
    # run.c: steps=100 forward passes at positions 0..99; each prints the next token; positions 0..3 print the
    # prompt tokens, so 100 - 4 = 96 generated tokens, stopping early on BOS (id 1).
    steps = 100
    n_gen = steps - (len(PROMPT_IDS) - 1)
    out = m.greedy(PROMPT_IDS, n_gen, stop_ids=(1,))
    # run.c's decode() drops the leading space of a piece that follows BOS.
    text = decode(PROMPT_IDS[1:] + out, vocab)
    if text.startswith(b" "):
        text = text[1:]
    with open(ref, "rb") as f:
        want = f.read()
    # run.c prints a newline after the generation.
    C.ok("stories260k_llama2c_greedy", text + b"\n" == want,
         "(%d generated tokens)\n  ref:   %r\n  want:  %r" % (len(out), text[:80], want[:80])
         if text + b"\n" != want else "(%d generated tokens, %d bytes identical)" % (len(out), len(want)))
    # internal consistency on a real model
    seq = PROMPT_IDS + out[:40]
    full = m.logits(seq)
    inc = m.logits_incremental(seq)
    err = float((full - inc).abs().max()) / float(full.abs().max())
    C.ok("stories260k_cache_vs_full", err <= 1e-5, "max rel diff %.2e" % err)
    C.ok("stories260k_greedy_nocache", m.greedy(PROMPT_IDS, 30, use_cache=False) == out[:30])


def tiny_paths(dd, typ):
    d = os.path.join(dd, "models", "tiny-llama-conformance")
    return os.path.join(d, "tiny-%s.gguf" % typ), os.path.join(d, "tiny-%s.greedy24.out" % typ), \
        os.path.join(d, "tiny-%s.ppl128.txt" % typ)


def check_tiny_greedy(C, dd, typ):
    gguf, ref, _ = tiny_paths(dd, typ)
    name = "tiny_%s_llamacpp_greedy24" % typ
    if not (os.path.exists(gguf) and os.path.exists(ref)):
        C.skip(name, "missing %s" % gguf)
        return None
    m = ReferenceModel.from_gguf(gguf)
    vocab = m.reader.get("tokenizer.ggml.tokens")
    out = m.greedy(PROMPT_IDS, 24)
    got = decode(PROMPT_IDS[1:] + out, vocab)   # llama-cli echoes the prompt with its leading space
    with open(ref, "rb") as f:
        want = f.read()
    # llama-cli ends its output with a blank line ("\n\n") after the last token.
    C.ok(name, got + b"\n\n" == want,
         "\n  ref:  %r\n  want: %r" % (got, want) if got + b"\n\n" != want else "(%d bytes identical)" % len(want))
    return m


def read_llamacpp_ppl(path):
    with open(path) as f:
        s = f.read()
    return float(s.split("PPL =")[1].split()[0])


def check_tiny_ppl(C, dd, m):
    _, _, ppl_file = tiny_paths(dd, "f32")
    text_file = os.path.join(dd, "text", "tinystories", "TinyStories-valid.head201.txt")
    name = "tiny_f32_llamacpp_perplexity"
    if m is None or not (os.path.exists(ppl_file) and os.path.exists(text_file)):
        C.skip(name, "missing data")
        return
    with open(text_file, "rb") as f:
        text = f.read().decode("utf-8")
    if text.endswith("\n"):  # llama.cpp's -f drops one trailing newline
        text = text[:-1]
    t0 = time.time()
    toks = SPMTokenizer.from_reader(m.reader).encode(text, add_bos=True)
    n_ctx = 128
    first = n_ctx // 2
    n_chunk = len(toks) // n_ctx
    nll = 0.0
    count = 0
    for i in range(n_chunk):
        chunk = list(toks[i * n_ctx:(i + 1) * n_ctx])
        chunk[0] = m.reader.get("tokenizer.ggml.bos_token_id", 1)
        lg = m.logits(chunk).double()
        lp = torch.log_softmax(lg[first:n_ctx - 1], dim=-1)
        tgt = torch.tensor(toks[i * n_ctx + first + 1:(i + 1) * n_ctx])
        nll -= float(lp.gather(1, tgt[:, None]).sum())
        count += n_ctx - 1 - first
    ln_ppl = nll / count
    want = np.log(read_llamacpp_ppl(ppl_file))
    C.ok(name, abs(ln_ppl - want) <= 1e-3,
         "ln PPL ref %.5f vs llama.cpp %.5f (%d tokens, %d chunks, %.1fs)"
         % (ln_ppl, want, len(toks), n_chunk, time.time() - t0))


def check_dequant(C, dd):
    f32, _, _ = tiny_paths(dd, "f32")
    if not os.path.exists(f32):
        C.skip("tiny_dequant", "missing %s" % f32)
        return
    r32 = GGUFReader(f32)
    for typ in ("f16", "bf16"):
        path, _, _ = tiny_paths(dd, typ)
        if not os.path.exists(path):
            C.skip("tiny_dequant_" + typ, "missing " + path)
            continue
        r = GGUFReader(path)
        bad = []
        n_checked = 0
        for name, t in r.tensors.items():
            a = r.tensor(name)
            b = r32.tensor(name)
            if t.ggml_type == 1:
                b = b.astype(np.float16).astype(np.float32)
            elif t.ggml_type == 30:
                u = b.view(np.uint32).astype(np.uint64)
                u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16          # round to nearest even (no NaNs here)
                b = (u.astype(np.uint32) << 16).view(np.float32)
            if a.shape != b.shape or not np.array_equal(a, b):
                bad.append(name)
            n_checked += 1
        C.ok("tiny_dequant_" + typ, not bad and n_checked == len(r32.tensors),
             "%d tensors equal f32 rounded%s" % (n_checked, (" ; mismatched: %s" % bad) if bad else ""))


def check_bf16_info(dd):
    """Informational only: llama.cpp rounds activations to bf16 in its bf16 matmuls, ours does not."""
    gguf, ref, _ = tiny_paths(dd, "bf16")
    if not (os.path.exists(gguf) and os.path.exists(ref)):
        return
    m = ReferenceModel.from_gguf(gguf)
    vocab = m.reader.get("tokenizer.ggml.tokens")
    got = decode(PROMPT_IDS[1:] + m.greedy(PROMPT_IDS, 24), vocab)
    with open(ref, "rb") as f:
        want = f.read()
    same = 0
    while same < min(len(got), len(want)) and got[same] == want[same]:
        same += 1
    print("INFO tiny_bf16: reference and llama-cli share the first %d of %d bytes (llama.cpp rounds "
          "activations to bf16; expected to depart after ~20 tokens)" % (same, len(want)))


def main():
    dd = data_dir()
    if not os.path.isdir(dd):
        print("SKIP: shared data directory %s not found (set MERLIN_DATA)" % dd)
        return SKIP
    torch.set_num_threads(1)  # torch's OpenMP threads spin and run ~10x slower on a loaded 2-core machine
    C = Checks()
    t0 = time.time()
    check_stories260k(C, dd)
    m32 = check_tiny_greedy(C, dd, "f32")
    check_tiny_greedy(C, dd, "f16")
    check_tiny_ppl(C, dd, m32)
    check_dequant(C, dd)
    check_bf16_info(dd)
    print("selfcheck: %d passed, %d failed, %d skipped (%.1fs)" % (C.passed, C.failed, C.skipped, time.time() - t0))
    if C.failed:
        return 1
    if C.passed == 0:
        print("SKIP: no reference data found under %s" % dd)
        return SKIP
    return 0


if __name__ == "__main__":
    sys.exit(main())
