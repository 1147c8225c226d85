"""Tests of examples/replicas/rawlines.py, the lines run.py --raw appends (no torch):

    python3 -m unittest discover -s bench -p 'test_*.py'
"""

import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "replicas"))
import rawlines  # noqa: E402 (after the path)
import table  # noqa: E402


def fig():
    return {"run": "3 replicas a GPU\non 1 GPU(s)",
            "lengths": {32768: {"ttft_matched_s": [0.004, 0.002], "ttft_computed_s": [0.283, 0.290, 0.280],
                                "decode_pool_tok_s": 450.0, "decode_transformers_tok_s": 480.0},
                        8192: {"ttft_matched_s": [0.001], "ttft_computed_s": [0.044]}},
            "bytes": {"sealed": 1 << 30, "one-copy": 1 << 30, "pool": 3 << 29, "private": 3 << 30},
            "pages": {"matched": 4096, "sealed": 2560, "evicted": 7},
            "dial_ms": [120.0, 140.0, 130.0], "slab": "64.0 GiB in 256 chunks of 256 MiB, mapped by 3\nreplica processes a GPU",
            "greedy": (6, 6), "checks": 9, "failures": []}


class Lines(unittest.TestCase):
    def test_the_table_reads_every_figure(self):
        lines = rawlines.lines(fig())
        run = table.Run(["meta suite 2"] + lines)
        self.assertEqual(run.problems, [])
        m = run.stats("replicas", "ttft/matched/32768")
        self.assertEqual((m.unit, m.v), ("ms", [2.0, 4.0]))
        self.assertEqual(run.stats("replicas", "ttft/computed/32768").median, 283.0)
        self.assertEqual(run.stats("replicas", "ttft/computed/8192").v, [44.0])
        self.assertEqual(run.stats("replicas", "decode/pool/32768").v, [450.0])
        self.assertEqual(run.stats("replicas", "decode/transformers/32768").unit, "tok/s")
        self.assertIsNone(run.stats("replicas", "decode/pool/8192"), "a length without decode figures has no row")
        self.assertEqual(run.stats("replicas", "kv-bytes/private").v, [float(3 << 30)])
        self.assertEqual(run.stats("replicas", "pages/evicted").v, [7.0])
        self.assertEqual(run.meta["replicas-run"], "3 replicas a GPU on 1 GPU(s)")
        self.assertEqual(run.stats("replicas", "dial").v, [120.0, 130.0, 140.0])
        self.assertEqual(run.meta["replicas-slab"], "64.0 GiB in 256 chunks of 256 MiB, mapped by 3 replica processes a GPU")
        self.assertEqual(table.replicas_slab_gib(run), 64.0)
        self.assertEqual(run.meta["replicas-greedy"], "all 6 equal")
        self.assertEqual(run.meta["replicas-checks"], "all 9 checks passed")
        self.assertEqual(run.fails, {})
        self.assertTrue(all(l.split()[1] == "replicas" for l in lines if not l.startswith("meta ")))

    def test_the_slab_line_is_what_the_table_reads(self):
        g = {"slab_bytes": 100 << 30, "chunks": 256, "chunk_bytes": 400 << 20, "pages": 204800}
        text = rawlines.slab(g, 6)
        self.assertEqual(text, "100.0 GiB in 256 chunks of 400 MiB, mapped by 6 replica processes a GPU")
        run = table.Run(["meta suite 2"] + rawlines.lines({"slab": text}))
        self.assertEqual(run.problems, [])
        self.assertEqual(table.replicas_slab_gib(run), 100.0)

    def test_failed_checks_and_a_stopped_run(self):
        f = {"checks": 4, "failures": ["a: greedy tokens\ndiffer", "b"], "greedy": (5, 6),
             "stopped": "RuntimeError: replica 1: no answer in 180 s",
             "lengths": {8192: {"ttft_matched_s": [], "ttft_computed_s": [0.044]}}}
        lines = rawlines.lines(f)
        self.assertIn("meta replicas-checks 2 of 4 checks FAILED", lines)
        self.assertIn("meta replicas-greedy 5 of 6 equal", lines)
        self.assertIn("fail replicas check/1 a: greedy tokens differ", lines)
        self.assertIn("fail replicas check/2 b", lines)
        self.assertIn("fail replicas ttft/matched/8192 no samples", lines)
        self.assertEqual(lines[-1], "fail replicas all RuntimeError: replica 1: no answer in 180 s")
        run = table.Run(["meta suite 2"] + lines)
        self.assertEqual(run.problems, [])
        self.assertEqual(run.failed("replicas", "decode/pool/8192"), "RuntimeError: replica 1: no answer in 180 s")

    def test_nothing_measured_says_nothing(self):
        self.assertEqual(rawlines.lines({}), [])

    def test_append_keeps_what_the_file_had(self):
        d = tempfile.mkdtemp()
        path = os.path.join(d, "replicas-raw.txt")
        with open(path, "w") as f:
            f.write("meta suite 2\n")
        rawlines.append(path, {"run": "x"})
        rawlines.append(path, {"checks": 1, "failures": []})
        with open(path) as f:
            self.assertEqual(f.read(), "meta suite 2\nmeta replicas-run x\nmeta replicas-checks all 1 checks passed\n")


if __name__ == "__main__":
    unittest.main()
