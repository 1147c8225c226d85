"""Tests of what Python has as Go does (liveness, replicas, waits, batches, policy,
distinct errors) and of the checks that keep a bad argument from being truncated or
wrapped on its way to the library. Producers run in spawned processes where a process
must die."""

import ctypes
import logging
import multiprocessing
import os
import selectors
import signal
import time
import unittest

from helpers import CHILD_TIMEOUT, cudapool, failure, result_of, socket_path, spawn, wait_go

from cudapool import _lib

MiB = 1 << 20


def setUpModule():
    cudapool.init(os.environ["CUDAPOOL_RUNTIME"])


def produce(q, path, names, go):
    """A producer process: after go, listens at path, publishes names (1 MiB each, from
    device 0, in one batch), says so and waits to be killed."""
    try:
        wait_go(go)
        pool = cudapool.Pool(0)
        bufs = [pool.alloc(MiB) for _ in names]
        for i, b in enumerate(bufs):
            cudapool.copy_to_device(0, b, bytes([i + 1]) * 16)
        ex = cudapool.Exporter(path, announce=False)
        time.sleep(0.1)  # the consumer waits for the names meanwhile
        ex.publish_all([(n, b, 0, n.encode()) for n, b in zip(names, bufs)])
        q.put("published")
        time.sleep(CHILD_TIMEOUT * 2)
    except Exception as e:
        q.put(failure(e))


class LivenessTest(unittest.TestCase):
    """A consumer here, on device 1 (a peer GPU), of a producer on device 0 that is
    SIGKILLed."""

    def setUp(self):
        if cudapool.runtime_info().devices < 2:
            self.skipTest("needs two devices")
        self.path = socket_path("live")
        self.go = multiprocessing.get_context("spawn").Event()
        self.p, self.q = spawn(produce, self.path, ["a", "b", "c"], self.go)
        self.addCleanup(self.reap)

    def reap(self):
        if self.p.is_alive():
            self.p.kill()
        self.p.join(CHILD_TIMEOUT)

    def test_a_consumer_is_told_its_producer_died(self):
        self.go.set()  # the dial below waits for the exporter, the open for the name
        imp = cudapool.Importer(self.path, device=1, wait_for_exporter=True, timeout=CHILD_TIMEOUT)
        self.addCleanup(imp.close)
        first = imp.open("a", wait_for_name=True, timeout=CHILD_TIMEOUT)
        self.assertEqual(result_of_queue(self, self.q), "published")
        ms = imp.open_all(["b", "c"])
        self.assertEqual([m.meta for m in ms], [b"b", b"c"])
        replica = imp.open("a", local_copy=True)
        self.assertNotEqual(replica.ptr, first.ptr, "a replica is this process's own memory")
        self.assertEqual(cudapool.copy_from_device(1, replica.ptr, 16), b"\x01" * 16)
        self.assertTrue(imp.alive)
        self.assertIsNone(imp.error)
        self.assertFalse(imp.wait_done(0))
        sel = selectors.DefaultSelector()
        sel.register(imp.done_fd(), selectors.EVENT_READ)
        self.assertEqual(sel.select(0), [], "the done descriptor is quiet while the exporter lives")
        self.assertIn("alive", repr(imp))

        self.p.kill()
        self.assertTrue(imp.wait_done(CHILD_TIMEOUT), "no death notice within %d s" % CHILD_TIMEOUT)
        self.assertTrue(sel.select(0), "the done descriptor is readable")
        sel.close()
        self.assertFalse(imp.alive)
        self.assertIsInstance(imp.error, cudapool.Gone)
        with self.assertRaises(cudapool.Gone):
            imp.open("a")
        # The loss follows the kernel's word that the process exited, which may come a
        # moment after the connection's end.
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not first.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertTrue(first.lost, "the mapping on the peer GPU was not lost in %d s" % CHILD_TIMEOUT)
        self.assertIsInstance(first.error, cudapool.MappingLost)
        self.assertIn("lost", repr(first))
        for use in (lambda: first.ptr, lambda: first.__cuda_array_interface__,
                    lambda: first.view("|u1", (4,)), lambda: first.__dlpack__(stream=-1)):
            with self.assertRaises(cudapool.MappingLost):
                use()
        self.assertFalse(replica.lost, "a replica outlives its producer")
        self.assertEqual(cudapool.copy_from_device(1, replica.ptr, 16), b"\x01" * 16)
        imp.release_all(ms + [first])
        self.assertTrue(all(not m.handle for m in ms))
        replica.release()

    def test_waits_are_bounded(self):
        with self.assertRaises(cudapool.Timeout):
            cudapool.Importer(self.path, device=1, wait_for_exporter=True, timeout=0.2)
        self.go.set()
        imp = cudapool.Importer(self.path, device=1, wait_for_exporter=True, timeout=CHILD_TIMEOUT)
        self.addCleanup(imp.close)
        with self.assertRaises(cudapool.Timeout):
            imp.open("never", wait_for_name=True, timeout=0.2)
        with self.assertRaises(cudapool.NotFound):
            imp.open("never")


