"""The mixed pairs on a GPU host: a buffer shared between every kind of process cudapool
serves, each consumer checking every byte against the splitmix64 pattern of the Go
examples (examples/kvshare) without a copy of its own.

    go producer  -> torch consumer (GPU 0)
    torch producer -> go consumer (GPU 0, and GPU 1 where there is one)
    torch producer -> torch consumer, same GPU and other GPU
    torch producer -> CuPy consumer

Run from the repository root with libcudapool in bin/ (or $CUDAPOOL_LIB) and the Go
command kvshare (its producer and consumer subcommands) that scripts/build-gpu.sh
builds, unpacked in --bin (scripts/gpu-examples.sh copies it to /tmp/cudapool-bin):

    python3 examples/torch/pairs.py --bin /tmp/cudapool-bin

It prints one line per pair and a table last, and exits 1 if any pair failed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import TIMEOUT, cudapool, guarded, result, spawn, splitmix

SEED = 7
NAME = "kv-cache"  # the Go examples' default name


@guarded
def torch_producer(q, path, nbytes, go):
    """Fills nbytes of cudapool memory with the pattern (torch ops), publishes it under
    NAME, and holds it until go is set."""
    import torch
    import cudapool.torch as cpt
    cudapool.init("gpu")
    cpt.use_as_current()
    kv = splitmix(torch, SEED, nbytes // 8, device="cuda:0")
    ex = cudapool.Exporter(path, name="torch-producer")
    cpt.publish(ex, NAME, kv)
    torch.cuda.current_stream().synchronize()  # only to time the consumers fairly
    q.put("published")
    go.wait(TIMEOUT)
    ex.close(timeout=TIMEOUT)
    q.put("closed")


@guarded
def torch_consumer(q, path, device):
    """Opens NAME as int64 words on device and checks them against the pattern."""
    import torch
    cudapool.init("gpu")
    torch.cuda.set_device(device)
    imp = cudapool.Importer(path, device=device)
    t0 = time.perf_counter()
    m = imp.open(NAME, stream=torch.cuda.current_stream())
    n = m.size // 8
    m.tensor = torch.from_dlpack(m.view("<i8", (n,)))
    opened = time.perf_counter() - t0
    bad = int((m.tensor != splitmix(torch, SEED, n, device=m.tensor.device)).sum())
    q.put({"device": m.tensor.device.index, "bytes": m.size, "bad_words": bad,
           "no_copy": m.tensor.data_ptr() == m.ptr, "open_us": opened * 1e6})
    m.release()
    imp.close()


@guarded
def cupy_consumer(q, path):
    import cupy
    cudapool.init("gpu")
    imp = cudapool.Importer(path, device=0)
    s = cupy.cuda.get_current_stream()
    m = imp.open(NAME, stream=s)
    n = m.size // 8
    a = cupy.asarray(m.view("<i8", (n,)))
    bad = int((a != splitmix(cupy, SEED, n)).sum())
    q.put({"device": 0, "bytes": m.size, "bad_words": bad, "no_copy": a.data.ptr == m.ptr})
    del a
    m.release(stream=s)
    imp.close()


def check(r):
    return r["bad_words"] == 0 and r["no_copy"]


def kvshare(bindir, role, *flags):
    """The command line of the Go example's role ("producer" or "consumer"): kvshare
    ROLE FLAGS..., from bindir, where scripts/build-gpu.sh's kvshare must be unpacked."""
    exe = os.path.join(bindir, "kvshare")
    if not os.path.isfile(exe):
        packed = " (it is still compressed: unpack it with scripts/unpack.sh)" if os.path.exists(exe + ".xz") else ""
        raise FileNotFoundError("no %s%s: build it with scripts/build-gpu.sh, or go build -o %s ./examples/kvshare"
                                % (exe, packed, bindir))
    return [exe, role] + list(flags)


