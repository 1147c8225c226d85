"""Tests of libcudapool through the Python package, on the software device where no GPU
is (or on the GPU). Run: python3 -m pytest python/tests (or python3 -m unittest
discover -s python/tests)."""

import ctypes
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import unittest

from helpers import CHILD_TIMEOUT, cudapool, failure, result_of, socket_path, spawn, wait_go

from cudapool import _lib

MiB = 1 << 20


def setUpModule():
    cudapool.init(os.environ["CUDAPOOL_RUNTIME"])


def pattern(n, seed):
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


def consume(q, path, name, n, seed, device):
    """A consumer process: opens name, checks its first n bytes, releases."""
    try:
        imp = cudapool.Importer(path, device=device)
        m = imp.open(name)
        got = cudapool.copy_from_device(device, m.ptr, n, m.stream)
        cai = m.__cuda_array_interface__
        m.release()
        imp.close()
        q.put({"ok": got == pattern(n, seed), "size": m.size, "meta": m.meta,
               "cai_stream": cai["stream"], "pid": os.getpid()})
    except Exception as e:  # the parent reports it
        q.put(failure(e))


def release_twice(q, path, name):
    """A consumer process that tries the rule of every language (issue 31): a second
    close changes nothing; a second release of a mapping is a bug, and raises."""
    try:
        got = {}
        imp = cudapool.Importer(path, device=0)
        m = imp.open(name)
        m.release()
        for what, f in (("release twice", m.release), ("close after release", m.close)):
            try:
                f()
                got[what] = None
            except cudapool.CudapoolError as e:
                got[what] = type(e).__name__
        with imp.open(name) as m2:
            pass
        try:
            m2.release()
            got["release after the with block"] = None
        except cudapool.CudapoolError as e:
            got["release after the with block"] = type(e).__name__
        with imp.open(name) as m3:
            m3.release()  # the block's close then changes nothing
        imp.close()
        imp.close()
        got["importer closed twice"] = imp.error is not None
        q.put(got)
    except Exception as e:
        q.put(failure(e))


class RuntimeTest(unittest.TestCase):
    def test_runtime_is_chosen_once(self):
        on_gpu, n, name = cudapool.runtime_info()
        self.assertGreaterEqual(n, 1)
        self.assertTrue(name)
        other = "test" if os.environ["CUDAPOOL_RUNTIME"] != "test" else "gpu"
        with self.assertRaises(cudapool.NoRuntime) as cm:
            cudapool.init(other)
        self.assertIn("another runtime was chosen", str(cm.exception))
        self.assertIn("running on", cudapool.init(os.environ["CUDAPOOL_RUNTIME"]))

    def test_protocol_version(self):
        self.assertEqual(cudapool.protocol_version(), 3)

    def test_stream_handle_takes_every_kind(self):
        class Torchish:
            cuda_stream = 0x1234

        class Cupyish:
            ptr = 0x5678

        class CudaCoreish:
            def __cuda_stream__(self):
                return (0, 0x9ABC)

        self.assertEqual(cudapool.stream_handle(None), 0)
        self.assertEqual(cudapool.stream_handle(7), 7)
        self.assertEqual(cudapool.stream_handle(Torchish()), 0x1234)
        self.assertEqual(cudapool.stream_handle(Cupyish()), 0x5678)
        self.assertEqual(cudapool.stream_handle(CudaCoreish()), 0x9ABC)
        with self.assertRaises(TypeError):
            cudapool.stream_handle("stream")
        with self.assertRaises(ValueError):
            cudapool.stream_handle(-1)


def fresh_python(test, code, **env):
    """Runs code in a new Python process whose environment has none of the helpers'
    settings (CUDAPOOL_RUNTIME, CUDAPOOL_DIR) plus env; returns its stdout."""
    e = {k: v for k, v in os.environ.items() if k not in ("CUDAPOOL_RUNTIME", "CUDAPOOL_DIR")}
    e["PYTHONPATH"] = os.path.dirname(os.path.dirname(cudapool.__file__))
    e.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    test.assertEqual(out.returncode, 0, "child failed:\n%s%s" % (out.stdout, out.stderr))
    return out