def result_of_queue(test, q):
    r = q.get(timeout=CHILD_TIMEOUT)
    if isinstance(r, str) and r.startswith("error:"):
        test.fail("child process failed: " + r)
    return r


class ErrorsTest(unittest.TestCase):
    def test_every_status_has_its_exception(self):
        l = _lib.lib()
        seen = set()
        status = 1
        while l.cudapool_status_name(status) != b"CUDAPOOL_UNKNOWN":
            cls = _lib._ERRORS.get(status)
            self.assertIsNotNone(cls, "status %d (%s) has no exception" % (status, l.cudapool_status_name(status)))
            if status != _lib.ERANGE:  # call_sized handles it; it never reaches a caller
                self.assertNotIn(cls, seen, "status %d shares its exception" % status)
            seen.add(cls)
            self.assertTrue(hasattr(cudapool, cls.__name__), cls.__name__)
            status += 1
        self.assertGreaterEqual(status, 29)

    def test_duplicate_importer_and_stream_device(self):
        go = multiprocessing.get_context("spawn").Event()
        path = socket_path("dup")
        p, q = spawn(produce, path, ["x"], go)
        try:
            go.set()
            imp = cudapool.Importer(path, device=0, wait_for_exporter=True, timeout=CHILD_TIMEOUT)
            try:
                self.assertEqual(result_of_queue(self, q), "published")
                with self.assertRaises(cudapool.DuplicateImporter):
                    cudapool.Importer(path, device=0)
                if cudapool.runtime_info().devices > 1:
                    with cudapool.Stream(1) as s1:
                        with self.assertRaises(cudapool.StreamDevice):
                            imp.open("x", stream=s1)
            finally:
                imp.close()
        finally:
            p.kill()
            p.join(CHILD_TIMEOUT)

    def test_too_many_grants(self):
        with cudapool.Pool(0) as pool, cudapool.Exporter(socket_path("grants"), max_grants=1) as ex:
            a, b = pool.alloc(MiB), pool.alloc(MiB)
            ex.publish("a", a)
            ex.publish("b", b)
            p, q = spawn(open_two, ex.path)
            self.assertEqual(result_of(self, p, q), "TooManyGrants")
            a.free()
            b.free()

    def test_close_that_abandons_says_so(self):
        pool = cudapool.Pool(0)
        self.addCleanup(pool.close, True)
        ex = cudapool.Exporter(socket_path("abandon"))
        b = pool.alloc(MiB)
        ex.publish("held", b)
        go = multiprocessing.get_context("spawn").Event()
        p, q = spawn(hold, ex.path, "held", go)
        try:
            self.assertEqual(result_of_queue(self, q), "mapped")
            with self.assertRaises(cudapool.Abandoned) as cm:
                ex.close(timeout=0.2)
            self.assertNotIsInstance(cm.exception, cudapool.Timeout, "Timeout says the call holds nothing")
            self.assertEqual(ex.handle, 0, "the exporter is closed all the same")
        finally:
            go.set()
        self.assertEqual(result_of(self, p, q), "released")
        b.free()

    def test_own_export_is_refused_plainly(self):
        with cudapool.Exporter(socket_path("own")) as ex:
            with self.assertRaises(cudapool.NotSupported) as cm:
                cudapool.Importer(ex.path, timeout=5)
            self.assertIn("own", str(cm.exception))
            self.assertIn("pointer", str(cm.exception))

    def test_policy_and_socket_mode(self):
        with cudapool.Exporter(socket_path("policy"), allow_uids=[os.getuid()], allow_gids=[os.getgid(), 4242],
                               socket_follows_policy=True) as ex:
            self.assertEqual(os.stat(ex.path).st_mode & 0o777, 0o666, "several groups: open to all")
            self.assertEqual(cudapool.query_state(ex.path).pid, os.getpid())
        with cudapool.Exporter(socket_path("nobody"), allow_uids=[os.getuid() + 1]) as ex:
            self.assertEqual(os.stat(ex.path).st_mode & 0o777, 0o600)
            with self.assertRaises(cudapool.Refused):
                cudapool.query_state(ex.path)


def hold(q, path, name, go):
    """Maps name, says so, and releases it once go is set."""
    try:
        imp = cudapool.Importer(path, device=0)
        m = imp.open(name)
        q.put("mapped")
        wait_go(go)
        m.release()
        imp.close()
        q.put("released")
    except Exception as e:
        q.put(failure(e))


