#!/usr/bin/env python3
"""bench/cuda_trace_summary.py on a synthetic timeline: steps split at the ids' copy, charges that sum to a
step's span under overlap, and the per-position table."""
import importlib.util
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "bench", "cuda_trace_summary.py")
spec = importlib.util.spec_from_file_location("cuda_trace_summary", SCRIPT)
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)

# One step: input copy, kernel a, kernel b started early (programmatic launch) and ending after a, a kernel c
# wholly inside b, the ids' copy. Then the same shifted by 100 ns, and a trailing copy without kernels.
US = 1000  # the trace is in nanoseconds, the table in microseconds
STEP = [("M", 0, 1 * US, "HtoD"), ("K", 1 * US, 10 * US, "void merlin::cuda::(anonymous namespace)::a_kernel<1>(Args)"),
        ("K", 5 * US, 15 * US, "void merlin::cuda::(anonymous namespace)::b_kernel(Args)"),
        ("K", 6 * US, 12 * US, "void merlin::cuda::(anonymous namespace)::c_kernel(Args)"),
        ("M", 15 * US, 17 * US, "DtoH")]


def write_trace(path, steps):
    with open(path, "w") as f:
        f.write("kind,start_ns,end_ns,graph_node,name\n")
        for s in steps:
            for kind, st, en, name in s:
                f.write(f'{kind},{st},{en},0,"{name}"\n')


class TraceSummaryTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "t.csv")
        shifted = [(k, s + 100 * US, e + 100 * US, n) for k, s, e, n in STEP]
        write_trace(self.path, [STEP, shifted, [("M", 300 * US, 301 * US, "DtoH")]])

    def tearDown(self):
        self.dir.cleanup()

    def test_steps_end_at_the_ids_copy_and_hold_kernels(self):
        steps = summary.split_steps(summary.load(self.path))
        self.assertEqual(len(steps), 2)
        self.assertEqual([len(s) for s in steps], [5, 5])

    def test_charges_sum_to_the_span_under_overlap(self):
        step = summary.split_steps(summary.load(self.path))[0]
        ch = summary.charges(step)
        self.assertEqual(ch, [1 * US, 9 * US, 5 * US, 0, 2 * US])  # c ends inside b: no charge
        self.assertEqual(sum(ch), step[-1][2] - step[0][1])

    def test_short_names(self):
        self.assertEqual(summary.short(STEP[1][3]), "a_kernel<1>")

    def test_command_line_table(self):
        out = subprocess.run([sys.executable, SCRIPT, self.path, "--positions"], check=True, capture_output=True,
                             text=True).stdout
        self.assertIn("2 steps of 5 records: span 17.0 us, kernel durations 25.0 us, host gap between steps 83.0 us",
                      out)
        lines = [l.split() for l in out.splitlines()]
        pos = [l for l in lines if len(l) == 4 and l[0].isdigit()]
        self.assertEqual([p[3] for p in pos], ["[HtoD]", "a_kernel<1>", "b_kernel", "c_kernel", "[DtoH]"])
        self.assertEqual([p[1] for p in pos], ["1.00", "9.00", "5.00", "0.00", "2.00"])


if __name__ == "__main__":
    unittest.main()
