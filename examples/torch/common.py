"""What the torch examples share: finding the cudapool package, the splitmix64 pattern
the Go examples fill and check (examples/kvshare), computed with torch or CuPy ops,
and bounded waits on child processes."""

import functools
import multiprocessing
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("CUDAPOOL_LIB", os.path.join(ROOT, "bin", "libcudapool.so"))

import cudapool  # noqa: E402

TIMEOUT = 120  # seconds any step may take


def _signed(c):
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN, MIX1, MIX2 = (_signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9),
                      _signed(0x94D049BB133111EB))


def splitmix(xp, seed, n, **arange_kw):
    """Words 0..n-1 of the pattern for seed, as int64 (the same bits as the Go uint64
    words): splitmix64(seed + i*golden). xp is torch or cupy; int64 products wrap as
    uint64 ones do, and >> on int64 shifts in sign bits, so logical shifts are masked."""
    def srl(z, k):
        return (z >> k) & ((1 << (64 - k)) - 1)
    z = xp.arange(n, dtype=xp.int64, **arange_kw) * GOLDEN + seed
    z = (z ^ srl(z, 30)) * MIX1
    z = (z ^ srl(z, 27)) * MIX2
    return z ^ srl(z, 31)


def spawn(target, *args):
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q,) + args)
    p.start()
    return p, q


def result(p, q, what):
    """The one result child p put on q; raises if none came in time or it failed."""
    try:
        r = q.get(timeout=TIMEOUT)
    except Exception:
        p.kill()
        raise RuntimeError("%s gave no result in %d s" % (what, TIMEOUT))
    p.join(TIMEOUT)
    if p.is_alive():
        p.kill()
        raise RuntimeError("%s did not exit in %d s" % (what, TIMEOUT))
    if isinstance(r, BaseException):
        raise RuntimeError("%s failed: %s: %s" % (what, type(r).__name__, r))
    return r


def guarded(fn):
    """Runs a child's body, putting its exception on the queue instead of losing it."""
    @functools.wraps(fn)  # the same name, so that spawn finds it in the child
    def run(q, *args):
        try:
            fn(q, *args)
        except BaseException as e:
            q.put(RuntimeError("%s: %s" % (type(e).__name__, e)))
    return run