def open_two(q, path):
    try:
        imp = cudapool.Importer(path, device=0)
        m = imp.open("a")
        try:
            imp.open("b").release()
            q.put("opened")
        except cudapool.CudapoolError as e:
            q.put(type(e).__name__)
        m.release()
        imp.close()
    except Exception as e:
        q.put(failure(e))


class LogTest(unittest.TestCase):
    def test_nothing_is_logged_unless_asked(self):
        p, q = spawn(probe_live_path, socket_path("log"), None)
        r = result_of(self, p, q)
        self.assertEqual(r["stderr"], "", "the library wrote to stderr unasked")
        self.assertEqual(r["records"], [])
        p, q = spawn(probe_live_path, socket_path("log2"), "DEBUG")
        r = result_of(self, p, q)
        self.assertEqual(r["stderr"], "")
        self.assertTrue(any("not admitted" in m or "connection" in m for m in r["records"]), r["records"])

    def test_bad_levels(self):
        with self.assertRaises(ValueError):
            cudapool.set_log_level("LOUD")
        self.assertEqual(_lib.lib().cudapool_set_log(55, _lib.LOG_FN(), None), 1)


def probe_live_path(q, path, level):
    """Makes a second Exporter probe a live one's path (which the first logs), with the
    library's log at level, and reports what reached fd 2 and the logging module."""
    try:
        import tempfile
        err = tempfile.TemporaryFile()
        os.dup2(err.fileno(), 2)
        records = []

        class H(logging.Handler):
            def emit(self, r):
                records.append(r.getMessage())

        logging.getLogger("cudapool").addHandler(H())
        logging.getLogger("cudapool").setLevel(logging.DEBUG)
        cudapool.init(os.environ["CUDAPOOL_RUNTIME"])
        cudapool.set_log_level(level)
        ex = cudapool.Exporter(path)
        try:
            cudapool.Exporter(path)
        except cudapool.NameInUse:
            pass
        deadline = time.monotonic() + 5
        while level and not records and time.monotonic() < deadline:
            time.sleep(0.01)
        ex.close()
        cudapool.set_log_level(None)
        err.seek(0)
        q.put({"stderr": err.read().decode(errors="replace"), "records": records})
    except Exception as e:
        q.put(failure(e))


class ArgumentsTest(unittest.TestCase):
    """No argument is truncated, wrapped or reinterpreted on its way to C."""

    def test_names_and_paths_with_nul(self):
        with cudapool.Pool(0) as p, cudapool.Exporter(socket_path("nul")) as ex:
            b = p.alloc(MiB)
            with self.assertRaises(ValueError):
                ex.publish("a\0b", b)
            with self.assertRaises(ValueError):
                cudapool.Exporter(socket_path("x") + "\0tail")
            with self.assertRaises(ValueError):
                cudapool.Importer(ex.path + "\0x")
            with self.assertRaises(ValueError):
                cudapool.Pool(0, name="p\0q")
            b.free()

    def test_types(self):
        with self.assertRaises(TypeError):
            cudapool.Exporter(socket_path("n"), name=123)
        with cudapool.Pool(0) as p, cudapool.Exporter(socket_path("meta")) as ex:
            b = p.alloc(MiB)
            with self.assertRaises(TypeError):
                ex.publish("m", b, meta=5)
            ex.publish("m", b, meta=bytearray(b"ok"))
            with self.assertRaises(TypeError):
                p.alloc(1.5)
            b.free()

    def test_integers_out_of_range(self):
        with self.assertRaises(OverflowError):
            cudapool.stream_handle(2 ** 64)
        with self.assertRaises(ValueError):
            cudapool.stream_handle(-1)
        with cudapool.Pool(0) as p:
            with self.assertRaises(OverflowError):
                p.alloc(2 ** 64)
            with self.assertRaises(OverflowError):
                p.alloc(MiB, stream=2 ** 64)
            with self.assertRaises(ValueError):
                p.alloc(-1)
        with cudapool.Exporter(socket_path("pid")) as ex:
            with self.assertRaises(OverflowError):
                ex.push(2 ** 40, "x", timeout=1)
            with self.assertRaises(ValueError):
                ex.push(0, "x", timeout=1)
        with self.assertRaises(OverflowError):
            cudapool.Pool(2 ** 40)

    def test_a_closed_stream_raises(self):
        s = cudapool.Stream(0)
        s.close()
        with self.assertRaises(cudapool.Closed):
            cudapool.stream_handle(s)
        with cudapool.Pool(0) as p:
            with self.assertRaises(cudapool.Closed):
                p.alloc(MiB, stream=s)
        self.assertIn("closed", repr(s))

    def test_timeouts(self):
        with cudapool.Exporter(socket_path("t0")) as ex:
            self.assertEqual(cudapool.query_state(ex.path, timeout=None).pid, os.getpid(), "None: no bound")
            self.assertEqual(cudapool.query_state(ex.path, timeout=0).pid, os.getpid(),
                             "0: no wait, but a live exporter's answer is read")
            with self.assertRaises(ValueError):
                cudapool.query_state(ex.path, timeout=-1)
            with self.assertRaises(TypeError):
                cudapool.query_state(ex.path, timeout="5")

    def test_alloc_never_waits_for_what_cannot_fit(self):
        with cudapool.Pool(0, max_size=4 * MiB, wait_for_memory=True) as p:
            with self.assertRaises(cudapool.OutOfMemory) as cm:
                p.alloc(8 * MiB)
            self.assertIn("never fit", str(cm.exception))
            b = p.alloc(4 * MiB)
            with self.assertRaises(cudapool.Timeout):
                p.alloc(MiB, timeout=0.05)
            b.free()

    def test_views_stay_inside_the_mapping(self):
        class M:
            size, device, name, stream = 1024, 0, "x", 0

        m = M()
        for kw in [dict(shape=(-1,)), dict(shape=(4,), strides=(1 << 30,)), dict(shape=(4,), strides=(-1,)),
                   dict(shape=(2, 2), strides=(4,)), dict(shape=(4,), strides=(3,), typestr="<f2"),
                   dict(shape=(1025,)), dict(shape=(4,), offset=1021), dict(shape=(4,), offset=-1)]:
            with self.subTest(kw):
                with self.assertRaises(ValueError):
                    cudapool.ArrayView(m, kw.pop("typestr", "|u1"), **kw)
        v = cudapool.ArrayView(m, "<f4", (16, 16), strides=(64, 4))
        self.assertEqual(v.strides, (64, 4))
        v = cudapool.ArrayView(m, "|u1", (4,), strides=(-1,), offset=3)  # backwards from byte 3
        self.assertEqual(v.offset, 3)
        cudapool.ArrayView(m, "|u1", (0, 5), offset=1024)  # empty: reaches nothing


