"""Tests of bench/table.py on synthetic raw files (standard library only):

    python3 -m unittest discover -s bench -p 'test_*.py'
"""

import io
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "replicas"))
import rawlines  # noqa: E402 (after the path)
import suitelines  # noqa: E402
import table  # noqa: E402

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


def kv_suite(go_p50=60.0, py_p50=120.0, tail=300.0, rate=1.5e6, slab_gib=100, dial_ms=(180.0, 190.0, 195.0, 170.0),
             host=50.0, restart=120.0, rate16=None, hash_us=50.0, visible_us=30.0, idle_pct=0.1, grow_us=600.0):
    """A suite's KV rows: Go's and Python's match (95 samples at p50, 5 at tail), Go's
    rates, its slab and its replicas' dials, the host tier's GB/s, the restarts (ms),
    issue 25's rows (batch 16's rate, rate16 if given, else rate; the hashes, seal ->
    visible, idle CPU) and issue 30's growth (us)."""
    lines = ["meta kv-slab %d GiB (..., 32 regions of 3.1 GiB) on device 0, mapped by 4 replica processes" % slab_gib,
             "meta kv-grow %d GiB slab (...) from one step of 32 chunks (12 GiB) to its 256, on device 0, mapped by 3 "
             "idle replica processes" % slab_gib]
    lines += result("cudapool", "kv/grow", "us", [grow_us] * 9 + [grow_us * 1.5])
    lines += result("cudapool", "kv/slab", "B", [slab_gib * (1 << 30)])
    lines += result("cudapool", "kv/dial", "ms", list(dial_ms))
    for op in ("kv/host/restore32k", "kv/host/spill"):
        lines += result("cudapool", op, "GB/s", [host, host * 1.02, host * 0.98])
    for impl, p50 in (("cudapool", go_p50), ("python", py_p50)):
        for op in ("kv/match512", "kv/match512+hash"):
            lines += result(impl, op, "us", [p50] * 95 + [tail] * 5)
    for b in (16, 64, 256, 512):
        r = rate16 if b == 16 and rate16 is not None else rate
        lines += result("cudapool", "kv/pages/b%d" % b, "pages/s", [r, r * 1.1, r * 0.9])
    lines += result("cudapool", "kv/hash512", "us", [hash_us] * 10)
    lines += result("cudapool", "kv/visible", "us", [visible_us] * 10)
    lines += result("cudapool", "kv/idle-cpu", "%cpu", [idle_pct])
    lines += result("cudapool", "kv/restart", "ms", [restart, restart * 1.1, restart * 0.9])
    return lines


def replicas_fig(matched=3.0, computed=283.0, pool=9000.0, transformers=8500.0, sealed_pages=2560, greedy=(6, 6),
                 dial_ms=(300.0, 350.0, 390.0), slab="100.0 GiB in 256 chunks of 400 MiB, mapped by 3 replica processes a GPU"):
    """run.py's figures as rawlines.lines takes them (seconds, tok/s, bytes)."""
    kv_per_token = 32768
    return {"run": "3 replicas a GPU on 1 GPU(s)",
            "lengths": {L: {"ttft_matched_s": [matched / 1e3 * L / 32768] * 2,
                            "ttft_computed_s": [computed / 1e3 * L / 32768] * 4,
                            "decode_pool_tok_s": pool, "decode_transformers_tok_s": transformers} for L in (8192, 32768)},
            "bytes": {"sealed": sealed_pages * 16 * kv_per_token, "one-copy": (8192 + 32768) * kv_per_token,
                      "pool": 1.3 * GIB, "private": 3.8 * GIB},
            "pages": {"matched": 5120, "sealed": 2560, "evicted": 0},
            "greedy": greedy, "checks": 20, "failures": [], "dial_ms": list(dial_ms), "slab": slab}


GIB = float(1 << 30)


def kv_verdicts(run):
    return {name: verdict for name, _, verdict in table.kv_targets(run)}


