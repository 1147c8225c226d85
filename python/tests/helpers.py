"""Shared set-up of the Python tests: where the package and the library are, the runtime
the tests run on, and bounded waits for child processes."""

import multiprocessing
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# The library reads its environment when it loads (at the first call): set it first.
REQUIRE_GPU = os.environ.get("CUDAPOOL_REQUIRE_GPU") == "1"
os.environ.setdefault("CUDAPOOL_RUNTIME", "gpu" if REQUIRE_GPU else "auto")
os.environ.setdefault("CUDAPOOL_DIR", tempfile.mkdtemp(prefix="cudapool-pytest-"))

import cudapool  # noqa: E402

CHILD_TIMEOUT = 60  # seconds any child process may take


def can_stall():
    """Whether the library can hold a stream (cudapool_test_stall_stream): only a build
    with the software device can."""
    from cudapool import _lib
    return hasattr(_lib.lib(), "cudapool_test_stall_stream")


def stall_stream(test, stream):
    """Holds stream (a cudapool.Stream) of the software device, as Go's cudarttest Stall
    does, through libcudapool's test-only cudapool_test_stall_stream: work queued on it
    afterwards does not run until the returned resume is called (or the test ends).
    Skips the test where the library has no such call (built without the software
    device). test None (in a child process) raises instead, and nothing resumes the
    stream but resume or the process's end."""
    import ctypes
    from cudapool import _lib
    lib = _lib.lib()
    try:
        stall, resume = lib.cudapool_test_stall_stream, lib.cudapool_test_resume
    except AttributeError:
        if test is None:
            raise RuntimeError("libcudapool was built without the software device: nothing can hold a stream")
        test.skipTest("libcudapool was built without the software device: nothing can hold a stream")
    stall.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
    resume.argtypes = [ctypes.c_uint64]
    token = ctypes.c_uint64()
    status = stall(stream.device, stream.handle, ctypes.byref(token))
    if status != 0:
        raise _lib.error(status)
    done = []

    def go():
        if not done:
            done.append(True)
            status = resume(token.value)
            if status != 0:
                raise _lib.error(status)
    if test is not None:
        test.addCleanup(go)
    return go


def socket_path(tag):
    return os.path.join(os.environ["CUDAPOOL_DIR"], "%s-%d.sock" % (tag, os.getpid()))


def spawn(target, *args):
    """Runs target(queue, *args) in a spawned process; returns (process, queue)."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q,) + args)
    p.start()
    return p, q


def wait_go(go):
    """Waits in a child until the parent sets the event go, at most CHILD_TIMEOUT."""
    if not go.wait(CHILD_TIMEOUT):
        raise TimeoutError("the parent never said go")


def failure(e):
    """What a child puts on its queue for the exception e: result_of fails on it."""
    return "error: %s: %s" % (type(e).__name__, e)


def result_of(test, p, q):
    """The one result p put on q, failing test if none came in time or p failed."""
    try:
        r = q.get(timeout=CHILD_TIMEOUT)
    except Exception:
        p.kill()
        p.join(5)
        test.fail("child process gave no result in %d s (exit code %s)" % (CHILD_TIMEOUT, p.exitcode))
    p.join(CHILD_TIMEOUT)
    if p.is_alive():
        p.kill()
        test.fail("child process did not exit in %d s" % CHILD_TIMEOUT)
    if isinstance(r, str) and r.startswith("error:"):
        test.fail("child process failed: " + r)
    test.assertEqual(p.exitcode, 0, "child process exit code")
    return r


def need(module):
    """Imports module, or skips the test where it is absent (fails under
    CUDAPOOL_REQUIRE_GPU=1, where it must be there)."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        if REQUIRE_GPU:
            raise AssertionError("CUDAPOOL_REQUIRE_GPU=1 but %s does not import: %s" % (module, e))
        raise unittest.SkipTest("%s is not installed" % module)


def need_gpu():
    on_gpu, n, _ = cudapool.runtime_info()
    if not on_gpu:
        if REQUIRE_GPU:
            raise AssertionError("CUDAPOOL_REQUIRE_GPU=1 but cudapool runs on the software device")
        raise unittest.SkipTest("no GPU: cudapool runs on the software device")
    return n
