#!/usr/bin/python3
"""Compares Merlin's logits and greedy tokens with the PyTorch reference (model.py) on one GGUF model.

    /usr/bin/python3 check_parity.py MERLIN_BIN MODEL.gguf [--tol 1e-4] [--seed 1234] [--n-tokens 48] [--gen 64]

1. A seeded random token sequence (length min(--n-tokens, context)) goes through
       MERLIN_BIN logits -m MODEL --tokens a,b,... --mode {prefill,decode,nocache} -o OUT.bin -t 2
   (OUT.bin: little-endian float32 [n_tokens][vocab]; row i = logits after tokens[0..i]). At every position
   max_j |merlin - torch| must be <= tol * max_j |torch| and the three modes must agree with each other
   within the same bound.
2. Greedy: MERLIN_BIN run -m MODEL --prompt-ids ... -n GEN --temp 0 --output-ids [--no-kv-cache] must print
   the same ids as the reference's greedy generation (with and without --no-kv-cache).
Exit status: 0 pass, 1 fail, 77 skip (torch/numpy or the model missing).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import numpy as np
    import torch
except ImportError as e:  # pragma: no cover
    print("SKIP: the reference needs numpy and torch (%s); run with /usr/bin/python3 on Debian" % e)
    sys.exit(SKIP)

sys.path.insert(0, HERE)
from model import ReferenceModel  # noqa: E402

MODES = ("prefill", "decode", "nocache")


class Failure(Exception):
    pass


def run_cmd(argv, timeout):
    t0 = time.time()
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failure("timed out after %ds: %s" % (timeout, " ".join(argv)))
    except OSError as e:
        raise Failure("cannot run %s: %s" % (argv[0], e))
    dt = time.time() - t0
    if p.returncode != 0:
        raise Failure("exit status %d from: %s\n--- stderr ---\n%s\n--- stdout ---\n%s"
                      % (p.returncode, " ".join(argv), p.stderr.decode(errors="replace")[-4000:],
                         p.stdout.decode(errors="replace")[-2000:]))
    return p.stdout.decode(errors="replace"), dt


def compare_rows(name, got, want, tol, scale_from=None):
    """Per position i: max_j |got - want| <= tol * max_j |ref|, ref = scale_from (default want).

    Returns (ok, worst ratio, message)."""
    if not np.all(np.isfinite(got)):
        bad = np.argwhere(~np.isfinite(got))[0]
        return False, float("inf"), "%s: non-finite value at position %d, id %d" % (name, bad[0], bad[1])
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    scale = np.abs(want if scale_from is None else scale_from).max(axis=1).astype(np.float64)
    row_err = diff.max(axis=1)
    ratio = row_err / np.maximum(scale, 1e-30)
    worst = int(np.argmax(ratio))
    col = int(np.argmax(diff[worst]))
    msg = ("%s: worst position %d: max|diff| %.3e at id %d (got %.6g, want %.6g), max|logit| %.4g -> "
           "relative %.3e (tol %.1e)" % (name, worst, row_err[worst], col, got[worst, col], want[worst, col],
                                         scale[worst], ratio[worst], tol))
    bad_rows = np.nonzero(ratio > tol)[0]
    if len(bad_rows):
        msg += "; %d of %d positions over tolerance, first %d" % (len(bad_rows), len(ratio), bad_rows[0])
    return len(bad_rows) == 0, float(ratio[worst]), msg


def explain_greedy_mismatch(model, prompt, ref_ids, got_ids):
    """Where Merlin's ids leave the reference's, show how close the reference's top two logits were there."""
    k = 0
    while k < min(len(ref_ids), len(got_ids)) and ref_ids[k] == got_ids[k]:
        k += 1
    lines = ["first difference at generated index %d (absolute position %d)" % (k, len(prompt) + k)]
    if k < len(ref_ids):
        lg = model.logits(list(prompt) + ref_ids[:k])[-1]
        top = torch.topk(lg, 2)
        lines.append("reference there: argmax %d (%.7g), runner-up %d (%.7g), gap %.3e"
                     % (int(top.indices[0]), float(top.values[0]), int(top.indices[1]), float(top.values[1]),
                        float(top.values[0] - top.values[1])))
        if k < len(got_ids):
            g = got_ids[k]
            if 0 <= g < lg.shape[0]:
                lines.append("reference logit of Merlin's pick %d: %.7g (%.3e below the argmax)"
                             % (g, float(lg[g]), float(top.values[0] - lg[g])))
            gap = float(top.values[0] - top.values[1])
            if gap <= 1e-4 * float(lg.abs().max()):
                lines.append("NEAR-TIE: the reference's top two logits are within the logits tolerance; this "
                             "mismatch may be rounding, not a bug")
    lines.append("reference: %s" % " ".join(map(str, ref_ids)))
    lines.append("merlin:    %s" % " ".join(map(str, got_ids)))
    return "\n  ".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("merlin")
    ap.add_argument("model")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--n-tokens", type=int, default=48, help="length of the random sequence for logits")
    ap.add_argument("--prompt-len", type=int, default=8, help="prompt length for the greedy comparison")
    ap.add_argument("--gen", type=int, default=64, help="greedy tokens to generate")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300, help="seconds allowed per merlin command")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--data-dir", help="for a MODEL written data:REL/PATH: the data dir when $MERLIN_DATA is unset")
    a = ap.parse_args()
    if a.model.startswith("data:"):
        root = os.environ.get("MERLIN_DATA") or a.data_dir or \
            os.path.normpath(os.path.join(HERE, "..", "..", "..", "shared", "data"))
        a.model = os.path.join(root, a.model[len("data:"):])

    if not os.path.exists(a.model):
        print("SKIP: model %s does not exist (was it created by the init fixture?)" % a.model)
        return SKIP
    if not (os.path.isfile(a.merlin) and os.access(a.merlin, os.X_OK)):
        print("FAIL: merlin binary %s not found or not executable" % a.merlin)
        return 1

    # One thread: on a shared 2-core machine, torch's OpenMP threads spin and run 10x slower under load.
    torch.set_num_threads(1)
    t0 = time.time()
    model = ReferenceModel.from_gguf(a.model)
    c = model.cfg
    print("model %s: %r%s" % (os.path.basename(a.model), c, " (tied output)" if model.tied else ""))
    types = sorted({t.type_name for t in model.reader.tensors.values()})
    print("tensor types: %s; reference load %.1fs" % (",".join(types), time.time() - t0))

    rng = np.random.RandomState(a.seed)
    n = max(1, min(a.n_tokens, c.context))
    tokens = [int(t) for t in rng.randint(0, c.vocab, size=n)]
    tmp = tempfile.mkdtemp(prefix="merlin-parity-")
    failures = []
    passes = 0
    try:
        # ---- logits ------------------------------------------------------------------------------------------
        t1 = time.time()
        want = model.logits(tokens).numpy()
        print("reference logits for %d tokens: %.2fs" % (n, time.time() - t1))
        got = {}
        for mode in MODES:
            out = os.path.join(tmp, "logits-%s.bin" % mode)
            argv = [a.merlin, "logits", "-m", a.model, "--tokens", ",".join(map(str, tokens)), "--mode", mode,
                    "-o", out, "-t", str(a.threads)]
            try:
                _, dt = run_cmd(argv, a.timeout)
                size = os.path.getsize(out) if os.path.exists(out) else -1
                if size != n * c.vocab * 4:
                    raise Failure("%s wrote %d bytes, expected %d x %d float32 = %d bytes"
                                  % (out, size, n, c.vocab, n * c.vocab * 4))
                got[mode] = np.fromfile(out, dtype="<f4").reshape(n, c.vocab)
            except Failure as e:
                failures.append("logits --mode %s: %s" % (mode, e))
                print("FAIL logits --mode %s: %s" % (mode, e))
                continue
            ok, _, msg = compare_rows("merlin %s vs torch" % mode, got[mode], want, a.tol)
            print("%s %s (%.2fs)" % ("PASS" if ok else "FAIL", msg, dt))
            if ok:
                passes += 1
            else:
                failures.append(msg)
        modes = [m for m in MODES if m in got]
        for i in range(len(modes)):
            for j in range(i + 1, len(modes)):
                # scaled by the reference logits, as for the comparisons against torch
                ok, _, msg = compare_rows("merlin %s vs merlin %s" % (modes[i], modes[j]),
                                          got[modes[i]], got[modes[j]], a.tol, scale_from=want)
                print("%s %s" % ("PASS" if ok else "FAIL", msg))
                if ok:
                    passes += 1
                else:
                    failures.append(msg)

        # ---- greedy ------------------------------------------------------------------------------------------
        plen = max(1, min(a.prompt_len, c.context - 1))
        prompt = tokens[:plen]
        gen = max(1, min(a.gen, c.context - plen))
        t1 = time.time()
        ref_ids = model.greedy(prompt, gen)
        print("reference greedy %d tokens: %.2fs" % (gen, time.time() - t1))
        eos = model.reader.get("tokenizer.ggml.eos_token_id")
        for extra in ([], ["--no-kv-cache"]):
            label = "greedy" + (" --no-kv-cache" if extra else "")
            argv = [a.merlin, "run", "-m", a.model, "--prompt-ids", ",".join(map(str, prompt)), "-n", str(gen),
                    "--temp", "0", "--output-ids", "--kv-type", "f32", "-t", str(a.threads)] + extra
            try:
                out, dt = run_cmd(argv, a.timeout)
                try:
                    got_ids = [int(x) for x in out.split()]
                except ValueError:
                    raise Failure("stdout is not space-separated ids: %r" % out[:500])
            except Failure as e:
                failures.append("%s: %s" % (label, e))
                print("FAIL %s: %s" % (label, e))
                continue
            ok = got_ids == ref_ids
            note = ""
            # Merlin's run stops at end-of-text; the reference generates on. Accept a prefix that ends where the
            # reference emits EOS (whether or not Merlin prints the EOS id itself).
            k = len(got_ids)
            if not ok and eos is not None and k < len(ref_ids) and got_ids == ref_ids[:k] and \
                    (ref_ids[k] == int(eos) or (k > 0 and got_ids[-1] == int(eos))):
                ok, note = True, " (merlin stopped at EOS %d, where the reference emits it)" % int(eos)
            if ok:
                passes += 1
                print("PASS %s: %d ids identical%s (%.2fs)" % (label, len(got_ids), note, dt))
            else:
                msg = "%s: ids differ\n  %s" % (label, explain_greedy_mismatch(model, prompt, ref_ids, got_ids))
                failures.append(msg)
                print("FAIL " + msg)
    finally:
        if a.keep:
            print("kept temporary files in %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print("parity %s: %d passed, %d failed (%.1fs)" % (os.path.basename(a.model), passes, len(failures),
                                                      time.time() - t0))
    if failures:
        print("FAILED checks:\n- " + "\n- ".join(f.split("\n")[0] for f in failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
