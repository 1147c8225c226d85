"""The KV page pool's cost from Python (cudapool.kv over libcudapool), one line per row:

    kv match+release/512            match of 512 visible pages (hashes computed before) and
                                    the release of their read lease: two round trips
    kv match/512                    the match alone, as gosuite's kv/match512 times it: one
                                    round trip, the read lease included (its release untimed)
    kv hashes+match/512             the same with the hashes of the 8192 tokens computed by
                                    Replica.hashes (in the library) in the loop
    kv hashes+match+release/512     hashes, match and release
    kv prefix_hashes/512            those hashes by kv.prefix_hashes (the library's
                                    cudapool_kv_prefix_hashes), from a list of ints and
                                    from an array('i') ("kv prefix_hashes array/512")
    kv prefix_hashes reference/512  the pure-Python reference of them (hashlib)
    kv alloc+release/64             a write lease of 64 pages given back unwritten

Each row prints "# ROW: p50 X us, p99 Y us, N samples"; kv match/512 and kv
hashes+match/512 also print the benchmark suite's lines "result python kv/match512 us
MEDIAN P90 N" and "raw python kv/match512 us V..." (kv/match512+hash for the other;
bench/suitelines.py, read by bench/table.py), so that scripts/bench-suite.sh sets them
beside gosuite's rows of the same names. It starts a kvpoold of its own (--kvpoold,
else $CUDAPOOL_KVPOOLD, else bin/kvpoold) serving a temporary directory on the runtime
given (auto: a GPU where there is one, else the software device), and runs the replica
in this process; libcudapool is $CUDAPOOL_LIB (python/cudapool/_lib.py).

Usage: python3 bench/kvbench.py [--runtime auto|gpu|test] [--samples N | --quick] [--kvpoold PATH]
"""

import argparse
from array import array
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

import cudapool  # noqa: E402
from cudapool import kv  # noqa: E402
from suitelines import summarize  # noqa: E402

PAGES = 512


def row(name, samples, op=None):
    """Prints name's p50 and p99 as a comment, and with op the suite's result and raw
    lines of impl python (in us)."""
    v = sorted(samples)
    p50, p99 = v[len(v) // 2], v[min(len(v) - 1, int(0.99 * (len(v) - 1) + 0.5))]
    print("# %s: p50 %.1f us, p99 %.1f us, %d samples" % (name, p50 * 1e6, p99 * 1e6, len(v)), flush=True)
    if op:
        summarize("python", op, "us", [x * 1e6 for x in v])


def timed(n, warmup, f):
    for _ in range(warmup):
        f()
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        f()
        out.append(clock() - t0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", default="auto", choices=("auto", "gpu", "test"))
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="few samples (200), for a dry run")
    ap.add_argument("--kvpoold", default=os.environ.get("CUDAPOOL_KVPOOLD") or os.path.join(ROOT, "bin", "kvpoold"))
    ap.add_argument("--device", type=int, default=0)
    a = ap.parse_args()
    if a.quick:
        a.samples = 200
    why = cudapool.init(a.runtime)
    print("# " + why, flush=True)
    on_gpu, _, _ = cudapool.runtime_info()
    tmp = tempfile.mkdtemp(prefix="kvbench-")
    serve = os.path.join(tmp, "owner")
    log = open(os.path.join(tmp, "kvpoold.log"), "wb")
    owner = subprocess.Popen([a.kvpoold, "-dir", serve, "-layout", "llama-0.85b", "-pages", str(2 * PAGES),
                              "-devices", str(a.device), "-runtime", "gpu" if on_gpu else "test"],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        r = kv.Replica(serve, device=a.device, wait_for_owner=True, timeout=60)
        run(r, a.samples)
        r.close()
    except BaseException:
        log.flush()
        with open(os.path.join(tmp, "kvpoold.log"), "rb") as f:
            sys.stderr.write("kvpoold's log:\n" + f.read().decode(errors="replace"))
        raise
    finally:
        owner.send_signal(signal.SIGTERM)
        try:
            owner.wait(30)
        except subprocess.TimeoutExpired:
            owner.kill()
            owner.wait(30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def run(r, n):
    g = r.geometry
    toks = [(i * 7919) % 128000 for i in range(PAGES * g.tokens_per_page)]
    hs = r.hashes(toks)
    assert hs == kv.prefix_hashes(toks, g.tokens_per_page, reference=True), "the library's hashes are the reference's"
    l = r.alloc(PAGES)
    r.seal(l, hs, wait=True)
    m = r.match(hs)
    assert len(m) == PAGES, "matched %d of %d" % (len(m), PAGES)
    r.release(m)

    def match_release():
        r.release(r.match(hs))

    row("kv match+release/%d" % PAGES, timed(n, n // 10, match_release))

    held = []

    def match_only():
        held.append(r.match(hs))

    samples = []
    for _ in range(max(1, n // 100)):
        samples += timed(100, 0, match_only)
        r.release(*held)
        held.clear()
    row("kv match/%d" % PAGES, samples, "kv/match%d" % PAGES)

    def hash_match():
        held.append(r.match(r.hashes(toks)))

    samples = []
    for _ in range(max(1, n // 400)):
        samples += timed(100, 0, hash_match)
        r.release(*held)
        held.clear()
    row("kv hashes+match/%d" % PAGES, samples, "kv/match%d+hash" % PAGES)

    def hash_match_release():
        r.release(r.match(r.hashes(toks)))

    row("kv hashes+match+release/%d" % PAGES, timed(max(1, n // 4), 10, hash_match_release))
    row("kv prefix_hashes/%d" % PAGES, timed(max(1, n // 4), 10, lambda: kv.prefix_hashes(toks, g.tokens_per_page)))
    arr = array("i", toks)
    row("kv prefix_hashes array/%d" % PAGES, timed(max(1, n // 4), 10, lambda: kv.prefix_hashes(arr, g.tokens_per_page)))
    row("kv prefix_hashes reference/%d" % PAGES,
        timed(max(1, n // 20), 2, lambda: kv.prefix_hashes(toks, g.tokens_per_page, reference=True)))

    def alloc_release():
        r.release(r.alloc(64))

    row("kv alloc+release/64", timed(n, n // 10, alloc_release))


if __name__ == "__main__":
    main()