class RuntimeChoiceTest(unittest.TestCase):
    def test_environment_set_before_the_first_call_is_read(self):
        """N11: CUDAPOOL_RUNTIME set in os.environ before the first call chooses the
        runtime, whatever that call is, not only cudapool.init(). A preference no build
        knows tells, on every host, whether it was read."""
        for first in ("cudapool.runtime_info()", "cudapool.Pool(0).close()", "cudapool.Stream(0).close()"):
            out = fresh_python(self, "import os, cudapool\n"
                                     "os.environ['CUDAPOOL_RUNTIME'] = 'nonsense'\n"
                                     "try:\n"
                                     "    %s\n"
                                     "    print('chose a runtime')\n"
                                     "except cudapool.CudapoolError as e:\n"
                                     "    print(type(e).__name__, e)\n" % first)
            self.assertIn("InvalidArgument", out.stdout, "first call %s" % first)
            self.assertIn("nonsense", out.stdout, "first call %s" % first)

    def test_no_runtime_gives_python_advice(self):
        """Without a GPU, NoRuntime says what a Python caller can do (cudapool.init,
        $CUDAPOOL_RUNTIME), not what a Go program would."""
        out = fresh_python(self, "import cudapool\n"
                                 "try:\n"
                                 "    print('gpu', cudapool.runtime_info().on_gpu)\n"
                                 "except cudapool.NoRuntime as e:\n"
                                 "    print(e)\n")
        if out.stdout.startswith("gpu True"):
            self.skipTest("a GPU is there: no NoRuntime to read")
        self.assertIn('cudapool.init("auto")', out.stdout)
        self.assertIn("CUDAPOOL_RUNTIME=auto", out.stdout)
        self.assertNotIn("import github.com", out.stdout)


DLPACK_CONSUMER = """
import ctypes, sys
from cudapool import _dlpack

get = ctypes.pythonapi.PyCapsule_GetPointer
get.restype, get.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)


class Consumer:
    # What torch.from_dlpack keeps of a capsule: the managed tensor, whose deleter it
    # calls when the tensor goes, which at exit can be after cudapool's modules went.
    def __init__(self, cap):
        self.m = ctypes.cast(get(cap, b"dltensor"), ctypes.POINTER(_dlpack.DLManagedTensor))

    def __del__(self):
        self.m.contents.deleter(self.m)


class Owner:
    pass


held = [Consumer(_dlpack.capsule(Owner(), 0x1000, 0, _dlpack.dtype_of("<f4"), (4,), None, 4)) for _ in range(3)]
if sys.argv[1:] == ["torn-down"]:
    # As the interpreter's exit tears a module down: its globals go first.
    _dlpack.__dict__.clear()
    held.clear()
print("ok")
"""


class DLPackExitTest(unittest.TestCase):
    def test_deleter_after_the_module_is_gone_is_silent(self):
        """A DLPack consumer that frees its tensors at exit calls the capsules' deleter
        after cudapool's module globals are gone: it printed "Exception ignored on
        calling ctypes callback function: _delete ... NameError: name '_alive' is not
        defined" once per capsule. stderr must stay clean."""
        for how in ("exit", "torn-down"):
            e = {k: v for k, v in os.environ.items() if k not in ("CUDAPOOL_RUNTIME", "CUDAPOOL_DIR")}
            e["PYTHONPATH"] = os.path.dirname(os.path.dirname(cudapool.__file__))
            out = subprocess.run([sys.executable, "-c", DLPACK_CONSUMER, how], env=e, capture_output=True,
                                 text=True, timeout=CHILD_TIMEOUT)
            self.assertEqual((out.returncode, out.stdout.strip()), (0, "ok"), out.stderr)
            self.assertEqual(out.stderr, "", how)


