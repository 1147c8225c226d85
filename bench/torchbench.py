"""The torch and Python rows of cudapool's benchmark suite (issue 10).

Prints, in the suite's format (bench/table.py reads it),

    result IMPL OP UNIT MEDIAN P90 N
    raw IMPL OP UNIT V1 V2 ...

for what can be measured on this host, "absent IMPL OP REASON" for a row whose
cudapool side is not in the repository, and "fail IMPL OP REASON" for one that
could not be taken. The rows:

    torch alloc/1MiB/native         torch.empty + del of 1 MiB, torch's caching allocator
    torch alloc/1MiB/cudaMallocAsync  the same, PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
                                    (every tensor reaches the driver)
    torch alloc/1MiB/cudapool       the same, cudapool the current allocator
                                    (cudapool.torch.use_as_current: every tensor reaches it)
    torch alloc/1MiB/cudapool-cache the same, its pools with a per-stream cache
                                    (CUDAPOOL_TORCH_CACHE=64 MiB: a free on a stream serves
                                    that stream's next allocation without the driver, as
                                    torch's own caching allocator does)
    python open+release/exported    the Python package: Importer.open + Mapping.release of
                                    buffers published before (a ring of 64 of 2 MiB), as
                                    bench/gosuite's open+release/exported
    torch read/own, read/mapping    a torch consumer's copies (1 GiB, CUDA events, each byte
                                    counted once) out of its own memory and out of a cudapool
                                    mapping (torch.as_tensor of the Mapping), alternated

An allocator is chosen once per process, so each alloc row runs in a child process
of its own; the sharing rows run in a producer child and a consumer child it starts.
Times: us per pair, batches of PAIRS pairs closed by a synchronize, one untimed
batch then BATCHES measured, as bench/cref; per operation, WARMUP untimed then
SAMPLES timed.

libcudapool is $CUDAPOOL_LIB, else bin/gpu/libcudapool.so, else bin/libcudapool.so.

Usage: python3 bench/torchbench.py [--quick] [--runtime auto|gpu|test]
"""

import os
import subprocess
import sys
import time

from suitelines import summarize  # bench/, the script's own folder

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FULL = dict(batches=15, pairs=10000, copies=20, read_size=1 << 30, warmup=20, samples=200, ring=64)
QUICK = dict(batches=3, pairs=100, copies=2, read_size=8 << 20, warmup=2, samples=10, ring=4)
SHARE_SIZE = 2 << 20
CHILD_TIMEOUT = 90
failed = []  # the rows said to have failed: the exit status says so


def fail(impl, op, why):
    failed.append((impl, op))
    print("fail %s %s %s" % (impl, op, why), flush=True)


def alloc_pairs(shape):
    """torch.empty + del of 1 MiB on the current stream, in batches."""
    import torch
    torch.cuda.set_device(0)
    torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # the allocator's first segment, untimed
    torch.cuda.synchronize()
    us = []
    for b in range(-1, shape["batches"]):
        t0 = time.monotonic_ns()
        for _ in range(shape["pairs"]):
            x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            del x
        torch.cuda.synchronize()
        if b >= 0:
            us.append((time.monotonic_ns() - t0) / 1e3 / shape["pairs"])
    return us


def timed_copies(dst, src, copies):
    """GB/s of each of copies copies of src into dst on torch's current stream, after
    one untimed, timed with CUDA events."""
    import torch
    dst.copy_(src)
    gbs = []
    for _ in range(copies):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        e1.synchronize()
        gbs.append(src.numel() / (e0.elapsed_time(e1) / 1e3) / 1e9)
    return gbs


