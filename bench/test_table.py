"""Tests of bench/table.py on synthetic raw files (standard library only):

    python3 -m unittest discover -s bench -p 'test_*.py'
"""

import io
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import table  # noqa: E402 (after the path)

OP = "alloc/ipc/1MiB"


def ring(c_of, go_of, core_of=None, rounds=2, batches=10, op=OP, go_bytes=2097152):
    """Raw lines of an allocation ring: in each round and batch C, then Go, then cuda.core
    take a turn; c_of(round, batch) is C's time, go_of(c) Go's beside it."""
    lines = ["meta suite 2", "bytes c %s 2097152" % op, "bytes cudapool %s %d" % (op, go_bytes),
             "bytes cudacore %s 2097152" % op]
    turn = 0
    for r in range(rounds):
        for b in range(batches):
            c = c_of(r, b)
            lines.append("sample c api %s %d %d %d %.4f" % (op, r, b, turn, c))
            lines.append("sample cudapool api %s %d %d %d %.4f" % (op, r, b, turn + 1, go_of(c)))
            if core_of:
                lines.append("sample cudacore api %s %d %d %d %.4f" % (op, r, b, turn + 2, core_of(c)))
            turn += 3
    return lines


def verdicts(run):
    return {name: (figure, verdict) for name, figure, verdict in table.targets(run)[1]}


def alloc_target(run, op=OP, bar="1.3x C (issue 6)"):
    name = "alloc+free, %s, at most %s" % (table.alloc_label(op), bar)
    return verdicts(run)[name]


class AllocRing(unittest.TestCase):
    def test_fast_against_fast(self):
        # C alternates between its states batch by batch; Go is 1.5x C in either.
        run = table.Run(ring(lambda r, b: 0.65 if b % 2 else 1.2, lambda c: 1.5 * c,
                             lambda c: 4.5 * c))
        self.assertEqual(run.problems, [])
        figure, verdict = alloc_target(run)
        self.assertEqual(verdict, table.MISSED)
        self.assertIn("1.50 x C", figure)
        self.assertIn("fast state, 10 batch pairs", figure)
        figure, verdict = verdicts(run)["alloc+free, exportable pool 1MiB, 2.5x faster than cuda.core (issue 6)"]
        self.assertEqual(verdict, table.MET)
        self.assertIn("3.00 x faster", figure)

    def test_never_met_when_the_fair_pair_misses(self):
        # Mostly slow C: the medians say 1.08x (within 1.3x), fast against fast says 1.54x.
        run = table.Run(ring(lambda r, b: 0.65 if b < 3 else 1.2, lambda c: 1.0 if c < 1 else 1.3))
        row = table.AllocRow(run, OP, "cudapool", "api")
        self.assertLess(table.median(row.values) / table.median(row.c_values), 1.3)
        figure, verdict = alloc_target(run)
        self.assertEqual(verdict, table.MISSED)
        self.assertIn("1.54 x C", figure)

    def test_slow_against_slow_where_no_fast_neighbour(self):
        # C shows both states (fast in odd batches), but Go ran only beside slow ones.
        lines = ring(lambda r, b: 0.65 if b % 2 else 1.2, lambda c: 1.1 * c)
        run = table.Run([l for l in lines if not (l.startswith("sample cudapool") and int(l.split()[5]) % 2)])
        self.assertEqual(run.problems, [])
        figure, verdict = alloc_target(run)
        self.assertEqual(verdict, table.MET)
        self.assertIn("1.10 x C", figure)
        self.assertIn("slow state, 10 batch pairs", figure)

    def test_one_state_compares_neighbours(self):
        run = table.Run(ring(lambda r, b: 1.0 + 0.01 * b, lambda c: 1.2 * c))
        figure, verdict = alloc_target(run)
        self.assertEqual(verdict, table.MET)
        self.assertIn("one state", figure)

    def test_different_bytes_are_a_problem_and_no_verdict(self):
        run = table.Run(ring(lambda r, b: 0.65, lambda c: 0.7, go_bytes=1048576))
        self.assertTrue(any("different bytes" in p for p in run.problems), run.problems)
        figure, verdict = alloc_target(run)
        self.assertEqual(verdict, table.FAILED)
        self.assertIn("bytes differ", figure)

    def test_a_go_batch_without_its_c_neighbour_is_a_problem(self):
        lines = [l for l in ring(lambda r, b: 0.65, lambda c: 0.7) if not l.startswith("sample c api %s 1 3 " % OP)]
        run = table.Run(lines)
        self.assertEqual(run.problems, ["cudapool api %s round 1 batch 3: no C batch beside it" % OP])

    def test_a_neighbour_far_away_is_a_problem(self):
        lines = ring(lambda r, b: 0.65, lambda c: 0.7)
        lines = [l.replace("sample cudapool api %s 0 0 1 " % OP, "sample cudapool api %s 0 0 9 " % OP) for l in lines]
        run = table.Run(lines)
        self.assertTrue(any("9 turns away" in p for p in run.problems), run.problems)