class KVPool(unittest.TestCase):
    def run_of(self, suite, fig=None):
        return table.Run(["meta suite 2"] + suite + (rawlines.lines(fig) if fig else []))

    def test_every_target_met(self):
        run = self.run_of(kv_suite(), replicas_fig())
        self.assertEqual(run.problems, [])
        got = kv_verdicts(run)
        self.assertEqual(len(got), 24)
        self.assertEqual(set(got.values()), {table.MET}, got)
        rows = {r[0]: r[1:] for r in table.kv_rows(run)[1]}
        self.assertEqual(rows["match + lease of 512 pages (8,192 tokens), one round trip, Go"][0],
                         "p50 60.00 us, p99 300.0 us (n=100)")
        self.assertEqual(rows["dial of a replica process, every chunk of that slab mapped, Go"][0],
                         "median 190.0 ms, max 195.0 ms (n=4)")
        self.assertEqual(rows["the Go rows' slab: 100 GiB (..., 32 regions of 3.1 GiB) on device 0, mapped by 4 "
                              "replica processes"][0], "100.0 GiB")
        self.assertEqual(rows["growth of a slab, a chunk from the owner's mapping to every idle replica's, Go: 100 GiB "
                              "slab (...) from one step of 32 chunks (12 GiB) to its 256, on device 0, mapped by 3 idle "
                              "replica processes"][0], "p50 600.0 us, p99 900.0 us (n=10 chunks)")
        self.assertEqual(rows["dial of a replicas example process (Python): 100.0 GiB in 256 chunks of 400 MiB, mapped "
                              "by 3 replica processes a GPU"][0], "median 350.0 ms, max 390.0 ms (n=3)")
        self.assertEqual(rows["time to first token, 32,768-token prompt: matched vs computed"],
                         ["3.00 ms (n=2)", "283.0 ms (n=4)", "1.1%"])
        self.assertEqual(rows["time to first token, 8,192-token prompt: matched vs computed"][2], "1.1%")
        self.assertEqual(rows["decode tokens/s, 8,192-token prompt: pool pages vs transformers' generate "
                              "(DynamicCache)"][2], "105.9%")
        self.assertEqual(rows["the prompts' KV the owner holds sealed vs one copy of it"][2], "100.0%")
        self.assertEqual(rows["the owner's pages matched / sealed / evicted"][0], "5120 / 2560 / 0")
        self.assertEqual(rows["spill of pages to the host tier, over its copies, Go"][0],
                         "50.00 / 49.00 / 49.00 GB/s (median / p10 / min of 3)")
        self.assertEqual(rows["greedy tokens of every request equal to the reference run's"][:2],
                         ["all 6 equal", "all 20 checks passed"])
        names = [n for n, _, _ in table.targets(run)[1]]
        self.assertTrue(set(got) <= set(names), "the KV targets are in the targets list")

    def test_missed(self):
        run = self.run_of(kv_suite(go_p50=101.0, py_p50=151.0, tail=501.0, rate=0.9e6, dial_ms=(900, 1001, 950),
                                   host=40.0, restart=1001.0, rate16=0.2e6, hash_us=70.0, visible_us=60.0,
                                   idle_pct=2.0, grow_us=1001.0),
                          replicas_fig(matched=30.0, pool=8000.0, sealed_pages=2 * 2560, greedy=(5, 6),
                                       dial_ms=(300.0, 401.0)))
        got = kv_verdicts(run)
        self.assertEqual(set(got.values()), {table.MISSED}, got)
        figure = {n: f for n, f, _ in table.kv_targets(run)}[
            "time to first token of a matched 32,768-token prompt at most 10% of computing it (issue 18)"]
        self.assertEqual(figure, "10.6% (30.00 ms vs 283.0 ms); at 8,192 tokens 10.6% (7.50 ms vs 70.75 ms)")

    def test_a_small_slab_misses_the_slab_targets(self):
        got = kv_verdicts(self.run_of(kv_suite(slab_gib=4), replicas_fig()))
        self.assertEqual(got["one GPU's slab of at least 100 GiB mapped by 3 replicas, each dial at most 1 s "
                             "(issue 24)"], table.MISSED)
        self.assertEqual(got["KV match + lease of 512 pages from Go, p50 at most 100 us on the 100 GiB slab "
                             "(issue 24)"], table.MISSED)
        self.assertEqual(got["KV match + lease of 512 pages from Go, p50 at most 100 us (issue 18)"], table.MET)
        self.assertEqual(got["a replica dials a slab of at least 100 GiB, all of it mapped, in at most 200 ms from Go "
                             "(issue 30)"], table.MISSED)
        for slab in ("64.0 GiB in 256 chunks of 256 MiB, mapped by 3 replica processes a GPU", ""):
            got = kv_verdicts(self.run_of(kv_suite(), replicas_fig(dial_ms=(100.0,), slab=slab)))
            self.assertEqual(got["a replica dials a slab of at least 100 GiB, all of it mapped, in at most 400 ms from "
                                 "Python (issue 30)"], table.MISSED, slab or "no meta replicas-slab line")
        got = kv_verdicts(self.run_of(kv_suite(dial_ms=(100.0, 120.0)), replicas_fig()))
        self.assertEqual(got["one GPU's slab of at least 100 GiB mapped by 3 replicas, each dial at most 1 s "
                             "(issue 24)"], table.MISSED, "2 replicas")

    def test_not_run_without_the_replicas_lines(self):
        run = self.run_of(kv_suite())
        got = kv_verdicts(run)
        model = [n for n in got if "KV match" not in n and "pages/s" not in n and "GB/s" not in n
                 and "(issue 25)" not in n and "restarted" not in n and ("slab" not in n or "from Python" in n)]
        self.assertEqual(len(model), 6)
        for n in model:
            self.assertEqual(got[n], table.NO_LINES, n)
        for n in set(got) - set(model):
            self.assertEqual(got[n], table.MET, n)
        rows = {r[0]: r[1:] for r in table.kv_rows(run)[1]}
        self.assertTrue(rows["time to first token, 32,768-token prompt: matched vs computed"][0].startswith("not run"))

    def test_a_failed_host_tier_part_fails_its_rows(self):
        run = self.run_of(["fail suite gosuite-kvtier timed out after 90s: "])
        got = kv_verdicts(run)
        self.assertEqual(got["spill to the host tier at least 45 GB/s (issue 24)"], table.FAILED)
        self.assertEqual(got["restore of a 32,768-token prompt from the host tier (2,048 pages, 1 GiB), bytes checked "
                             "at least 45 GB/s (issue 24)"], table.FAILED)

    def test_a_failed_part_is_a_failure_not_a_row_not_run(self):
        run = self.run_of(["fail suite kvbench exit status 1: no kvpoold", "fail cudapool kv owner did not start"])
        got = kv_verdicts(run)
        self.assertEqual(got["KV match + lease of 512 pages from Python, p50 at most 150 us (issue 18)"], table.FAILED)
        self.assertEqual(got["KV match + lease of 512 pages from Go, p99 at most 500 us (issue 18)"], table.FAILED)
        self.assertEqual(got["KV pages/s through alloc + seal + match + release, batch 64, 4 replicas, at least "
                             "1,000,000 (issue 18)"], table.FAILED)
        rows = {r[0]: r[1] for r in table.kv_rows(run)[1]}
        self.assertEqual(rows["match + lease of 512 pages (8,192 tokens), one round trip, Python"],
                         "FAIL: exit status 1: no kvpoold")

    def test_a_replicas_run_that_stopped_fails_its_rows(self):
        run = self.run_of(kv_suite(), {"run": "x", "checks": 1, "failures": [], "stopped": "RuntimeError: no answer"})
        got = kv_verdicts(run)
        self.assertEqual(got["decode tokens/s over pool pages at least transformers' own generate (DynamicCache), "
                             "8,192 tokens (issues 18, 26)"], table.FAILED)
        self.assertIn("replicas all: RuntimeError: no answer", table.failures(run))