class PoolTest(unittest.TestCase):
    def test_alloc_copy_free_stats(self):
        with cudapool.Pool(0, name="py-pool") as p, cudapool.Stream(0) as s:
            ptr = p.alloc(MiB, s)
            data = pattern(4096, 3)
            cudapool.copy_to_device(0, ptr, data, s)
            self.assertEqual(cudapool.copy_from_device(0, ptr, len(data), s), data)
            st = p.stats()
            self.assertEqual(st.live_buffers, 1)
            self.assertEqual(st.bytes_requested, MiB)
            self.assertGreaterEqual(st.bytes_reserved, MiB)
            cudapool.free(ptr, s)
            s.synchronize()
            self.assertEqual(p.stats().live_buffers, 0)

    def test_close_refuses_live_buffers_without_force(self):
        p = cudapool.Pool(0)
        ptr = p.alloc(MiB)
        with self.assertRaises(cudapool.Busy):
            p.close()
        self.assertEqual(p.stats().live_buffers, 1, "a refused close changes nothing")
        p.close(force=True)
        with self.assertRaises(cudapool.ForeignPointer):
            cudapool.free(ptr)  # force-closing released it

    def test_an_error_inside_with_is_not_hidden_by_busy(self):
        """A with block that fails with a buffer still live raises its own error, not
        the Busy of the close that __exit__ could not do (the README's example once
        showed Busy where its consumer had died)."""
        p = None
        with self.assertRaises(KeyError):
            with cudapool.Pool(0) as p:
                p.alloc(MiB)
                raise KeyError("the cause")
        self.assertEqual(p.stats().live_buffers, 1, "the pool is left open with its buffer")
        p.close(force=True)

    def test_local_pool_does_not_round(self):
        with cudapool.Pool(0, handle_type="none") as p:
            ptr = p.alloc(1000)
            self.assertEqual(p.stats().granularity, 1)
            cudapool.free(ptr)

    def test_cache_serves_the_next_alloc_on_the_stream(self):
        with cudapool.Pool(0, cache_bytes=8 * MiB) as p, cudapool.Stream(0) as s:
            a = p.alloc(MiB, s)
            cudapool.free(a, s)
            self.assertEqual(p.stats().cached_buffers, 1)
            self.assertEqual(p.alloc(MiB, s).ptr, a.ptr, "the cached buffer came back")
            self.assertEqual(p.stats().cached_buffers, 0)
            cudapool.free(a, s)
            s.synchronize()
            p.close(force=True)  # before the stream goes: the cache frees on it

    def test_max_size_bounds_the_pool(self):
        with cudapool.Pool(0, max_size=4 * MiB) as p:
            a = p.alloc(4 * MiB)
            with self.assertRaises(cudapool.OutOfMemory):
                p.alloc(MiB)
            cudapool.free(a)