class DefaultRuntimeTest(unittest.TestCase):
    def test_the_default_is_the_gpu_never_the_software_device(self):
        """Without a preference the library runs on a GPU or fails: a broken CUDA install
        must not run on the software device unnoticed."""
        import subprocess
        import sys
        env = {k: v for k, v in os.environ.items() if k not in ("CUDAPOOL_RUNTIME", "CUDAPOOL_REQUIRE_GPU")}
        env["PYTHONPATH"] = os.path.dirname(os.path.dirname(cudapool.__file__))
        code = ("import cudapool\n"
                "try:\n"
                "    cudapool.init()\n"
                "    print('gpu' if cudapool.runtime_info().on_gpu else 'software')\n"
                "except cudapool.NoRuntime as e:\n"
                "    print('refused', e)\n")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=CHILD_TIMEOUT)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertNotEqual(out.stdout.strip(), "software")
        self.assertTrue(out.stdout.startswith(("gpu", "refused")), out.stdout)
        if not cudapool.runtime_info().on_gpu:
            self.assertTrue(out.stdout.startswith("refused"), out.stdout)


class FeelTest(unittest.TestCase):
    def test_buffer(self):
        with cudapool.Pool(0, name="feel") as p, cudapool.Stream(0) as s:
            with p.alloc(MiB, s) as b:
                self.assertEqual((b.size, b.device), (MiB, 0))
                self.assertIn("Buffer", repr(b))
                self.assertEqual(p.stats().live_buffers, 1)
                cudapool.copy_to_device(0, b, b"xyz", s)
                self.assertEqual(cudapool.copy_from_device(0, b, 3, s), b"xyz")
            s.synchronize()
            self.assertTrue(b.freed)
            self.assertEqual(p.stats().live_buffers, 0)
            with self.assertRaises(cudapool.ForeignPointer):
                b.free()
            self.assertIn("'feel'", repr(p))
        self.assertIn("closed", repr(p))

    def test_stats_and_state_are_dataclasses(self):
        import dataclasses
        with cudapool.Pool(0) as p, cudapool.Exporter(socket_path("dc"), name="dc") as ex:
            self.assertTrue(dataclasses.is_dataclass(p.stats()))
            b = p.alloc(MiB)
            ex.publish("n", b, meta=b"12")
            st = ex.state()
            self.assertTrue(dataclasses.is_dataclass(st))
            self.assertEqual((st.name, st.published[0].name, st.published[0].meta_bytes), ("dc", "n", 2))
            self.assertIn("Exporter", repr(ex))
            b.free()

    def test_version(self):
        self.assertEqual(cudapool.version(), (1, 2))

    def test_typed(self):
        import cudapool as pkg
        self.assertTrue(os.path.exists(os.path.join(os.path.dirname(pkg.__file__), "py.typed")))


if __name__ == "__main__":
    unittest.main()
