"""Tests of the KV page pool from Python (cudapool.kv): a kvpoold owner process started
by each test ($CUDAPOOL_KVPOOLD, which capi's TestPythonPackage builds), replicas in
this process and in spawned ones, on the software device where no GPU is."""

import ctypes
import json
import multiprocessing
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
import unittest
from array import array

from helpers import CHILD_TIMEOUT, HERE, REQUIRE_GPU, can_stall, cudapool, failure, result_of, spawn, stall_stream, wait_go

from cudapool import _lib, kv

KVPOOLD = os.environ.get("CUDAPOOL_KVPOOLD")
ROOT = os.path.dirname(os.path.dirname(HERE))
LAYOUT = "llama-0.85b"  # 16 layers, 8 KV heads, head dim 64, bf16, 16 tokens per page
T = 16


def setUpModule():
    cudapool.init(os.environ["CUDAPOOL_RUNTIME"])


def need_kvpoold():
    if not KVPOOLD:
        if REQUIRE_GPU:
            raise AssertionError("CUDAPOOL_REQUIRE_GPU=1 but CUDAPOOL_KVPOOLD is not set")
        raise unittest.SkipTest("CUDAPOOL_KVPOOLD is not set (capi's TestPythonPackage sets it)")


def runtime_flag():
    """The runtime kvpoold runs on: the one this process chose."""
    on_gpu, _, _ = cudapool.runtime_info()
    return "gpu" if on_gpu else "test"