def go_producer_torch_consumer(bindir, path):
    prod = subprocess.Popen(kvshare(bindir, "producer", "-runtime", "gpu", "-socket", path,
                                    "-tokens", "512", "-seed", str(SEED), "-json"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = prod.stdout.readline()  # the producer's one JSON line, once published
        if not line:
            raise RuntimeError("the Go producer exited: " + prod.stderr.read())
        published = json.loads(line)
        p, q = spawn(torch_consumer, path, 0)
        r = result(p, q, "torch consumer")
        return check(r), "%s from a Go producer: %d bytes, %d bad words" % (
            published["name"], r["bytes"], r["bad_words"])
    finally:
        prod.terminate()
        prod.wait(TIMEOUT)


class TorchProducer:
    """A torch producer of nbytes of the pattern, for the pairs it serves."""

    def __init__(self, path, nbytes):
        import multiprocessing
        self.go = multiprocessing.get_context("spawn").Event()
        self.p, self.q = spawn(torch_producer, path, nbytes, self.go)
        r = self.q.get(timeout=TIMEOUT)
        if r != "published":
            self.p.kill()
            raise RuntimeError("the torch producer did not publish: %s" % r)

    def close(self):
        self.go.set()
        return result(self.p, self.q, "torch producer") == "closed"


def go_consumer(bindir, path, device):
    out = subprocess.run(kvshare(bindir, "consumer", "-runtime", "gpu", "-socket", path,
                                 "-name", NAME, "-seed", str(SEED), "-device", str(device), "-reps", "1"),
                         capture_output=True, text=True, timeout=TIMEOUT)
    last = (out.stdout.strip().splitlines() or [out.stderr.strip()])[-1]
    return out.returncode == 0, "Go consumer on GPU %d: %s" % (device, last)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="/tmp/cudapool-bin", help="where scripts/build-gpu.sh's kvshare is, unpacked")
    ap.add_argument("--mib", type=int, default=64, help="the size the torch producer shares")
    args = ap.parse_args()
    print(cudapool.init("gpu"))
    gpus = cudapool.runtime_info()[1]
    work = tempfile.mkdtemp(prefix="cudapool-pairs-")
    rows = []

    def run(name, fn, *a):
        try:
            ok, what = fn(*a)
        except Exception as e:
            ok, what = False, "%s: %s" % (type(e).__name__, e)
        rows.append((name, ok))
        print("%-34s %s  %s" % (name, "PASS" if ok else "FAIL", what), flush=True)

    run("go -> torch (GPU 0)", go_producer_torch_consumer, args.bin, os.path.join(work, "go.sock"))

    path = os.path.join(work, "torch.sock")
    producer = TorchProducer(path, args.mib << 20)
    try:
        for dev in range(min(gpus, 2)):
            run("torch -> go (GPU %d)" % dev, go_consumer, args.bin, path, dev)
        for dev in range(min(gpus, 2)):
            label = "same GPU" if dev == 0 else "other GPU"

            def torch_pair(dev=dev):
                p, q = spawn(torch_consumer, path, dev)
                r = result(p, q, "torch consumer")
                return check(r) and r["device"] == dev, "cuda:%d tensor over the mapping, %d bad words, open %.0f us" % (
                    r["device"], r["bad_words"], r["open_us"])
            run("torch -> torch (%s)" % label, torch_pair)

        def cupy_pair():
            p, q = spawn(cupy_consumer, path)
            r = result(p, q, "CuPy consumer")
            return check(r), "cupy array over the mapping, %d bad words" % r["bad_words"]
        run("torch -> CuPy (GPU 0)", cupy_pair)
    finally:
        rows.append(("torch producer closed", producer.close()))
    if gpus < 2:
        # Not run on a one-GPU host, unless CUDAPOOL_REQUIRE_GPUS demands two.
        demanded = os.environ.get("CUDAPOOL_REQUIRE_GPUS", "1") != "1"
        rows.append(("other GPU", False if demanded else None))
    print("\npair                               result")
    for name, ok in rows:
        print("%-34s %s" % (name, "not run (needs 2 GPUs)" if ok is None else "PASS" if ok else "FAIL"))
    return 0 if all(ok is not False for _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
