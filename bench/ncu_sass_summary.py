#!/usr/bin/env python3
"""Summarizes `ncu --page source --csv --print-source sass` (scripts/gpu_sass.sh): executed warp instructions
and stall samples by opcode, and the kernel's basic blocks (runs of consecutive instructions executed equally
often) by the instructions they execute, each with its opcodes, so that loops and epilogues stand apart.

    ncu_sass_summary.py REPORT.csv [--blocks N]
"""
import argparse
import collections
import csv
import re


def column(hdr, *want, avoid=()):
    for i, h in enumerate(hdr):
        if all(w in h for w in want) and not any(a in h for a in avoid):
            return i
    return -1


def number(s):
    s = s.replace(",", "").strip()
    try:
        return float(s)
    except ValueError:
        return 0.0


def opcode(src):
    s = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    return s.split(" ")[0].split(".")[0] if s else "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--blocks", type=int, default=25)
    a = ap.parse_args()
    rows = [r for r in csv.reader(open(a.csv, newline="")) if r]
    hi = next((i for i, r in enumerate(rows) if any("Source" in c for c in r)), None)
    if hi is None:
        print("no header with a Source column:", rows[:3])
        return
    hdr, body = rows[hi], rows[hi + 1:]
    si = column(hdr, "Source")
    ai = column(hdr, "Address")
    ei = column(hdr, "Instructions Executed", avoid=("Thread", "Predicated"))
    wi = column(hdr, "Warp Stall Sampling (All")
    if ei < 0:
        print("no 'Instructions Executed' column; header:", hdr)
        return
    ins = [(r[ai] if ai >= 0 else str(k), r[si], number(r[ei]), number(r[wi]) if wi >= 0 else 0.0)
           for k, r in enumerate(body) if len(r) > max(si, ei)]
    total = sum(e for _, _, e, _ in ins) or 1.0
    stalls = sum(w for *_, w in ins) or 1.0
    print(f"{total:,.0f} warp instructions executed, {stalls:,.0f} stall samples, {len(ins)} SASS instructions")
    by_op = collections.defaultdict(lambda: [0.0, 0.0])
    for _, s, e, w in ins:
        by_op[opcode(s)][0] += e
        by_op[opcode(s)][1] += w
    print("\nby opcode (executed %, stall samples %):")
    for op, (e, w) in sorted(by_op.items(), key=lambda x: -x[1][0])[:30]:
        print(f"  {op:12s} {100 * e / total:6.2f} %  {100 * w / stalls:6.2f} %")
    blocks, cur = [], []
    for x in ins:
        if cur and x[2] != cur[-1][2]:
            blocks.append(cur)
            cur = []
        cur.append(x)
    if cur:
        blocks.append(cur)
    blocks = [b for b in blocks if b[0][2] > 0]
    print(f"\nbasic blocks by instructions executed (top {a.blocks}): share, times run, length, stall share, first address")
    for b in sorted(blocks, key=lambda b: -b[0][2] * len(b))[:a.blocks]:
        e = b[0][2] * len(b)
        w = sum(x[3] for x in b)
        ops = collections.Counter(opcode(x[1]) for x in b)
        print(f"  {100 * e / total:6.2f} %  x{b[0][2]:<10,.0f} {len(b):4d} instr  {100 * w / stalls:6.2f} % stalls  @{b[0][0]}")
        print("      " + " ".join(f"{o}:{n}" for o, n in ops.most_common(12)))


if __name__ == "__main__":
    main()