class Owner:
    """A kvpoold process serving a fresh directory; its log is in dir/kvpoold.log. Its
    slab maps chunks of the device's granularity (kvpoold's default for small
    slabs)."""

    def __init__(self, pages=64, layout=LAYOUT):
        need_kvpoold()
        os.makedirs(os.environ["CUDAPOOL_DIR"], exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="kv-", dir=os.environ["CUDAPOOL_DIR"])
        self.serve = os.path.join(self.dir, "owner")
        self.log_path = os.path.join(self.dir, "kvpoold.log")
        self.log = open(self.log_path, "wb")
        self.args = [KVPOOLD, "-dir", self.serve, "-layout", layout, "-pages", str(pages), "-devices", "0",
                     "-runtime", runtime_flag()]
        self.keepers = set()
        self.start()

    def start(self):
        """Starts kvpoold (again) on the directory."""
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)

    def first_line(self, after=0):
        """kvpoold's first line after offset after of its log, once it is there; the
        keeper it names is killed at stop."""
        def line():
            out = self.output()[after:]
            for l in out.splitlines():
                if l.startswith("kvpoold: serving"):
                    return l
            if self.proc.poll() is not None:
                raise AssertionError("kvpoold exited with %s:\n%s" % (self.proc.returncode, out))
            return None
        deadline = time.monotonic() + CHILD_TIMEOUT
        while (l := line()) is None:
            if time.monotonic() > deadline:
                raise AssertionError("kvpoold said nothing:\n%s" % self.output())
            time.sleep(0.005)
        words = l.split("keeper pid ")
        if len(words) > 1:
            self.keepers.add(int(words[1].split(":")[0].split()[0]))
        return l

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def replica(self, **kw):
        kw.setdefault("wait_for_owner", True)
        kw.setdefault("timeout", CHILD_TIMEOUT)
        try:
            return kv.Replica(self.serve, **kw)
        except Exception as e:
            raise AssertionError("dialing kvpoold: %s\nkvpoold's log:\n%s" % (e, self.output())) from e

    def kill(self):
        """SIGKILLs kvpoold, not its keeper: the slab survives it."""
        self.proc.kill()
        self.proc.wait(CHILD_TIMEOUT)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(CHILD_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(CHILD_TIMEOUT)
        # A kvpoold that was killed left its keeper (the slab's process): end it too.
        self.first_line_if_any()
        for pid in self.keepers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()

    def first_line_if_any(self):
        for l in self.output().splitlines():
            words = l.split("keeper pid ")
            if l.startswith("kvpoold: serving") and len(words) > 1:
                self.keepers.add(int(words[1].split(":")[0].split()[0]))


def pattern(n, seed):
    return bytes((i * 13 + seed * 7 + 1) & 0xFF for i in range(n))


def page_addr(r, layer, kv_index, page):
    return r.layer_ptrs(layer)[kv_index] + page * r.geometry.page_bytes


# The bytes a test writes: a few blocks of a page, not all of it (the software device
# copies byte by byte through memfds, and a page is 16 KiB per layer and K or V).
SPOTS = [(0, 0), (0, 1), (7, 0), (15, 1)]  # (layer, 0 for K or 1 for V)
SPOT = 512


def write_pages(r, pages, seed, stream=None):
    for i, p in enumerate(pages):
        for layer, which in SPOTS:
            cudapool.copy_to_device(r.device, page_addr(r, layer, which, p), pattern(SPOT, seed + i), stream)


def read_pages(r, pages, seed):
    """Whether pages hold what write_pages(seed) wrote, page by page."""
    ok = []
    for i, p in enumerate(pages):
        ok.append(all(cudapool.copy_from_device(r.device, page_addr(r, layer, which, p), SPOT) ==
                      pattern(SPOT, seed + i) for layer, which in SPOTS))
    return ok


def tokens(n, seed):
    return [(seed * 1000003 + i * 7919) % 128000 for i in range(n)]


def reader(q, serve, hashes, seed, namespace):
    """A replica process: matches hashes, reads the pages back, releases."""
    try:
        with kv.Replica(serve, namespace=namespace, timeout=CHILD_TIMEOUT) as r:
            l = r.match(hashes)
            ok = read_pages(r, l.pages, seed)
            r.release(l)
            q.put({"n": len(l), "ok": ok, "pages": list(l.pages), "writable": l.writable,
                   "own": r.hashes(tokens(len(hashes) * T, seed)) == hashes})
    except Exception as e:
        q.put(failure(e))


def lease_holder(q, serve, n, go):
    """A replica process that allocs n pages, says which, and holds them until go."""
    try:
        r = kv.Replica(serve, timeout=CHILD_TIMEOUT)
        l = r.alloc(n)
        q.put({"id": l.id, "pages": list(l.pages)})
        wait_go(go)
        r.release(l)
        r.close()
        q.put("released")
    except Exception as e:
        q.put(failure(e))


def close_holding(q, serve, n):
    """A replica process that allocs n pages and closes without releasing them."""
    try:
        r = kv.Replica(serve, timeout=CHILD_TIMEOUT)
        r.alloc(n)
        r.close()
        r.close()
        try:
            r.alloc(1)
            closed = "no error"
        except cudapool.CudapoolError as e:
            closed = type(e).__name__
        q.put({"closed_alloc": closed, "error": r.error})
    except Exception as e:
        q.put(failure(e))


def dying_writer(q, serve, n, seed):
    """A replica process that allocs n pages, writes them, seals the first half (seed's
    tokens) and waits to be killed holding the rest unsealed."""
    try:
        r = kv.Replica(serve, timeout=CHILD_TIMEOUT)
        l = r.alloc(n)
        write_pages(r, l.pages, seed)
        sealed = kv.Lease(l.id, l.pages, True)
        half = r.hashes(tokens(n // 2 * T, seed))
        rest = r.alloc(n - n // 2)
        write_pages(r, rest.pages, seed + 1000)
        r.seal(sealed, half, wait=True)  # frees nothing: the lease had n pages, half sealed
        q.put("written")
        time.sleep(CHILD_TIMEOUT)
    except Exception as e:
        q.put(failure(e))


def dying_sealer(q, serve, n, seed):
    """A replica process that holds a stream of its own, writes n pages on it and seals
    them there: the seal stays pending (the stream's work cannot complete) while it waits
    to be killed."""
    try:
        r = kv.Replica(serve, timeout=CHILD_TIMEOUT)
        s = cudapool.Stream(0)
        stall_stream(None, s)
        l = r.alloc(n)
        write_pages(r, l.pages, seed, s)
        res = r.seal(l, r.hashes(tokens(n * T, seed)), stream=s)
        q.put(("pending", res.visible))
        time.sleep(CHILD_TIMEOUT)
    except Exception as e:
        q.put(failure(e))


def result_of_put(test, p, q):
    """The first thing p put on q, failing test if none came in time or it failed."""
    try:
        r = q.get(timeout=CHILD_TIMEOUT)
    except Exception:
        test.fail("child process gave no result in %d s (exit code %s)" % (CHILD_TIMEOUT, p.exitcode))
    if isinstance(r, str) and r.startswith("error:"):
        test.fail("child process failed: " + r)
    return r


def eventually(test, what, f, timeout=CHILD_TIMEOUT):
    """f()'s first true value, trying until timeout; fails test saying what it waited for."""
    deadline = time.monotonic() + timeout
    while True:
        v = f()
        if v:
            return v
        if time.monotonic() > deadline:
            test.fail("waited %d s for %s" % (timeout, what))
        time.sleep(0.005)


class PrefixHashTest(unittest.TestCase):
    """The pure-Python reference of the prefix hashes; no owner needed."""

    def test_fixed_vectors(self):
        # Pinned here too, so that the reference and testdata cannot drift together.
        self.assertEqual(kv.root("").hex(), "33fbf7215ae8bdbba6ff4b8fdd79c194")
        h = kv.prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
        self.assertEqual([x.hex() for x in h], ["35b8a3bdb29162483d14958d09c9b648", "42de7ecc30277d5cb6586e5fb32b4cd5"])
        h = kv.prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "llama")
        self.assertEqual([x.hex() for x in h], ["2c9c15a3101940859a7ed1fbb0d79a9f", "343f7461d259a2511a69e4a8645f3fdd"])

    def test_testdata_vectors(self):
        with open(os.path.join(ROOT, "kv", "testdata", "hashes.json")) as f:
            v = json.load(f)
        self.assertTrue(v["roots"] and v["cases"])
        for r in v["roots"]:
            self.assertEqual(kv.root(r["namespace"]).hex(), r["root"], r["namespace"])
        for c in v["cases"]:
            with self.subTest(ns=c["namespace"], t=c["tokens_per_page"], n=len(c["tokens"])):
                got = kv.prefix_hashes(c["tokens"], c["tokens_per_page"], c["namespace"])
                self.assertEqual([x.hex() for x in got], c["hashes"])
                self.assertEqual(kv.prefix_hashes(array("i", c["tokens"]), c["tokens_per_page"], c["namespace"]),
                                 got, "an array('i') of the tokens")
                ref = kv.prefix_hashes(c["tokens"], c["tokens_per_page"], c["namespace"], reference=True)
                self.assertEqual([x.hex() for x in ref], c["hashes"], "the hashlib reference")

    def test_partial_page_and_prefix(self):
        t = tokens(5 * T + 3, 1)
        h = kv.prefix_hashes(t, T)
        self.assertEqual(len(h), 5, "the trailing partial page has no hash")
        self.assertEqual(kv.prefix_hashes(t[:3 * T], T), h[:3], "a prefix's hashes are the prefix of the hashes")
        self.assertNotEqual(kv.prefix_hashes(t, T, "other"), h, "another namespace")
        self.assertEqual(kv.prefix_hashes([], T), [])

    def test_bad_input(self):
        for bad in (0, -1, 1.5, True):
            with self.subTest(tokens_per_page=bad), self.assertRaises(ValueError):
                kv.prefix_hashes([1] * 16, bad)
        with self.assertRaises(ValueError):
            kv.prefix_hashes([1 << 31] * 16, 16)
        with self.assertRaises(TypeError):
            kv.prefix_hashes("abcd", 2)
        with self.assertRaises(TypeError):
            kv.prefix_hashes([1, 2], 2, namespace=3)

    def test_hashes_cannot_change(self):
        h = kv.prefix_hashes(tokens(4 * T, 2), T)
        self.assertIsInstance(h, list)
        self.assertEqual(h.raw, b"".join(h))
        for f in (lambda: h.append(b"x" * 16), lambda: h.__setitem__(0, b"x" * 16), h.sort, h.clear):
            with self.assertRaises(TypeError):
                f()
        self.assertEqual(h[1:3].raw, b"".join(list(h)[1:3]), "a slice carries its own bytes")
        self.assertEqual(h[::2], list(h)[::2])


class TimeoutTest(unittest.TestCase):
    def test_zero_does_not_wait_for_an_owner(self):
        """timeout=0 is "do not wait" (Python's convention), not "no bound"."""
        d = tempfile.mkdtemp(prefix="kv-nobody-")
        got = []

        def dial():
            try:
                kv.Replica(d, wait_for_owner=True, timeout=0).close()
                got.append("dialed")
            except Exception as e:
                got.append(e)

        t = threading.Thread(target=dial, daemon=True)
        t.start()
        t.join(10)
        self.assertFalse(t.is_alive(), "timeout=0 waited for an owner 10 s")
        self.assertIsInstance(got[0], cudapool.Gone, "no owner is there: at once, as without wait_for_owner")

    def test_calls_default_to_the_replicas_timeout(self):
        self.assertIs(kv.Replica.alloc.__defaults__[-1], kv.REPLICA_TIMEOUT)
        self.assertIn("replica's timeout", repr(kv.REPLICA_TIMEOUT))


class ReplicaTest(unittest.TestCase):
    """One owner of 64 pages per test; replicas here and in child processes."""

    def setUp(self):
        self.owner = Owner(pages=64)
        self.addCleanup(self.owner.stop)
        self.r = self.owner.replica()
        self.addCleanup(self.r.close)

    def test_geometry_and_slab(self):
        g = self.r.geometry
        self.assertEqual(g, kv.Geometry(layers=16, kv_heads=8, head_dim=64, dtype="bf16", tokens_per_page=16,
                                        pages=64))
        self.assertEqual(g.page_bytes, 16 * 8 * 64 * 2)
        self.assertEqual(g.page_span_bytes, 16 * 2 * g.page_bytes, "a page in every layer's K and V")
        self.assertEqual(g.slab_bytes, g.pages * g.page_span_bytes)
        self.assertEqual(g.tensor_bytes, 64 * g.page_bytes)
        # 32 tensors of 1 MiB, each a region of 2 MiB of addresses (a chunk of the
        # software device's granularity).
        regions = self.r.regions
        self.assertEqual([x.size for x in regions], [2 << 20] * 32)
        self.assertTrue(all(x.ptr for x in regions))
        self.assertEqual(len({x.ptr for x in regions}), 32, "a range of its own per tensor")
        for layer in range(g.layers):
            for part in (0, 1):
                want = regions[2 * layer + part].ptr
                self.assertEqual(self.r.layer_ptrs(layer)[part], want, "layer %d part %d" % (layer, part))
        with self.assertRaises(IndexError):
            self.r.layer_ptrs(16)
        with self.assertRaises(IndexError):
            self.r.layer_ptrs(-1)
        with self.assertRaises(TypeError):
            self.r.layer_ptrs(1.0)
        self.assertTrue(self.r.alive)
        self.assertIsNone(self.r.error)

    def test_hashes_through_the_library_equal_the_reference(self):
        self.r.close()  # one replica of an owner per process: one namespace at a time
        for ns in ("", "llama", "名前"):
            with self.subTest(ns=ns), self.owner.replica(namespace=ns) as r:
                for n in (0, 15, 16, 17, 8 * T, 512 * T + 5):
                    t = tokens(n, n)
                    self.assertEqual(r.hashes(t), kv.prefix_hashes(t, T, ns), n)
                self.assertEqual(r.hashes(array("i", [-1, 2147483647, -2147483648, 7] * 4)),
                                 kv.prefix_hashes([-1, 2147483647, -2147483648, 7] * 4, T, ns))
        with open(os.path.join(ROOT, "kv", "testdata", "hashes.json")) as f:
            cases = [c for c in json.load(f)["cases"] if c["tokens_per_page"] == T]
        self.assertTrue(cases, "testdata has a case of 16 tokens per page")
        for c in cases:
            with self.owner.replica(namespace=c["namespace"]) as r:
                self.assertEqual([x.hex() for x in r.hashes(c["tokens"])], c["hashes"])

    def test_write_seal_match_read_across_processes(self):
        hs = self.r.hashes(tokens(3 * T, 5))
        l = self.r.alloc(3)
        self.assertTrue(l.writable)
        self.assertEqual(len(l), 3)
        self.assertIsInstance(l.pages, array)
        self.assertTrue(all(0 <= p < 64 for p in l.pages))
        write_pages(self.r, l.pages, 5)
        res = self.r.seal(l, hs, wait=True)
        self.assertEqual(res, kv.SealResult(visible=3, duplicates=0))

        p, q = spawn(reader, self.owner.serve, hs, 5, "")
        got = result_of(self, p, q)
        self.assertEqual(got["n"], 3)
        self.assertEqual(got["ok"], [True, True, True], "the reader read the writer's bytes")
        self.assertEqual(got["pages"], list(l.pages), "the same pages of the one slab")
        self.assertFalse(got["writable"])
        self.assertTrue(got["own"], "the reader's hashes of the same tokens are the writer's")

        # A longer prompt with the same prefix matches the prefix only.
        longer = self.r.hashes(tokens(3 * T, 5) + tokens(2 * T, 6))
        m = self.r.match(longer)
        self.assertEqual(list(m.pages), list(l.pages))
        self.r.release(m)
        miss = self.r.match(self.r.hashes(tokens(2 * T, 99)))
        self.assertEqual((len(miss), miss.id), (0, 0), "nothing visible: no lease")
        self.r.release(miss)  # holds nothing: nothing to do

    def test_seal_without_wait_becomes_visible(self):
        hs = self.r.hashes(tokens(2 * T, 8))
        with cudapool.Stream(0) as s:
            l = self.r.alloc(2)
            write_pages(self.r, l.pages, 8, s)
            res = self.r.seal(l, hs, stream=s)
            self.assertEqual(res.duplicates, 0)
            m = eventually(self, "the sealed pages to be visible", lambda: self._match_all(hs))
            self.assertEqual(read_pages(self.r, m.pages, 8), [True, True])
            self.r.release(m, stream=s)

    def test_seal_goes_onto_its_stream(self):
        # The writes and the seal wait behind a hold of s: the seal stays pending until
        # s runs (a seal recorded on another stream, or none, would be visible at once).
        hs = self.r.hashes(tokens(2 * T, 31))
        with cudapool.Stream(0) as s, cudapool.Stream(0) as other:
            l = self.r.alloc(2)
            resume = stall_stream(self, s)
            write_pages(self.r, l.pages, 31, s)
            res = self.r.seal(l, hs, stream=s)
            self.assertEqual(res, kv.SealResult(visible=0, duplicates=0), "pending: its stream is held")
            other.synchronize()
            for _ in range(20):
                m = self.r.match(hs)
                self.assertEqual(len(m), 0, "visible while the stream of its writes was held")
            resume()
            m = eventually(self, "the sealed pages to be visible", lambda: self._match_all(hs))
            self.assertEqual(read_pages(self.r, m.pages, 31), [True, True])
            self.r.release(m, stream=s)

    def _match_all(self, hs):
        m = self.r.match(hs)
        if len(m) == len(hs):
            return m
        self.r.release(m)
        return None

    def test_seal_fewer_hashes_frees_the_rest_and_duplicates(self):
        hs = self.r.hashes(tokens(4 * T, 9))
        l = self.r.alloc(4)
        write_pages(self.r, l.pages, 9)
        self.assertEqual(self.r.seal(l, hs[:2], wait=True).visible, 2)
        again = self.r.alloc(2)
        self.assertEqual(self.r.seal(again, hs[:2], wait=True), kv.SealResult(visible=0, duplicates=2))
        m = self.r.match(hs)
        self.assertEqual(list(m.pages), list(l.pages[:2]), "the first seal's pages stay the visible ones")
        self.r.release(m)

    def test_stale_leases(self):
        l = self.r.alloc(2)
        self.r.release(l)
        with self.assertRaises(kv.StaleLease) as cm:
            self.r.release(l)
        self.assertEqual(cm.exception.status_name, "CUDAPOOL_ESTALE")
        with self.assertRaises(kv.StaleLease):
            self.r.seal(l, self.r.hashes(tokens(2 * T, 1)))
        with self.assertRaises(kv.StaleLease):
            self.r.release(kv.Lease(0x1234567, array("I", [1]), False))

        sealed = self.r.alloc(1)
        self.r.seal(sealed, self.r.hashes(tokens(T, 3)), wait=True)
        with self.assertRaises(kv.StaleLease, msg="a sealed write lease has ended"):
            self.r.release(sealed)

        # Another replica's lease is not this one's to release, and stays its own.
        go = multiprocessing.get_context("spawn").Event()
        p, q = spawn(lease_holder, self.owner.serve, 3, go)
        try:
            theirs = q.get(timeout=CHILD_TIMEOUT)
            self.assertIsInstance(theirs, dict, theirs)
            forged = kv.Lease(theirs["id"], array("I", theirs["pages"]), True)
            with self.assertRaises(kv.StaleLease):
                self.r.release(forged)
            with self.assertRaises(kv.StaleLease):
                self.r.seal(forged, self.r.hashes(tokens(3 * T, 4)))
            # All or none: a good lease beside a stale one is not released either.
            mine = self.r.alloc(1)
            with self.assertRaises(kv.StaleLease):
                self.r.release(mine, l)
            self.r.release(mine)
        finally:
            go.set()
        self.assertEqual(result_of(self, p, q), "released", "the holder released its own lease")

    def test_no_space(self):
        a = self.r.alloc(60)
        b = self.r.alloc(4)
        with self.assertRaises(kv.NoSpace) as cm:
            self.r.alloc(1)
        self.assertEqual(cm.exception.status_name, "CUDAPOOL_ENOSPACE")
        self.r.release(b)
        with self.assertRaises(kv.NoSpace, msg="all or nothing: at most 4 free, 5 asked"):
            self.r.alloc(5)
        c = eventually(self, "the 4 released pages to be free", lambda: self._alloc_or_none(4))
        self.r.release(a, c)
        whole = eventually(self, "every page to be free", lambda: self._alloc_or_none(64))
        self.assertEqual(sorted(whole.pages), list(range(64)))
        self.r.release(whole)

    def _alloc_or_none(self, n):
        try:
            return self.r.alloc(n)
        except kv.NoSpace:
            return None

    def test_visible_pages_are_evicted_for_an_alloc(self):
        hs = self.r.hashes(tokens(64 * T, 10))
        l = self.r.alloc(64)
        self.assertEqual(self.r.seal(l, hs, wait=True).visible, 64)
        fresh = self.r.alloc(8)  # no free page: 8 visible, unread pages are evicted
        self.assertEqual(len(fresh), 8)
        self.assertEqual(sorted(fresh.pages), sorted(l.pages[56:]),
                         "eviction takes the chain's leaves first: its last 8 pages")
        self.r.release(fresh)
        m = self.r.match(hs)
        self.assertEqual(list(m.pages), list(l.pages[:56]), "the first 56 pages stay visible, in order")
        self.r.release(m)

    def test_bad_inputs_lose_nothing(self):
        hs = self.r.hashes(tokens(4 * T, 11))
        l = self.r.alloc(4)
        cases = [
            (ValueError, lambda: self.r.seal(l, hs.raw[:-1])),
            (ValueError, lambda: self.r.seal(l, list(hs[:3]) + [b"short"])),
            (ValueError, lambda: self.r.seal(l, list(hs[:3]) + [b"x" * 17])),
            (TypeError, lambda: self.r.seal(l, list(hs[:3]) + ["a str, not bytes"])),
            (ValueError, lambda: self.r.seal(l, self.r.hashes(tokens(5 * T, 11)))),  # more hashes than pages
            (ValueError, lambda: self.r.match([b"x" * 15])),
            (ValueError, lambda: self.r.match(b"x" * 33)),
            (ValueError, lambda: self.r.alloc(-1)),
            (ValueError, lambda: self.r.alloc(kv.MAX_BATCH + 1)),
            (ValueError, lambda: self.r.alloc(1 << 40)),
            (ValueError, lambda: self.r.match([b"x" * 16] * (kv.MAX_BATCH + 1))),
            (TypeError, lambda: self.r.alloc("3")),
            (TypeError, lambda: self.r.seal(l.id, hs)),
            (TypeError, lambda: self.r.release(l.id)),
            (ValueError, lambda: self.r.alloc(2, timeout=-1)),
            (ValueError, lambda: self.r.hashes([1 << 40] * 16)),
            (TypeError, lambda: self.r.hashes(b"\x00" * 64)),
            (ValueError, lambda: kv.Replica(self.owner.serve + "\0x")),
            (ValueError, lambda: kv.Replica("")),
            (ValueError, lambda: kv.Replica(self.owner.serve, device=-1)),
            (TypeError, lambda: kv.Replica(self.owner.serve, namespace=5)),
        ]
        for exc, f in cases:
            with self.subTest(i=cases.index((exc, f))), self.assertRaises(exc):
                f()
        st = self.r.stats()
        self.assertEqual(st["devices"][0]["writing"], 4, "the write lease's pages, no more, no fewer")
        mine = [x for x in st["replicas"] if x["pid"] == os.getpid()]
        self.assertEqual([(x["leases"], x["pages"]) for x in mine], [(1, 4)])
        # An observer sees the same, with no replica of its own.
        seen = kv.query_stats(self.owner.serve)
        self.assertEqual(seen["devices"][0]["writing"], 4)
        self.assertEqual(seen["geometry"], st["geometry"])
        for bad in ("", self.owner.serve + "\0x"):
            with self.assertRaises(ValueError):
                kv.query_stats(bad)
        with self.assertRaises(cudapool.Gone):
            kv.query_stats(os.path.join(self.owner.serve, "nobody-serves-this"))
        with self.assertRaises(cudapool.InvalidArgument, msg="a read lease is not sealed"):
            self._seal_read_lease()
        # The write lease survived every refusal: it seals whole.
        write_pages(self.r, l.pages, 11)
        self.assertEqual(self.r.seal(l, hs, wait=True).visible, 4)
        m = self.r.match(hs)
        self.assertEqual(read_pages(self.r, m.pages, 11), [True] * 4)
        self.r.release(m)
        rest = self.r.alloc(60)
        self.assertEqual(len(rest), 60, "every other page is still free")
        self.r.release(rest)

    def _seal_read_lease(self):
        hs = self.r.hashes(tokens(T, 12))
        w = self.r.alloc(1)
        self.r.seal(w, hs, wait=True)
        m = self.r.match(hs)
        try:
            self.r.seal(m, hs)
        finally:
            self.r.release(m)

    def test_c_interface_bad_input(self):
        l = _lib.lib()
        r = self.r._r
        lease, n = ctypes.c_uint64(), ctypes.c_size_t()
        pages = (ctypes.c_uint32 * 8)()
        cases = [
            ("cudapool_kv_alloc", (r, kv.MAX_BATCH + 1, 0, ctypes.byref(lease), pages), 1, "over 4096"),
            ("cudapool_kv_alloc", (r, 1, 0, None, pages), 1, "lease is NULL"),
            ("cudapool_kv_alloc", (r, 1, 0, ctypes.byref(lease), None), 1, "pages is NULL"),
            ("cudapool_kv_alloc", (r, 1, -2, ctypes.byref(lease), pages), 1, "negative"),
            ("cudapool_kv_match", (r, None, 3, None, 0, ctypes.byref(lease), pages, ctypes.byref(n)), 1, "NULL"),
            ("cudapool_kv_hashes", (r, None, 16, None, 0, ctypes.byref(n)), 1, "tokens is NULL"),
            ("cudapool_kv_release", (r, None, 2, None, 0), 1, "leases is NULL"),
            ("cudapool_kv_alive", (r, None), 1, "alive is NULL"),
            ("cudapool_kv_alive", (kv._Replica(0), ctypes.byref(ctypes.c_int())), 2, "handle 0"),
            ("cudapool_kv_alive", (kv._Replica(0xDEADBEEF), ctypes.byref(ctypes.c_int())), 2, "not a cudapool handle"),
            ("cudapool_kv_dial", (b"/nonexistent", 0, None, 3, 0, 0, ctypes.byref(kv._Replica())), 1, "ns is NULL"),
            ("cudapool_kv_dial", (b"/nonexistent", 0, None, 0, 8, 0, ctypes.byref(kv._Replica())), 1, "flags"),
        ]
        for name, args, status, text in cases:
            with self.subTest(name=name, text=text):
                self.assertEqual(getattr(l, name)(*args), status, l.cudapool_last_error())
                self.assertIn(text, l.cudapool_last_error().decode())
        with cudapool.Pool(0) as p:
            self.assertEqual(l.cudapool_kv_alive(kv._Replica(p.handle), ctypes.byref(ctypes.c_int())), 2)
            self.assertIn("is the handle of a pool, not of a kv replica", l.cudapool_last_error().decode())
        toks = (ctypes.c_int32 * (3 * T))(*tokens(3 * T, 1))
        out = ctypes.create_string_buffer(3 * 16)
        self.assertEqual(l.cudapool_kv_hashes(r, toks, 3 * T, out, 2, ctypes.byref(n)), 14, "room for 2 of 3")
        self.assertEqual(n.value, 3, "the number needed")
        g = kv._Geometry(size=4)
        self.assertEqual(l.cudapool_kv_geometry_get(r, ctypes.byref(g)), 1, "a size too small")
        # A shorter struct (an older program's) gets the fields that fit and no more.
        short = (ctypes.c_char * 40)()
        ctypes.memmove(short, ctypes.byref(ctypes.c_size_t(24)), ctypes.sizeof(ctypes.c_size_t))
        self.assertEqual(l.cudapool_kv_geometry_get(r, ctypes.cast(short, ctypes.POINTER(kv._Geometry))), 0)
        layers = ctypes.c_int32.from_buffer(short, ctypes.sizeof(ctypes.c_size_t)).value
        self.assertEqual(layers, 16)
        self.assertEqual(bytes(short[24:40]), b"\0" * 16, "nothing written past size")
        self.assertEqual(l.cudapool_status_name(29), b"CUDAPOOL_ENOSPACE")
        self.assertEqual(l.cudapool_status_name(27), b"CUDAPOOL_ESTALE")
        # Every refusal above kept what the replica holds.
        every = self.r.alloc(64)
        self.r.release(every)

    def test_close_gives_leases_back(self):
        p, q = spawn(close_holding, self.owner.serve, 64)
        self.assertEqual(result_of(self, p, q), {"closed_alloc": "Closed", "error": None})
        l = eventually(self, "the closed replica's pages to be free", lambda: self._alloc_or_none(64))
        self.assertEqual(len(l), 64)
        self.r.release(l)
        self.r.close()
        self.r.close()  # a second close does nothing
        with self.assertRaises(cudapool.Closed):
            self.r.match([b"x" * 16])

    def test_dead_writer_publishes_nothing_and_loses_nothing(self):
        """A writer killed holding written pages publishes none of them and loses none;
        what it sealed before (its work complete) stays visible, byte for byte."""
        p, q = spawn(dying_writer, self.owner.serve, 32, 13)
        try:
            self.assertEqual(result_of_put(self, p, q), "written")
            dev = self.r.stats()["devices"][0]
            self.assertEqual((dev["sealed"], dev["writing"], dev["free"]), (16, 16, 32), dev)
            with self.assertRaises(kv.NoSpace):
                self.r.alloc(64 - 16 + 1)  # 16 pages held unsealed: 48 can be had (16 by eviction)
        finally:
            p.kill()
            p.join(CHILD_TIMEOUT)
        # The 16 unsealed of the first lease were freed by its seal; the second lease's
        # 16 are freed once the owner sees the writer die.
        eventually(self, "the dead writer's unsealed pages to be free",
                   lambda: self.r.stats()["devices"][0]["free"] == 48)
        dev = self.r.stats()["devices"][0]
        self.assertEqual((dev["sealed"], dev["writing"], dev["sealing"]), (16, 0, 0), dev)
        half = self.r.hashes(tokens(16 * T, 13))
        m = self.r.match(half)
        self.assertEqual(len(m), 16, "what it sealed with its work complete stays visible")
        self.assertTrue(all(read_pages(self.r, m.pages, 13)), "and holds its bytes")
        self.r.release(m)
        self.assertEqual(len(self.r.match(self.r.hashes(tokens(32 * T, 13)))), 16, "nothing more was published")

    def test_writer_killed_with_its_seal_pending_publishes_nothing(self):
        """A writer killed while its seal waits for its stream's work publishes none of
        those pages, ever, and they all come back free."""
        if not can_stall():  # the writer process must hold its stream
            self.skipTest("libcudapool was built without the software device: nothing can hold a stream")
        free = self.r.stats()["devices"][0]["free"]
        p, q = spawn(dying_sealer, self.owner.serve, 8, 17)
        try:
            self.assertEqual(result_of_put(self, p, q), ("pending", 0))
            dev = self.r.stats()["devices"][0]
            self.assertEqual((dev["sealing"], dev["free"]), (8, free - 8), "the seal waits for the held stream")
        finally:
            p.kill()
            p.join(CHILD_TIMEOUT)
        eventually(self, "the dead writer's pending pages to be free",
                   lambda: self.r.stats()["devices"][0]["free"] == free)
        dev = self.r.stats()["devices"][0]
        self.assertEqual(dev["sealing"], 0, dev)
        self.assertEqual(len(self.r.match(self.r.hashes(tokens(8 * T, 17)))), 0, "nothing of the pending seal is visible")

    def test_owner_death(self):
        hs = self.r.hashes(tokens(2 * T, 14))
        held = self.r.alloc(2)
        fd = self.r.fileno()
        self.assertEqual(select.select([fd], [], [], 0)[0], [], "not readable while the owner lives")
        self.owner.kill()
        readable, _, _ = select.select([fd], [], [], CHILD_TIMEOUT)
        self.assertEqual(readable, [fd], "the done fd became readable")
        eventually(self, "alive to turn False", lambda: not self.r.alive)
        self.assertIsInstance(self.r.error, cudapool.Gone)
        self.assertTrue(str(self.r.error))
        for i, f in enumerate((lambda: self.r.alloc(1), lambda: self.r.match(hs), lambda: self.r.seal(held, hs),
                               lambda: self.r.release(held))):
            with self.subTest(i=i), self.assertRaises(cudapool.Gone):
                f()
        self.r.close()

    def test_concurrent_calls(self):
        import threading
        hs = [self.r.hashes(tokens(4 * T, 20 + i)) for i in range(4)]
        errors = []

        def work(h, seed):
            try:
                for _ in range(20):
                    l = self.r.alloc(4)
                    self.r.seal(l, h, wait=True)
                    m = self.r.match(h)
                    if len(m) != 4:
                        errors.append("matched %d of 4" % len(m))
                    self.r.release(m)
            except Exception as e:
                errors.append(repr(e))

        ts = [threading.Thread(target=work, args=(h, i)) for i, h in enumerate(hs)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(CHILD_TIMEOUT)
        self.assertFalse(any(t.is_alive() for t in ts), "a thread hung")
        self.assertEqual(errors, [])


class CloseTest(unittest.TestCase):
    """A close never crashes (issue 31: SIGSEGV inside cudapool_kv_close on the GPU):
    after the stream it released on was destroyed, after the owner and its keeper went
    away, twice, and calls after it raise Closed."""

    def test_close_after_its_stream_was_destroyed(self):
        owner = Owner(pages=64)
        self.addCleanup(owner.stop)
        r = owner.replica()
        with cudapool.Stream(0) as s:
            l = r.alloc(2)
            r.release(l, stream=s)
            held = r.alloc(1)
        self.assertEqual(len(held), 1)
        r.close()  # records no event on s, which is destroyed: the driver died of that
        r.close()

    def test_close_after_the_owner_went_away(self):
        owner = Owner(pages=64)
        self.addCleanup(owner.stop)
        owner.first_line()
        r = owner.replica()
        l = r.alloc(2)
        s = cudapool.Stream(0)
        self.addCleanup(s.close)
        r.release(r.alloc(1), stream=s)
        owner.kill()
        for pid in owner.keepers:  # the slab's exporter too
            os.kill(pid, signal.SIGKILL)
        eventually(self, "alive to turn False", lambda: not r.alive)
        with self.assertRaises(cudapool.Gone):
            r.release(l)
        r.close()
        r.close()
        with self.assertRaises(cudapool.Closed):
            r.release(l)
        with self.assertRaises(cudapool.Closed):
            r.alloc(1)


class RestartTest(unittest.TestCase):
    """kvpoold SIGKILLed and started again over its keeper's slab."""

    def attached(self, **kw):
        """A reconnecting replica (kw: more of its arguments) of a new kvpoold, self.owner."""
        self.owner = Owner(pages=64)
        self.addCleanup(self.owner.stop)
        self.owner.first_line()
        r = self.owner.replica(reconnect=True, **kw)
        self.addCleanup(r.close)
        return r

    def seal_and_kill(self, r, seed):
        """Seals 4 pages of seed's tokens through r, kills kvpoold once r holds a read
        lease of them, and returns (hashes, the write lease sealed, the read lease, the
        log's offset before the restart)."""
        hs = r.hashes(tokens(4 * T, seed))
        w = r.alloc(4)
        write_pages(r, w.pages, seed)
        r.seal(w, hs, wait=True)
        held = r.match(hs)
        offset = len(self.owner.output())
        self.owner.kill()
        eventually(self, "alive to turn False", lambda: not r.alive)
        return hs, w, held, offset

    def test_owner_restart_reattaches(self):
        r = self.attached()
        hs, w, held, offset = self.seal_and_kill(r, 15)
        self.assertEqual(r.reattaches, 0)
        with self.assertRaises(cudapool.Gone):
            r.match(hs)
        self.owner.start()
        line = self.owner.first_line(offset)
        self.assertIn("4 visible pages restored", line)
        r.wait_attached(CHILD_TIMEOUT)
        self.assertTrue(r.alive)
        self.assertEqual(r.reattaches, 1)
        m = r.match(hs)
        self.assertEqual(list(m.pages), list(w.pages), "the pages sealed before the restart match")
        self.assertEqual(read_pages(r, m.pages, 15), [True] * 4)
        r.release(m, held)

    def test_lease_lost_in_a_restart(self):
        """Leases the restarted owner has no record of (its index was spoilt) come back
        lost: a read lease whose pages it does not have, and a write lease whose grant it
        cannot check (docs/PROTOCOL.md: only a journaled grant is taken back). Lease.lost
        says why, and releasing such a lease raises StaleLease and ends it."""
        r = self.attached()
        writing = r.alloc(2)
        self.assertIsNone(writing.lost)
        _, _, held, offset = self.seal_and_kill(r, 16)
        index = os.path.join(self.owner.serve, "index")
        with open(index, "r+b") as f:  # a header byte flipped: the restart drops the index
            f.seek(6)
            b = f.read(1)
            f.seek(6)
            f.write(bytes([b[0] ^ 1]))
        self.owner.start()
        self.assertIn("0 visible pages restored", self.owner.first_line(offset))
        r.wait_attached(CHILD_TIMEOUT)
        self.assertIsInstance(held.lost, kv.StaleLease)
        self.assertIn("lost", str(held.lost))
        self.assertIsInstance(writing.lost, kv.StaleLease, "a write lease with no grant on record")
        for lease in (held, writing):
            with self.assertRaises(kv.StaleLease):
                r.release(lease)
            self.assertIsNone(lease.lost, "the release ended it")
        self.assertIsNone(kv.Lease(0, array("I"), False).lost)

    def test_wait_attached_honours_its_timeout(self):
        """wait_attached(0) does not wait, whatever the replica's timeout (here none):
        while the owner is away it raises Timeout at once; it returns once attached."""
        r = self.attached(timeout=None)
        r.wait_attached(0)  # attached: at once
        offset = len(self.owner.output())
        self.owner.kill()
        eventually(self, "alive to turn False", lambda: not r.alive)
        got = []

        def wait():
            try:
                r.wait_attached(0)
                got.append(None)
            except Exception as e:  # noqa: BLE001 (the test looks at it)
                got.append(e)

        t = threading.Thread(target=wait)
        t.start()
        # The owner is started again only once the wait returned (or the bound ran
        # out): a wait_attached(0) that waits would return attached, not Timeout.
        t.join(CHILD_TIMEOUT)
        alive = t.is_alive()
        self.owner.start()
        self.owner.first_line(offset)
        t.join(CHILD_TIMEOUT)
        self.assertFalse(alive, "wait_attached(0) waited for the owner")
        self.assertEqual(len(got), 1)
        self.assertIsInstance(got[0], cudapool.Timeout)
        r.wait_attached(CHILD_TIMEOUT)
        r.wait_attached(0)
        self.assertEqual(r.reattaches, 1)


class TensorViewTest(unittest.TestCase):
    """What kv_caches hands torch, read back without torch."""

    def test_dlpack_of_a_tensor(self):
        from cudapool import _dlpack
        owner = Owner(pages=8)
        self.addCleanup(owner.stop)
        r = owner.replica()
        self.addCleanup(r.close)
        g = r.geometry
        shape = (g.pages, g.tokens_per_page, g.kv_heads, g.head_dim)
        v = r.tensor_view(3, 1)
        self.assertEqual(v.__dlpack_device__(), (2, 0))
        cap = v.__dlpack__(stream=None)
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)
        mt = _dlpack.DLManagedTensor.from_address(get(cap, b"dltensor"))
        t = mt.dl_tensor
        self.assertEqual(t.data, r.layer_ptrs(3)[1])
        self.assertEqual((t.dtype.code, t.dtype.bits), (0, 16))
        self.assertEqual(t.ndim, 4)
        self.assertEqual([t.shape[i] for i in range(4)], list(shape))
        mt.deleter(ctypes.pointer(mt))
        cai = r.tensor_view(15, 0).__cuda_array_interface__
        self.assertEqual((cai["shape"], cai["typestr"], cai["data"][0]), (shape, "<i2", r.layer_ptrs(15)[0]))
        with self.assertRaises(ValueError):
            r.tensor_view(0, 2)
        with self.assertRaises(IndexError):
            r.tensor_view(16, 0)


class Strided:
    """An array known by its addresses alone: base, shape and byte strides; indexing
    with ints takes the leading dimensions off, as torch and numpy do."""

    def __init__(self, base, shape, strides):
        self.base, self.shape, self.strides = base, tuple(shape), tuple(strides)

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        for i, d in zip(idx, self.shape):
            if not 0 <= i < d:
                raise IndexError(i)
        off = sum(i * s for i, s in zip(idx, self.strides))
        return Strided(self.base + off, self.shape[len(idx):], self.strides[len(idx):])

    def addr(self, *idx):
        return self[idx].base


def element_offset(g, page, token, head, d):
    """Where the docs (kv.py's module docstring, cudapool.h) put an element of one
    [pages, tokens_per_page, kv_heads, head_dim] tensor, from the tensor's start."""
    return page * g.page_bytes + ((token * g.kv_heads + head) * g.head_dim + d) * g.dtype_size


def samples(g):
    """A few indices (page, token, head, element) in every corner of a tensor."""
    for page in sorted({0, g.pages - 1}):
        for token, head, d in ((0, 0, 0), (g.tokens_per_page - 1, g.kv_heads - 1, g.head_dim - 1),
                               (1 % g.tokens_per_page, g.kv_heads // 2, 3 % g.head_dim)):
            yield page, token, head, d


def capsule_array(cap, itemsize):
    """The Strided array a "dltensor" capsule describes, and the capsule's consumer
    done (its deleter called)."""
    from cudapool import _dlpack
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)
    mt = _dlpack.DLManagedTensor.from_address(get(cap, b"dltensor"))
    t = mt.dl_tensor
    a = Strided(t.data + t.byte_offset, [t.shape[i] for i in range(t.ndim)],
                [t.strides[i] * itemsize for i in range(t.ndim)])
    bits, dev = t.dtype.bits, (t.device.device_type, t.device.device_id)
    mt.deleter(ctypes.pointer(mt))
    return a, bits, dev


class KVCachesLayoutTest(unittest.TestCase):
    """kv_caches' K/V order, shape and strides, checked where CI runs: by the addresses
    of the DLPack capsules it hands torch (no torch), and with CPU torch where it
    imports (the GPU tests check the rest)."""

    def test_by_addresses(self):
        owner = Owner(pages=8)
        self.addCleanup(owner.stop)
        r = owner.replica()
        self.addCleanup(r.close)
        g = r.geometry
        seen = {}

        def tensor(layer, part):  # what kv_caches does, but for torch.from_dlpack
            a, bits, dev = capsule_array(r.tensor_view(layer, part).__dlpack__(stream=None), g.dtype_size)
            self.assertEqual((bits // 8, dev), (g.dtype_size, (2, r.device)))
            seen[layer, part] = a
            return a

        caches = kv._layer_caches(tensor, g.layers)
        self.assertEqual(len(caches), g.layers)
        ends = []
        for layer, (k, v) in enumerate(caches):
            self.assertEqual((k.base, v.base), r.layer_ptrs(layer), "layer %d: (K, V) in that order" % layer)
            for x in (k, v):
                self.assertEqual(x.shape, (g.pages, g.tokens_per_page, g.kv_heads, g.head_dim))
                for page, token, head, d in samples(g):
                    self.assertEqual(x.addr(page, token, head, d) - x.base, element_offset(g, page, token, head, d))
                last = x.addr(g.pages - 1, g.tokens_per_page - 1, g.kv_heads - 1, g.head_dim - 1)
                self.assertEqual(last + g.dtype_size - x.base, g.tensor_bytes, "a tensor is contiguous")
                ends.append((x.base, x.base + g.tensor_bytes))
        for (lo, hi) in ends:
            self.assertTrue(any(x.ptr <= lo and hi <= x.ptr + x.size for x in r.regions),
                            "each tensor lies whole in one region")
        ends.sort()
        self.assertTrue(all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "no two tensors overlap")

    def test_with_cpu_torch(self):
        """torch reads the shape and strides of kv_caches' capsules as the docs say."""
        try:
            import torch
        except ImportError:
            self.skipTest("torch is not installed (the address test stands in)")
        owner = Owner(pages=8)
        self.addCleanup(owner.stop)
        r = owner.replica()
        self.addCleanup(r.close)
        g = r.geometry
        a, _, _ = capsule_array(r.tensor_view(3, 1).__dlpack__(stream=None), g.dtype_size)
        elems = torch.arange(g.tensor_bytes // g.dtype_size, dtype=torch.int64)
        t = torch.as_strided(elems, a.shape, [s // g.dtype_size for s in a.strides])
        self.assertEqual(tuple(t.shape), (g.pages, g.tokens_per_page, g.kv_heads, g.head_dim))
        self.assertTrue(t.is_contiguous())
        for page, token, head, d in samples(g):
            self.assertEqual(int(t[page, token, head, d]) * g.dtype_size, element_offset(g, page, token, head, d))


if __name__ == "__main__":
    unittest.main()