class BadInputTest(unittest.TestCase):
    """Every bad input gets an error code and a message; none crashes the process."""

    def assertStatus(self, exc, status, text):
        self.assertEqual(exc.exception.status, status)
        self.assertIn(text, str(exc.exception))

    def test_null_pointers(self):
        l = _lib.lib()
        cases = [
            ("cudapool_alloc", (_lib.PoolH(1), MiB, None, 0, None), "ptr is NULL"),
            ("cudapool_free", (None, None), "ptr is NULL"),
            ("cudapool_pool_create", (0, None, None), "pool is NULL"),
            ("cudapool_exporter_listen", (None, None, ctypes.byref(_lib.ExporterH())), "path is NULL"),
            ("cudapool_importer_dial", (None, 0, None, 0, ctypes.byref(_lib.ImporterH())), "path is NULL"),
            ("cudapool_query_state", (None, 0, None, 0, None), "socket is NULL"),
            ("cudapool_protocol_version", (None,), "version is NULL"),
            ("cudapool_copy_to_device", (0, None, None, 1, None), "NULL"),
        ]
        for name, args, text in cases:
            with self.subTest(name):
                self.assertEqual(getattr(l, name)(*args), 1, name)
                self.assertIn(text, l.cudapool_last_error().decode())
        with cudapool.Pool(0) as p:
            ex = cudapool.Exporter(socket_path("null"))
            try:
                self.assertEqual(l.cudapool_exporter_publish(_lib.ExporterH(ex.handle), None, 1, 0, None, None, 0), 1)
                self.assertIn("name is NULL", l.cudapool_last_error().decode())
                self.assertEqual(l.cudapool_pool_stats_get(_lib.PoolH(p.handle), None), 1)
            finally:
                ex.close()

    def test_last_error_is_cleared_by_the_next_call(self):
        l = _lib.lib()
        self.assertNotEqual(l.cudapool_free(None, None), 0)
        self.assertTrue(l.cudapool_last_error())
        v = ctypes.c_int()
        self.assertEqual(l.cudapool_protocol_version(ctypes.byref(v)), 0)
        self.assertEqual(l.cudapool_last_error(), b"")

    def test_last_error_is_per_thread(self):
        import threading
        l = _lib.lib()
        self.assertNotEqual(l.cudapool_free(None, None), 0)
        seen = []
        t = threading.Thread(target=lambda: seen.append(l.cudapool_last_error()))
        t.start()
        t.join(CHILD_TIMEOUT)
        self.assertEqual(seen, [b""], "another thread's failure is not this one's")
        self.assertIn(b"ptr is NULL", l.cudapool_last_error())

    def test_torch_entry_points(self):
        l = _lib.lib()
        malloc, free = l.cudapool_torch_malloc, l.cudapool_torch_free
        malloc.restype, malloc.argtypes = ctypes.c_void_p, (ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
        free.restype, free.argtypes = None, (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
        ptr = malloc(MiB, 0, None)
        self.assertTrue(ptr, l.cudapool_last_error())
        h = _lib.PoolH()
        _lib.call("cudapool_torch_pool", 0, ctypes.byref(h))
        st = _lib.PoolStats()
        _lib.call("cudapool_pool_stats_get", h, ctypes.byref(st))
        self.assertGreaterEqual(st.live_buffers, 1)
        self.assertEqual(l.cudapool_pool_close(h, 1, 0), 1, "the allocator's pool cannot be closed")
        self.assertIn(b"serves the PyTorch allocator", l.cudapool_last_error())
        free(ptr, MiB, 0, None)
        free(ptr, MiB, 0, None)  # twice: an error to read, not a crash
        self.assertIn(b"not a pointer of a cudapool pool", l.cudapool_last_error())
        free(0xDEAD000, 16, 0, None)
        self.assertIsNone(malloc(0, 0, None), "an empty tensor gets NULL")
        self.assertIsNone(malloc(-1, 0, None))
        self.assertIn(b"negative", l.cudapool_last_error())
        self.assertIsNone(malloc(MiB, 64, None))
        self.assertIn(b"device 64", l.cudapool_last_error())
        # What the allocator gives, cudapool_free takes too (and publish finds).
        ptr = malloc(MiB, 0, None)
        cudapool.free(ptr)

    def test_torch_pools_read_the_environment_at_first_use(self):
        p, q = spawn(torch_env_child)
        self.assertEqual(result_of(self, p, q), {"first": True, "second": False, "oom": True})

    def test_pointer_no_pool_gave(self):
        with self.assertRaises(cudapool.ForeignPointer) as cm:
            cudapool.free(0x7F0000001000)
        self.assertIn("0x7f0000001000", str(cm.exception))

    def test_double_free(self):
        with cudapool.Pool(0) as p:
            ptr = p.alloc(MiB)
            cudapool.free(ptr)
            with self.assertRaises(cudapool.ForeignPointer):
                cudapool.free(ptr)

    def test_pointer_inside_a_buffer_is_not_freed(self):
        with cudapool.Pool(0) as p:
            ptr = p.alloc(MiB)
            with self.assertRaises(cudapool.ForeignPointer):
                cudapool.free(ptr.ptr + 4096)
            cudapool.free(ptr)

    def test_size_zero(self):
        with cudapool.Pool(0) as p:
            with self.assertRaises(cudapool.InvalidArgument) as cm:
                p.alloc(0)
            self.assertIn("zero-size", str(cm.exception))

    def test_handles(self):
        p = cudapool.Pool(0)
        h = p.handle
        ex = cudapool.Exporter(socket_path("handles"))
        try:
            l = _lib.lib()
            stats = ctypes.byref(_lib.PoolStats())
            for handle, text in [(0, "handle 0"), (ex.handle, "is the handle of an exporter, not of a pool"),
                                 (0xDEADBEEF, "not a cudapool handle"), (h + (1 << 20), "never issued")]:
                with self.subTest(hex(handle)):
                    self.assertEqual(l.cudapool_pool_stats_get(_lib.PoolH(handle), stats), 2)
                    self.assertIn(text, l.cudapool_last_error().decode())
            p.close()
            self.assertEqual(l.cudapool_pool_stats_get(_lib.PoolH(h), stats), 2)
            self.assertIn("closed or released", l.cudapool_last_error().decode())
            self.assertEqual(l.cudapool_pool_close(_lib.PoolH(h), 0, 0), 2, "a second close")
        finally:
            ex.close()

    def test_use_after_close(self):
        ex = cudapool.Exporter(socket_path("after-close"))
        h = ex.handle
        ex.close()
        self.assertEqual(_lib.lib().cudapool_exporter_unpublish(_lib.ExporterH(h), b"x"), 2)
        with cudapool.Pool(0) as p:
            ptr = p.alloc(MiB)
            ex._h = h
            with self.assertRaises(cudapool.InvalidHandle):
                ex.publish("x", ptr)
            ex._h = 0
            cudapool.free(ptr)

    def test_names(self):
        with cudapool.Pool(0) as p, cudapool.Exporter(socket_path("names")) as ex:
            ptr = p.alloc(MiB)
            for bad in ["", "x" * 256, "a\nb"]:
                with self.subTest(repr(bad[:10])):
                    with self.assertRaises(cudapool.InvalidArgument):
                        ex.publish(bad, ptr)
            ex.publish("x" * 255, ptr)
            with self.assertRaises(cudapool.NameInUse):
                ex.publish("x" * 255, ptr)
            with self.assertRaises(cudapool.NotFound):
                ex.unpublish("nope")
            ex.unpublish("x" * 255)
            cudapool.free(ptr)

    def test_publish_checks_the_range(self):
        with cudapool.Pool(0) as p, cudapool.Exporter(socket_path("range")) as ex:
            ptr = p.alloc(MiB)
            with self.assertRaises(cudapool.ForeignPointer):
                ex.publish("x", 0x7F0000001000, 16)
            with self.assertRaises(cudapool.InvalidArgument):
                ex.publish("x", ptr, MiB + 1)
            with self.assertRaises(cudapool.InvalidArgument):
                ex.publish("x", ptr, meta=b"m" * (cudapool.MAX_META + 1))
            cudapool.free(ptr)

    def test_negative_timeout(self):
        with self.assertRaises(ValueError):
            cudapool.Importer(socket_path("none"), timeout=-1)
        l = _lib.lib()
        self.assertEqual(l.cudapool_importer_dial(b"/nonexistent", 0, None, -5, ctypes.byref(_lib.ImporterH())), 1)
        self.assertIn("negative", l.cudapool_last_error().decode())

    def test_dial_nothing(self):
        with self.assertRaises(cudapool.Gone):
            cudapool.Importer(socket_path("nobody"), timeout=5)

    def test_state_buffer_too_small(self):
        with cudapool.Exporter(socket_path("small"), name="small") as ex:
            n = ctypes.c_size_t()
            buf = ctypes.create_string_buffer(8)
            l = _lib.lib()
            self.assertEqual(l.cudapool_exporter_state(_lib.ExporterH(ex.handle), buf, 8, ctypes.byref(n)), 14)
            self.assertGreater(n.value, 8, "the size needed")
            self.assertEqual(ex.state().name, "small")


def bounded(test, call, bound=10):
    """Runs call in a thread; returns the exception it raised (None if none), failing
    test if it has not returned within bound seconds."""
    got = []

    def run():
        try:
            call()
            got.append(None)
        except BaseException as e:  # noqa: B902 (handed to the test)
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    test.assertFalse(t.is_alive(), "the call still waits after %d s" % bound)
    return got[0]


class TimeoutConventionTest(unittest.TestCase):
    """Python's convention: timeout=0 is "do not wait" (threading.Event.wait(0),
    queue.get(timeout=0)): what is not there fails at once, as without wait_for_exporter; None
    is no bound. The C ABI's 0 is no bound and CUDAPOOL_NO_WAIT (-1) is Python's 0."""

    def test_conversion(self):
        self.assertEqual(_lib.timeout_ms(None), 0)
        self.assertEqual(_lib.timeout_ms(0), -1)
        self.assertEqual(_lib.timeout_ms(0.0), -1)
        self.assertEqual(_lib.timeout_ms(0.0001), 1)
        self.assertEqual(_lib.timeout_ms(2.5), 2500)
        with self.assertRaises(ValueError):
            _lib.timeout_ms(-1)

    def test_zero_does_not_wait_for_an_exporter(self):
        e = bounded(self, lambda: cudapool.Importer(socket_path("later"), timeout=0, wait_for_exporter=True))
        self.assertIsInstance(e, cudapool.Gone, "no exporter is there: at once, as without wait")

    def test_zero_does_not_wait_for_a_name(self):
        path = socket_path("noname")
        with cudapool.Exporter(path) as ex:
            p, q = spawn(open_with_timeout_zero, path)
            self.assertEqual(result_of(self, p, q), "NotFound")
            del ex

    def test_zero_does_not_wait_for_memory(self):
        with cudapool.Pool(0, max_size=4 * MiB, wait_for_memory=True) as p:
            a = p.alloc(4 * MiB)
            e = bounded(self, lambda: p.alloc(MiB, timeout=0))
            self.assertIsInstance(e, (cudapool.Timeout, cudapool.OutOfMemory))
            cudapool.free(a)


class RenamedKeywordTest(unittest.TestCase):
    """A keyword that makes a call wait for something to be there is wait_for_<thing>
    (Go's WaitFor<Thing>); wait=, the former name of Importer's and Importer.open's,
    still works, with a DeprecationWarning, and not beside the new one."""

    def test_wait_is_wait_for_exporter(self):
        with self.assertWarns(DeprecationWarning) as w, self.assertRaises(cudapool.Gone):
            cudapool.Importer(socket_path("later"), timeout=0, wait=True)  # timeout 0: at once
        self.assertIn("wait_for_exporter", str(w.warning))
        with self.assertRaises(TypeError):
            cudapool.Importer(socket_path("later"), timeout=0, wait_for_exporter=True, wait=True)


class SharingTest(unittest.TestCase):
    """A producer here, consumers in spawned processes."""

    def setUp(self):
        self.pool = cudapool.Pool(0, name="py-share")
        self.ex = cudapool.Exporter(socket_path("share"))
        self.addCleanup(self.pool.close, True)
        self.addCleanup(self.ex.close, 10)

    def publish(self, name, n, seed, **kw):
        ptr = self.pool.alloc(n)
        cudapool.copy_to_device(0, ptr, pattern(n, seed))
        self.ex.publish(name, ptr, **kw)
        return ptr

    def test_publish_open_release_across_processes(self):
        ptr = self.publish("kv", 2 * MiB, 11)
        p, q = spawn(consume, self.ex.path, "kv", 2 * MiB, 11, 0)
        r = result_of(self, p, q)
        self.assertTrue(r["ok"], "the consumer read the producer's bytes")
        self.assertEqual(r["size"], 2 * MiB)
        self.assertEqual(r["cai_stream"], 1, "the legacy default stream is 1 in the interface")
        self.assertEqual(self.pool.stats().active_leases, 0, "the consumer released")
        cudapool.free(ptr)

    def test_a_freed_buffers_name_is_unknown(self):
        """Opening a buffer its producer freed raised Gone though the exporter lived
        (issue 31): the free unpublished the name, and the open says so."""
        ptr = self.publish("freed", MiB, 13)
        cudapool.free(ptr)
        p, q = spawn(open_error, self.ex.path, "freed")
        self.assertEqual(result_of(self, p, q), "NotFound")

    def test_a_second_close_changes_nothing_a_second_release_raises(self):
        ptr = self.publish("twice", MiB, 12)
        p, q = spawn(release_twice, self.ex.path, "twice")
        self.assertEqual(result_of(self, p, q), {
            "release twice": "InvalidHandle", "close after release": None,
            "release after the with block": "InvalidHandle", "importer closed twice": True})
        self.assertEqual(self.pool.stats().active_leases, 0, "every open was released once")
        cudapool.free(ptr)
        with cudapool.Exporter(socket_path("twice"), announce=False) as ex:
            ex.close()
        ex.close()  # a third: still nothing

    def test_retained_imports_and_no_announcement(self):
        with cudapool.Pool(0, cache_bytes=8 * MiB) as pool, \
                cudapool.Exporter(socket_path("retain"), retain_imports=True, announce=False) as ex:
            ptr = pool.alloc(MiB)
            cudapool.copy_to_device(0, ptr, pattern(MiB, 3))
            ex.publish("kept", ptr)
            for _ in range(2):
                p, q = spawn(consume, ex.path, "kept", MiB, 3, 0)
                self.assertTrue(result_of(self, p, q)["ok"])
            sockets = []
            for f in os.listdir(os.environ["CUDAPOOL_DIR"]):
                if f.endswith(".json"):
                    with open(os.path.join(os.environ["CUDAPOOL_DIR"], f)) as a:
                        sockets.append(json.load(a)["socket"])
            self.assertIn(os.path.abspath(self.ex.path), sockets, "an exporter announces itself in $CUDAPOOL_DIR")
            self.assertNotIn(os.path.abspath(ex.path), sockets, "announce=False writes no announcement")
            cudapool.free(ptr)
            ex.close()
            pool.close(force=True)

    def test_free_while_consumer_holds_it_is_deferred(self):
        ptr = self.publish("held", MiB, 5)
        go = multiprocessing.get_context("spawn").Event()
        p, q = spawn(hold_then_release, self.ex.path, "held", MiB, 5, go)
        try:
            self.assertEqual(q.get(timeout=CHILD_TIMEOUT), "mapped")
            cudapool.free(ptr)  # deferred: the consumer still maps it
            self.assertEqual(self.pool.stats().deferred_frees, 1)
            o, oq = spawn(open_error, self.ex.path, "held")
            self.assertEqual(result_of(self, o, oq), "NotFound", "an open after the free: the name is unpublished")
        finally:
            go.set()
        self.assertTrue(result_of(self, p, q)["ok"], "the mapping stayed readable")
        deadline = time.monotonic() + CHILD_TIMEOUT
        while self.pool.stats().live_buffers and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(self.pool.stats().live_buffers, 0, "the free ran after the release")

    def test_metadata(self):
        meta = b'{"dtype": "float16", "shape": [4, 8]}'
        ptr = self.publish("meta", MiB, 2, meta=meta)
        p, q = spawn(consume, self.ex.path, "meta", MiB, 2, 0)
        self.assertEqual(result_of(self, p, q)["meta"], meta)
        cudapool.free(ptr)

    def test_sub_range(self):
        ptr = self.publish("slab", 4 * MiB, 9)
        self.ex.unpublish("slab")
        # A block inside the buffer, found from its address alone, as a tensor's.
        self.ex.publish("block", ptr.ptr + 1000, 3000)
        p, q = spawn(consume_range, self.ex.path, "block", 1000, 3000, 9)
        r = result_of(self, p, q)
        self.assertTrue(r["ok"])
        self.assertEqual(r["size"], 3000)
        cudapool.free(ptr)

    def test_dlpack_and_array_interface(self):
        ptr = self.publish("arr", MiB, 4)
        p, q = spawn(dlpack_fields, self.ex.path, "arr")
        r = result_of(self, p, q)
        self.assertEqual(r["cai"]["shape"], (4, 8))
        self.assertEqual(r["cai"]["typestr"], "<f4")
        self.assertEqual(r["cai"]["version"], 3)
        self.assertEqual(r["cai"]["data"], (r["ptr"] + 64, False))
        self.assertEqual(r["device"], (2, 0))
        self.assertEqual(r["dl"], {"data": r["ptr"] + 64, "device": (2, 0), "ndim": 2,
                                   "dtype": (2, 32, 1), "shape": [4, 8], "strides": [8, 1],
                                   "alive_after_delete": 0})
        cudapool.free(ptr)

    def test_publish_keeps_an_array_until_unpublish(self):
        import gc
        import weakref

        class Array:
            def __init__(self, ptr, n):
                self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                                 "version": 3, "strides": None}

        ptr = self.pool.alloc(MiB)
        a = Array(ptr, MiB)
        alive = weakref.ref(a)
        self.ex.publish("kept", a)
        del a
        gc.collect()
        self.assertIsNotNone(alive(), "a published array is kept")
        self.assertEqual(self.ex.state().published[0].size, MiB)
        self.ex.unpublish("kept")
        gc.collect()
        self.assertIsNone(alive(), "unpublish lets it go")
        cudapool.free(ptr)

    def test_state_query(self):
        ptr = self.publish("seen", MiB, 1)
        st = cudapool.query_state(self.ex.path)
        self.assertEqual([n.name for n in st.published], ["seen"])
        self.assertEqual(st.pid, os.getpid())
        cudapool.free(ptr)


def open_with_timeout_zero(q, path):
    try:
        with cudapool.Importer(path, timeout=10) as imp:
            try:
                imp.open("never", timeout=0, wait_for_name=True).release()
                q.put("opened")
            except cudapool.NotFound:
                q.put("NotFound")
    except Exception as e:
        q.put(failure(e))


def torch_env_child(q):
    """Sets the allocator's bound after the library loaded, as a Python program does, and
    allocates past it."""
    try:
        l = _lib.lib()
        cudapool.init(os.environ["CUDAPOOL_RUNTIME"])
        os.environ["CUDAPOOL_TORCH_MAX_SIZE"] = str(4 * MiB)
        malloc = l.cudapool_torch_malloc
        malloc.restype, malloc.argtypes = ctypes.c_void_p, (ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
        first = malloc(4 * MiB, 0, None)
        second = malloc(MiB, 0, None)
        q.put({"first": bool(first), "second": bool(second),
               "oom": b"out of memory" in l.cudapool_last_error()})
    except Exception as e:
        q.put(failure(e))


def hold_then_release(q, path, name, n, seed, go):
    """A consumer that maps name, says so, and reads and releases it once go is set."""
    try:
        imp = cudapool.Importer(path, device=0)
        m = imp.open(name)
        q.put("mapped")
        wait_go(go)
        got = cudapool.copy_from_device(0, m.ptr, n)
        m.release()
        imp.close()
        q.put({"ok": got == pattern(n, seed)})
    except Exception as e:
        q.put(failure(e))


def open_error(q, path, name):
    """Opens name, expecting a failure: puts the error's class name."""
    try:
        imp = cudapool.Importer(path, device=0)
        try:
            imp.open(name).release()
            q.put("opened")
        except cudapool.CudapoolError as e:
            q.put(type(e).__name__)
        imp.close()
    except Exception as e:
        q.put(failure(e))


def dlpack_fields(q, path, name):
    """Opens name and reads back the DLPack capsule a float32 view of it makes."""
    try:
        from cudapool import _dlpack
        imp = cudapool.Importer(path, device=0)
        m = imp.open(name)
        v = m.view("<f4", (4, 8), offset=64)
        cap = v.__dlpack__(stream=-1)
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)
        mt = _dlpack.DLManagedTensor.from_address(get(cap, b"dltensor"))
        t = mt.dl_tensor
        dl = {"data": t.data, "device": (t.device.device_type, t.device.device_id), "ndim": t.ndim,
              "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes), "shape": [t.shape[0], t.shape[1]],
              "strides": [t.strides[0], t.strides[1]]}
        mt.deleter(ctypes.pointer(mt))  # what a consumer does when done with it
        dl["alive_after_delete"] = len(_dlpack._alive)
        res = {"cai": v.__cuda_array_interface__, "ptr": m.ptr, "device": v.__dlpack_device__(), "dl": dl}
        m.release()
        imp.close()
        q.put(res)
    except Exception as e:
        q.put(failure(e))


def consume_range(q, path, name, offset, n, seed):
    try:
        imp = cudapool.Importer(path, device=0)
        m = imp.open(name)
        got = cudapool.copy_from_device(0, m.ptr, n)
        m.release()
        imp.close()
        q.put({"ok": got == pattern(offset + n, seed)[offset:], "size": m.size})
    except Exception as e:
        q.put(failure(e))


class ForkTest(unittest.TestCase):
    def test_forked_child_fails_clearly(self):
        cudapool.protocol_version()  # the library is loaded and its Go runtime running
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no Go runtime survives here
            os.close(r)
            try:
                cudapool.runtime_info()
                msg = b"no error"
            except cudapool.ForkedProcess as e:
                msg = b"ok " + str(e).encode()
            except BaseException as e:
                msg = ("wrong error %r" % e).encode()
            os.write(w, msg)
            os._exit(0)
        os.close(w)
        deadline = time.monotonic() + CHILD_TIMEOUT
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                self.fail("the forked child hung calling the library")
            time.sleep(0.01)
        msg = os.read(r, 4096).decode()
        os.close(r)
        self.assertTrue(msg.startswith("ok "), msg)
        self.assertIn("spawn", msg)
        self.assertIn("forked", msg)


if __name__ == "__main__":
    unittest.main()
