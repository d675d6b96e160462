#!/usr/bin/env python3
"""Per-step summary of a bench/cuda_trace.cpp timeline.

    cuda_trace_summary.py TRACE.csv [--steps N] [--positions]

A step is everything from one device-to-host copy (the ids coming back) to the next. Each record is charged
the time it adds to the step, end - (the latest end before it), so a step's charges sum to its span whatever
overlaps (programmatic dependent launch starts a kernel before its predecessor ends). Prints the mean span,
the sum of kernel durations, the charge per kernel name, and with --positions the charge of each position of
the step in order (which kernels of a layer wait on what)."""
import argparse
import collections
import csv
import signal


def load(path):
    """Records (kind, start_ns, end_ns, name), sorted by start."""
    with open(path, newline="") as f:
        rows = [(r["kind"], int(r["start_ns"]), int(r["end_ns"]), r["name"]) for r in csv.DictReader(f)]
    rows.sort(key=lambda r: r[1])
    return rows


def split_steps(rows):
    """Runs of records that end with a device-to-host copy and hold at least one kernel."""
    steps, cur = [], []
    for r in rows:
        cur.append(r)
        if r[0] == "M" and r[3] == "DtoH":
            steps.append(cur)
            cur = []
    return [s for s in steps if any(r[0] == "K" for r in s)]


def charges(step):
    """Each record's charge: how far its end moves the step's latest end (never negative)."""
    out, last_end = [], step[0][1]
    for _, _, end, _ in step:
        out.append(max(0, end - last_end))
        last_end = max(last_end, end)
    return out


def short(name):
    """A demangled kernel name without its return type, namespaces and parameter list."""
    for p in ("void ", "merlin::cuda::", "(anonymous namespace)::"):
        name = name.replace(p, "")
    return name.split("(")[0][:60]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=32, help="the last N steps (bar the final 2)")
    ap.add_argument("--positions", action="store_true")
    a = ap.parse_args()
    steps = split_steps(load(a.trace))
    if not steps:
        print("no steps")
        return
    # Keep the steps of the most common record count (the timed decode steps, not warm-up or prefill).
    common = collections.Counter(len(s) for s in steps).most_common(1)[0][0]
    steps = [s for s in steps if len(s) == common][-a.steps - 2:-2] or [s for s in steps if len(s) == common]
    n = len(steps)
    span = sum(s[-1][2] - s[0][1] for s in steps) / n
    between = [steps[i][0][1] - steps[i - 1][-1][2] for i in range(1, n)]
    busy = sum(r[2] - r[1] for s in steps for r in s if r[0] == "K") / n
    print(f"{n} steps of {common} records: span {span / 1e3:.1f} us, kernel durations {busy / 1e3:.1f} us, "
          f"host gap between steps {sum(between) / max(1, len(between)) / 1e3:.1f} us")
    by_name = collections.defaultdict(lambda: [0, 0.0, 0.0])
    by_pos = [[0.0, 0.0, ""] for _ in range(common)]
    for s in steps:
        for i, ((kind, st, en, name), charge) in enumerate(zip(s, charges(s))):
            key = short(name) if kind == "K" else f"[{name}]"
            e = by_name[key]
            e[0] += 1
            e[1] += charge
            e[2] += en - st
            by_pos[i][0] += charge
            by_pos[i][1] += en - st
            by_pos[i][2] = key
    print(f"{'charge us/step':>15} {'count':>6} {'charge each':>11} {'duration each':>13}  name")
    for key, (c, ch, du) in sorted(by_name.items(), key=lambda x: -x[1][1]):
        print(f"{ch / n / 1e3:15.1f} {c / n:6.1f} {ch / c / 1e3:11.2f} {du / c / 1e3:13.2f}  {key}")
    if a.positions:
        for i, (ch, du, key) in enumerate(by_pos):
            print(f"{i:4d} {ch / n / 1e3:8.2f} {du / n / 1e3:8.2f}  {key}")


if __name__ == "__main__":
    main()