def cudapool_env(runtime):
    """The environment a child needs for the Python package: its path and the library."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "python"),
                                                                    os.environ.get("PYTHONPATH")])))
    if "CUDAPOOL_LIB" not in env:
        for cand in (os.path.join(ROOT, "bin", "gpu", "libcudapool.so"), os.path.join(ROOT, "bin", "libcudapool.so")):
            if os.path.exists(cand):
                env["CUDAPOOL_LIB"] = cand
                break
    env["TORCHBENCH_RUNTIME"] = runtime
    return env


def producer(shape, quick):
    """A cudapool producer: a ring of buffers and one of read_size, published; then the
    consumer, whose lines it passes on."""
    import tempfile
    import cudapool
    cudapool.init(os.environ.get("TORCHBENCH_RUNTIME", "auto"))
    d = tempfile.mkdtemp(prefix="torchbench")
    path = os.path.join(d, "x.sock")
    s = cudapool.Stream(0)
    pool = cudapool.Pool(0, name="torchbench")
    ex = cudapool.Exporter(path)
    bufs = []
    try:
        for i in range(shape["ring"]):
            bufs.append(pool.alloc(SHARE_SIZE, s))
            ex.publish("ring%d" % i, bufs[-1], SHARE_SIZE, s)
        bufs.append(pool.alloc(shape["read_size"], s))
        ex.publish("big", bufs[-1], shape["read_size"], s)
        s.synchronize()
        args = [sys.executable, os.path.abspath(__file__), "child", "consumer", path] + (["--quick"] if quick else [])
        p = subprocess.run(args, capture_output=True, text=True, timeout=CHILD_TIMEOUT - 10)
        sys.stdout.write(p.stdout)
        if p.returncode != 0:
            sys.stderr.write(p.stderr)
            raise RuntimeError("the consumer failed: %s" % (p.stderr.strip().splitlines() or ["?"])[-1])
    finally:
        ex.close()
        for b in bufs:
            b.free(s)
        s.synchronize()
        pool.close(force=True)
    return 0


def consumer(path, shape):
    """The consumer of producer: Python open+release of the ring, then (with torch) the
    read of the big buffer against a read of its own memory, alternated."""
    import cudapool
    cudapool.init(os.environ.get("TORCHBENCH_RUNTIME", "auto"))
    imp = cudapool.Importer(path, device=0)
    s = cudapool.Stream(0)
    us = []
    for i in range(shape["warmup"] + shape["samples"]):
        t0 = time.monotonic_ns()
        imp.open("ring%d" % (i % shape["ring"]), stream=s).release()
        us.append((time.monotonic_ns() - t0) / 1e3)
    summarize("python", "open+release/exported", "us", us[shape["warmup"]:])
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no GPU")
    except Exception as e:
        for op in ("read/own", "read/mapping"):
            print("fail torch %s torch is not usable here: %s: %s" % (op, type(e).__name__, e), flush=True)
        imp.close()
        return 0
    torch.cuda.set_device(0)
    m = imp.open("big", stream=torch.cuda.current_stream())
    mapped = torch.as_tensor(m, device="cuda:0")
    own = torch.empty_like(mapped)
    own.fill_(0x5A)
    dst = torch.empty_like(mapped)
    got = {"read/own": [], "read/mapping": []}
    for _ in range(shape["copies"]):  # alternated, so that both see the same GPU state
        got["read/own"] += timed_copies(dst, own, 1)
        got["read/mapping"] += timed_copies(dst, mapped, 1)
    for op, v in got.items():
        summarize("torch", op, "GB/s", v)
    torch.cuda.synchronize()
    del mapped
    m.release(torch.cuda.current_stream())
    imp.close()
    return 0


def child(argv, shape, quick):
    """Runs in a child process: one measurement, printed."""
    what = argv[0]
    if what in ("alloc/1MiB/cudapool", "alloc/1MiB/cudapool-cache"):
        import cudapool
        import cudapool.torch as cpt
        cudapool.init(os.environ.get("TORCHBENCH_RUNTIME", "auto"))
        cpt.use_as_current()
        summarize("torch", what, "us", alloc_pairs(shape))
    elif what.startswith("alloc/"):
        summarize("torch", what, "us", alloc_pairs(shape))
    elif what == "producer":
        return producer(shape, quick)
    elif what == "consumer":
        return consumer(argv[1], shape)
    else:
        raise ValueError("unknown measurement %r" % what)
    return 0


def run_child(what, quick, env=None, ops=None):
    """Runs one measurement in a child process and passes its lines on; a failure is
    said for each of ops (default: what) that the child did not report."""
    args = [sys.executable, os.path.abspath(__file__), "child", what] + (["--quick"] if quick else [])
    ops = ops or [(what.split("/")[0] if what.startswith("python") else "torch", what)]
    try:
        p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
        out, rc, err = p.stdout, p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        out, rc, err = e.stdout or "", None, "timed out after %d s" % CHILD_TIMEOUT
        out = out.decode() if isinstance(out, bytes) else out
    sys.stdout.write(out)
    sys.stdout.flush()
    failed.extend(line for line in out.splitlines() if line.startswith("fail "))
    if rc != 0:
        sys.stderr.write(err if isinstance(err, str) else "")
        lines = err.strip().splitlines() if isinstance(err, str) else []
        why = lines[-1][:300] if lines else "exit status %s" % rc
        for impl, op in ops:
            if "result %s %s " % (impl, op) not in out:
                fail(impl, op, why)


def main(argv):
    quick = "--quick" in argv
    shape = QUICK if quick else FULL
    runtime = argv[argv.index("--runtime") + 1] if "--runtime" in argv[:-1] else "auto"
    if argv[:1] == ["child"] and len(argv) >= 2:
        return child(argv[1:], shape, quick)
    try:
        import torch
        print("# torchbench: torch %s, GPU %s" % (torch.__version__, torch.cuda.is_available()), flush=True)
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no GPU")
    except Exception as e:
        for op in ("alloc/1MiB/native", "alloc/1MiB/cudaMallocAsync", "alloc/1MiB/cudapool"):
            fail("torch", op, "torch is not usable here: %s: %s" % (type(e).__name__, e))
        torch = None
    if torch is not None:
        run_child("alloc/1MiB/native", quick, env={k: v for k, v in os.environ.items()
                                                    if k != "PYTORCH_CUDA_ALLOC_CONF"})
        run_child("alloc/1MiB/cudaMallocAsync", quick,
                  env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync"))
    if not os.path.isdir(os.path.join(ROOT, "python", "cudapool")):
        for impl, op in (("torch", "alloc/1MiB/cudapool"), ("torch", "alloc/1MiB/cudapool-cache"),
                         ("python", "open+release/exported"), ("torch", "read/own"), ("torch", "read/mapping")):
            print("absent %s %s python/cudapool (issue 10) is not in this checkout" % (impl, op), flush=True)
        return 0
    env = cudapool_env(runtime)
    if "CUDAPOOL_LIB" not in env:
        for impl, op in (("torch", "alloc/1MiB/cudapool"), ("torch", "alloc/1MiB/cudapool-cache"),
                         ("python", "open+release/exported"), ("torch", "read/own"), ("torch", "read/mapping")):
            fail(impl, op, "no libcudapool.so: set CUDAPOOL_LIB, or build bin/gpu/libcudapool.so (scripts/build-gpu.sh)")
        return 1
    if torch is not None:
        run_child("alloc/1MiB/cudapool", quick, env=env)
        run_child("alloc/1MiB/cudapool-cache", quick, env=dict(env, CUDAPOOL_TORCH_CACHE=str(64 << 20)))
    run_child("producer", quick, env=env, ops=[("python", "open+release/exported"), ("torch", "read/own"),
                                               ("torch", "read/mapping")])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