def result(impl, op, unit, v):
    v = sorted(v)
    return ["result %s %s %s %.4f %.4f %d" % (impl, op, unit, v[len(v) // 2], v[int(0.9 * (len(v) - 1) + 0.5)], len(v)),
            "raw %s %s %s %s" % (impl, op, unit, " ".join("%.4f" % x for x in v))]


class Sharing(unittest.TestCase):
    def test_latency_statistics_come_from_the_samples(self):
        v = [20.0] * 98 + [30.0, 5000.0]
        run = table.Run(["meta suite 2"] + result("cudapool", "open/exported", "us", v))
        st = run.stats("cudapool", "open/exported")
        self.assertEqual((st.median, st.p99, st.max, st.n), (20.0, 30.0, 5000.0, 100))
        self.assertAlmostEqual(st.mean, (98 * 20 + 30 + 5000) / 100)
        figure, verdict = verdicts(run)["open of an exported buffer, p50 at most 25 us (issue 11)"]
        self.assertEqual(verdict, table.MET)
        self.assertIn("mean 69.90, p99 30.00, max 5,000", figure)

    def test_a_result_its_samples_contradict_is_a_problem(self):
        lines = ["meta suite 2", "result c release us 20.0 22.0 3", "raw c release us 1 2 3"]
        run = table.Run(lines)
        self.assertEqual(len(run.problems), 1)
        self.assertIn("the samples give", run.problems[0])

    def test_another_suite_version_is_a_problem(self):
        run = table.Run(result("c", "release", "us", [1, 2, 3]))
        self.assertTrue(any("suite version" in p for p in run.problems), run.problems)

    def test_import_needs_the_same_n(self):
        run = table.Run(["meta suite 2"] + result("cudart", "import/pair", "us", [1.0] * 3) +
                        result("c", "import/pair", "us", [1.0] * 15))
        figure, verdict = verdicts(run)["import within 1.5x C, both the bare binding, same N and statistic (issue 6)"]
        self.assertEqual(verdict, table.FAILED)
        self.assertIn("different N", figure)

    def test_absent_features_are_not_run(self):
        run = table.Run(["meta suite 2", "absent cudapool block/64KiB/b64 batched leases are not on main"])
        figure, verdict = verdicts(run)["block shares/s, 64 KiB, batch 64, 4 consumers, at least 250,000/s (issue 11)"]
        self.assertEqual((figure, verdict), ("batched leases are not on main", table.NOT_RUN))
        rows = dict((r[0], r[2]) for r in table.feature_rows(run)[1])
        self.assertEqual(rows["block shares/s, 64 KiB of a 1 GiB slab, batch 64, 4 consumers (issue 11)"],
                         "not run (feature absent)")
        self.assertEqual(rows["block lease latency (open), 64 KiB, the consumer holding one block (issue 11)"],
                         "not reported")

    def test_a_one_gpu_host_does_not_run_the_other_gpu_rows(self):
        run = table.Run(["meta suite 2", "needs cudapool read/other-gpu 2", "needs c read/other-gpu 2",
                         "needs c copy/other-gpu 2"] + result("c", "read/same-gpu", "GB/s", [1.0] * 3))
        self.assertEqual(run.problems, [])
        figure, verdict = verdicts(run)["other-GPU read at least 95% of C (issue 6)"]
        self.assertEqual((figure, verdict), ("needs 2 GPUs", table.NEEDS_GPUS))
        rows = dict((r[0], (r[2], r[3])) for r in table.sharing_rows(run)[1])
        self.assertEqual(rows["read of an imported buffer, other GPU"],
                         ("not run (needs 2 GPUs)", "not run (needs 2 GPUs)"))
        self.assertEqual(rows["plain device copy, other GPU"][1], "not run (needs 2 GPUs)")
        self.assertEqual(table.failures(run), [], "a row not run is no failure")

    def test_a_needs_line_without_a_count_is_a_problem(self):
        run = table.Run(["meta suite 2", "needs cudapool read/other-gpu two"])
        self.assertEqual(len(run.problems), 1, run.problems)

    def test_a_validating_run_that_missed_buffers_is_a_problem(self):
        run = table.Run(["meta suite 2", "validated cudapool all 10 12"])
        self.assertEqual(run.problems, ["cudapool's consumers validated 10 of the 12 buffers they were given"])


class Readme(unittest.TestCase):
    def readme(self, raw_lines):
        d = tempfile.mkdtemp()
        raw, readme = os.path.join(d, "raw"), os.path.join(d, "README.md")
        with open(raw, "w") as f:
            f.write("\n".join(raw_lines) + "\n")
        with open(readme, "w") as f:
            f.write("# x\n\n## Performance\n\nold figures\n\n## Next\n\nkept\n")
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            rc = table.main([raw, "--readme", readme])
        with open(readme) as f:
            return rc, f.read()

    def test_the_section_is_replaced(self):
        rc, text = self.readme(ring(lambda r, b: 0.65, lambda c: 0.7))
        self.assertEqual(rc, 0)
        self.assertNotIn("old figures", text)
        self.assertIn("### Targets", text)
        self.assertTrue(text.startswith("# x\n\n## Performance\n"))
        self.assertIn("\n## Next\n\nkept\n", text)

    def test_a_raw_file_with_problems_leaves_the_readme(self):
        rc, text = self.readme(ring(lambda r, b: 0.65, lambda c: 0.7, go_bytes=1))
        self.assertEqual(rc, 1)
        self.assertIn("old figures", text)


if __name__ == "__main__":
    unittest.main()