def hf_lines(matched=6.0, computed=280.0, pool=400.0, compiled=200.0, equal=(1, 1, 1, 1)):
    """examples/hf/check.py's lines for both architectures (ms, tok/s, steps)."""
    out = ["meta hf-run transformers 5.17.0 on 1x NVIDIA H200", "meta hf-new 64", "meta hf-checks all 50 checks passed"]
    k = 0
    for arch in ("llama", "qwen3"):
        for L in (8192, 32768):
            out += suitelines.lines("hf", "ttft/matched/%s/%d" % (arch, L), "ms", [matched * L / 32768])
            out += suitelines.lines("hf", "ttft/computed/%s/%d" % (arch, L), "ms", [computed * L / 32768])
            out += suitelines.lines("hf", "decode/pool/%s/%d" % (arch, L), "tok/s", [pool])
            out += suitelines.lines("hf", "decode/transformers/%s/%d/dynamic" % (arch, L), "tok/s", [15.0])
            out += suitelines.lines("hf", "greedy-equal/%s/%d" % (arch, L), "bool", [float(equal[k])])
            out += suitelines.lines("hf", "argmax-equal/%s/%d" % (arch, L), "steps", [64.0 if equal[k] else 50.0])
            k += 1
        out += suitelines.lines("hf", "decode/transformers/%s/32768/static-compiled" % arch, "tok/s", [compiled])
    return out


def hf_verdicts(run):
    return {name: (figure, verdict) for name, figure, verdict in table.hf_targets(run)}


