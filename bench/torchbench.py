"""The torch rows of cudapool's benchmark suite (issue 10).

Prints, in the suite's format (bench/table.py reads it),

    result torch OP UNIT MEDIAN P90 N
    raw torch OP UNIT V1 V2 ...

for what can be measured on this host, "absent IMPL OP REASON" for a row whose
cudapool side is not in the repository yet, and "fail IMPL OP REASON" for one
that could not be taken. The rows:

    alloc/1MiB/native           torch.empty + del of 1 MiB, torch's caching allocator
    alloc/1MiB/cudaMallocAsync  the same with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
                                (every tensor reaches the driver)
    alloc/1MiB/cudapool         the same with cudapool as the current allocator
                                (torch.cuda.memory.change_current_allocator)
    read/own                    a copy of 1 GiB of the process's own memory, same GPU
    read/mapping                the same out of a cudapool mapping
    python open+release/exported   the Python package's open+release of a buffer
                                already exported

An allocator is chosen once per process, so each alloc row runs in a child
process of its own. Times: us per pair, batches of PAIRS pairs closed by a
synchronize, one untimed batch then BATCHES measured, as bench/cref. Copies are
timed with CUDA events, GB/s with each byte counted once, as bench/cref.

Usage: python3 bench/torchbench.py [--quick]
"""

import os
import subprocess
import sys
import time

from suitelines import summarize  # bench/, the script's own folder

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FULL = dict(batches=15, pairs=10000, copies=20, read_size=1 << 30)
QUICK = dict(batches=3, pairs=100, copies=2, read_size=8 << 20)
CHILD_TIMEOUT = 60


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


def read_own(shape):
    """GB/s of copies of the process's own memory into its own memory, same GPU."""
    import torch
    torch.cuda.set_device(0)
    src = torch.full((shape["read_size"],), 0x5A, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    gbs = []
    for _ in range(shape["copies"]):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        e1.synchronize()
        gbs.append(src.numel() / (e0.elapsed_time(e1) / 1e3) / 1e9)
    if not torch.equal(dst[:4096], src[:4096]):
        raise RuntimeError("the copy did not copy")
    return gbs


def child(what, shape):
    """Runs in a child process: one measurement, printed."""
    if what.startswith("alloc/"):
        summarize("torch", what, "us", alloc_pairs(shape))
    elif what == "read/own":
        summarize("torch", what, "GB/s", read_own(shape))
    else:
        raise ValueError("unknown measurement %r" % what)
    return 0


def run_child(what, quick, env=None):
    """Runs one measurement in a child process and passes its lines on."""
    args = [sys.executable, os.path.abspath(__file__), "child", what] + (["--quick"] if quick else [])
    try:
        p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        print("fail torch %s timed out after %d s" % (what, CHILD_TIMEOUT), flush=True)
        return
    sys.stdout.write(p.stdout)
    sys.stdout.flush()
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["exit status %d" % p.returncode])[-1]
        print("fail torch %s %s" % (what, last[:300]), flush=True)


def cudapool_package():
    """Where the Python package of issue 10 would be, or None."""
    d = os.path.join(ROOT, "python", "cudapool")
    return d if os.path.isdir(d) else None


def main(argv):
    quick = "--quick" in argv
    shape = QUICK if quick else FULL
    if argv[:1] == ["child"] and len(argv) >= 2:
        return child(argv[1], shape)
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no GPU")
        print("# torchbench: torch %s" % torch.__version__, flush=True)
    except Exception as e:
        for op in ("alloc/1MiB/native", "alloc/1MiB/cudaMallocAsync", "read/own"):
            print("fail torch %s torch is not usable here: %s: %s" % (op, type(e).__name__, e), flush=True)
        torch = None
    if torch is not None:
        run_child("alloc/1MiB/native", quick, env={k: v for k, v in os.environ.items()
                                                    if k != "PYTORCH_CUDA_ALLOC_CONF"})
        run_child("alloc/1MiB/cudaMallocAsync", quick,
                  env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync"))
        run_child("read/own", quick)
    # The cudapool side of issue 10: libcudapool and the Python package.
    pkg = cudapool_package()
    rows = (("torch", "alloc/1MiB/cudapool"), ("torch", "read/mapping"), ("python", "open+release/exported"))
    for impl, op in rows:
        if pkg is None:
            print("absent %s %s libcudapool and python/cudapool (issue 10) are not on main" % (impl, op), flush=True)
        else:
            # Loud, not quiet: the package landed and this script must learn to drive it.
            print("fail %s %s python/cudapool is on main but bench/torchbench.py does not drive it yet" % (impl, op),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