class HF(unittest.TestCase):
    def test_every_target_met(self):
        run = table.Run(["meta suite 2"] + hf_lines())
        self.assertEqual(run.problems, [])
        got = hf_verdicts(run)
        self.assertEqual(len(got), 5)
        self.assertEqual({v for _, v in got.values()}, {table.MET}, got)
        fig, _ = got["Llama 0.85B: decode tokens/s over pool pages at 32k at least transformers' fastest own path "
                     "(issue 26)"]
        self.assertEqual(fig, "200.0% (400.0 vs 200.0 tok/s, StaticCache + torch.compile; measured: DynamicCache, "
                              "sdpa 15.00; StaticCache + torch.compile 200.0)")
        rows = {r[0]: r[1:] for r in table.hf_rows(run)[1]}
        self.assertEqual(rows["Qwen3-like 1.1B: time to first token, 32,768-token prompt: matched vs computed"],
                         ["6.00 ms", "280.0 ms", "2.1%"])
        self.assertEqual(rows["Llama 0.85B: greedy tokens, 8,192-token prompt, against transformers' generate "
                              "(DynamicCache)"], ["equal", "fed its tokens, argmax equal at 64 of 64 steps, the "
                                                  "others near-ties", "-"])

    def test_missed(self):
        run = table.Run(["meta suite 2"] + hf_lines(matched=20.0, pool=150.0, equal=(1, 0, 1, 1)))
        got = hf_verdicts(run)
        self.assertEqual({v for _, v in got.values()}, {table.MISSED}, got)
        fig, _ = got["greedy tokens equal to transformers' generate, both architectures, 8k and 32k (issue 26)"]
        self.assertTrue(fig.startswith("equal in 3 of 4; fed transformers' tokens, argmax equal at 64 of 64, "
                                       "50 of 64, 64 of 64, 64 of 64 steps"), fig)

    def test_not_run_without_its_lines(self):
        got = hf_verdicts(table.Run(["meta suite 2"]))
        self.assertEqual({v for _, v in got.values()}, {table.NO_LINES}, got)


class Markdown(unittest.TestCase):
    def main(self, files, *args):
        d = tempfile.mkdtemp()
        paths = []
        for i, lines in enumerate(files):
            paths.append(os.path.join(d, "raw%d" % i))
            with open(paths[-1], "w") as f:
                f.write("\n".join(lines) + "\n")
        md = os.path.join(d, "RESULTS.md")
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            rc = table.main(paths + ["--md", md] + list(args))
        text = None
        if os.path.exists(md):
            with open(md) as f:
                text = f.read()
        return rc, text, out.getvalue(), err.getvalue()

    def test_two_raw_files_make_one_results_file(self):
        suite = ["meta suite 2", "meta date 2026-12-01 21:00 UTC"] + kv_suite()
        rc, text, out, _ = self.main([suite, rawlines.lines(replicas_fig()), hf_lines()])
        self.assertEqual(rc, 0, out)
        self.assertTrue(text.startswith("# Performance\n"))
        self.assertIn("## Stock transformers models over the pool (issue 26)", text)
        self.assertIn("come from one run of examples/hf/check.py (scripts/gpu-examples.sh): transformers 5.17.0", text)
        self.assertIn("## KV page pool (issue 18)", text)
        self.assertIn("| time to first token, 32,768-token prompt: matched vs computed | 3.00 ms (n=2) | "
                      "283.0 ms (n=4) | 1.1% |", text)
        self.assertIn("same build: 3 replicas a GPU on 1 GPU(s).", text)
        self.assertNotIn(table.NO_LINES, text)
        self.assertIn("== KV page pool (issue 18)", out)

    def test_one_concatenated_file_is_the_same(self):
        suite = ["meta suite 2"] + kv_suite()
        _, two, _, _ = self.main([suite, rawlines.lines(replicas_fig())])
        _, one, _, _ = self.main([suite + rawlines.lines(replicas_fig())])
        self.assertEqual(one, two)

    def test_the_readme_option_is_gone(self):
        rc, text, _, err = self.main([["meta suite 2"]], "--readme", "README.md")
        self.assertEqual((rc, text), (2, None))
        self.assertIn("unknown option --readme", err)

    def test_a_raw_file_with_problems_exits_1(self):
        rc, text, _, _ = self.main([ring(lambda r, b: 0.65, lambda c: 0.7, go_bytes=1)])
        self.assertEqual(rc, 1)
        self.assertIn("## What failed in this run", text)


if __name__ == "__main__":
    unittest.main()
