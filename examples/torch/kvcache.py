"""The main job in PyTorch: one producer computes a KV cache with real torch ops and
shares it; N consumer processes (spread over every GPU) map it as tensors, with no copy,
and run attention over it, each checking its result against the producer's own.

    python3 examples/torch/kvcache.py [--consumers N] [--tokens T] ...

Run from the repository root on a GPU host, with libcudapool in bin/ (or
$CUDAPOOL_LIB). It prints one line per consumer (open time, attention time, how fast it
reads the mapping against a copy in its own memory, the device memory its open took),
then the memory N private copies would have taken against what sharing took, and exits
1 if any consumer's result differs from the producer's.
"""

import argparse
import math
import os
import sys
import tempfile
import time

from common import TIMEOUT, cudapool, guarded, result, spawn

GiB = 1 << 30


def build_cache(torch, shape, seed):
    """A layers x 2 (K, V) x tokens x heads x head_dim fp16 cache from a seeded toy
    transformer: each layer projects its hidden states to keys and values and updates
    them with a tanh MLP."""
    layers, tokens, heads, head_dim = shape
    hidden = heads * head_dim
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.float16, generator=g)
    kv = torch.empty(layers, 2, tokens, heads, head_dim, device="cuda", dtype=torch.float16)
    scale = 1 / math.sqrt(hidden)
    for layer in range(layers):
        wk, wv, wo = (torch.randn(hidden, hidden, device="cuda", dtype=torch.float16, generator=g) * scale
                      for _ in range(3))
        kv[layer, 0] = (x @ wk).view(tokens, heads, head_dim)
        kv[layer, 1] = (x @ wv).view(tokens, heads, head_dim)
        x = x + torch.tanh(x @ wo)
    return kv


def queries(torch, shape, seed, device):
    layers, _, heads, head_dim = shape
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    return torch.randn(layers, heads, head_dim, generator=g).to(device=device, dtype=torch.float16)


def attention(torch, kv, q):
    """One decoding step's attention of q (layers x heads x head_dim) over the cache:
    softmax(q K^T / sqrt(d)) V per layer and head, in float32."""
    out = []
    d = kv.shape[-1]
    for layer in range(kv.shape[0]):
        k = kv[layer, 0].transpose(0, 1)  # heads x tokens x head_dim, a view
        v = kv[layer, 1].transpose(0, 1)
        scores = torch.bmm(k, q[layer].unsqueeze(-1)).squeeze(-1).float() / math.sqrt(d)
        p = torch.softmax(scores, dim=-1).to(kv.dtype)
        out.append(torch.bmm(p.unsqueeze(1), v).squeeze(1).float())
    return torch.stack(out)


@guarded
def producer(q, path, shape, seed, done):
    import torch
    import cudapool.torch as cpt
    cudapool.init("gpu")
    cpt.use_as_current()  # every tensor of this process lives in cudapool's pool
    t0 = time.perf_counter()
    kv = build_cache(torch, shape, seed)
    ref = attention(torch, kv, queries(torch, shape, seed, "cuda:0"))
    torch.cuda.synchronize()
    built = time.perf_counter() - t0
    ex = cudapool.Exporter(path, name="torch-kv-producer")
    cpt.publish(ex, "kv", kv)  # ready once the current stream's work (the build) is done
    q.put({"bytes": kv.numel() * kv.element_size(), "ref": ref.cpu(), "build_s": built,
           "pool_reserved": cpt.stats(0).bytes_reserved})
    done.wait(TIMEOUT)
    ex.close(timeout=TIMEOUT)
    q.put("closed")


def timed_read(torch, t, reps=5):
    """Best time to read all of t once (a reduction), in seconds."""
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.sum(t, dtype=torch.float32)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


@guarded
def consumer(q, path, shape, seed, device, ref, quiet):
    import torch
    import cudapool.torch as cpt
    cudapool.init("gpu")
    torch.cuda.set_device(device)
    torch.zeros(1, device="cuda")  # the context, before memory is counted
    imp = cudapool.Importer(path, device=device)
    with quiet:  # no other consumer allocates while the memory is counted
        free_before = torch.cuda.mem_get_info(device)[0]
        t0 = time.perf_counter()
        m = cpt.open_tensor(imp, "kv", dtype=torch.float16, shape=(shape[0], 2) + tuple(shape[1:]))
        opened = time.perf_counter() - t0
        taken = free_before - torch.cuda.mem_get_info(device)[0]
    kv = m.tensor
    t0 = time.perf_counter()
    out = attention(torch, kv, queries(torch, shape, seed, kv.device))
    torch.cuda.synchronize()
    attended = time.perf_counter() - t0
    ok = torch.allclose(out.cpu(), ref, rtol=2e-2, atol=2e-3)
    with quiet:  # one consumer at a time, so that reads do not share the memory bus
        mapped_s = timed_read(torch, kv)
        local = kv.clone()  # only to compare: a read of this process's own memory
        local_s = timed_read(torch, local)
        del local
        torch.cuda.empty_cache()
    nbytes = kv.numel() * kv.element_size()
    q.put({"device": device, "ok": ok, "no_copy": kv.data_ptr() == m.ptr, "open_ms": opened * 1e3,
           "attention_ms": attended * 1e3, "mapped_gbps": nbytes / mapped_s / 1e9,
           "local_gbps": nbytes / local_s / 1e9, "taken": taken,
           "max_err": float((out.cpu() - ref).abs().max())})
    m.release()
    imp.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--consumers", type=int, default=0, help="default: two per GPU")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(cudapool.init("gpu"))
    gpus = cudapool.runtime_info()[1]
    n = args.consumers or 2 * gpus
    shape = (args.layers, args.tokens, args.heads, args.head_dim)
    path = os.path.join(tempfile.mkdtemp(prefix="cudapool-torch-kv-"), "kv.sock")

    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    done, quiet = ctx.Event(), ctx.Lock()
    p, pq = spawn(producer, path, shape, args.seed, done)
    try:
        made = pq.get(timeout=TIMEOUT)
        if not isinstance(made, dict):
            raise RuntimeError("producer: %s" % made)
        size = made["bytes"]
        print("producer: built a %s KV cache (%.2f GiB, layers x K,V x tokens x heads x head_dim, fp16) in "
              "%.2f s on GPU 0 and published it" % ("x".join(map(str, shape)), size / GiB, made["build_s"]))
        kids = [spawn(consumer, path, shape, args.seed, i % gpus, made["ref"], quiet) for i in range(n)]
        results = [result(c, cq, "consumer %d" % i) for i, (c, cq) in enumerate(kids)]
    finally:
        done.set()
    closed = result(p, pq, "producer") == "closed"

    print("\nconsumer  GPU  open ms  attention ms  read mapped GB/s  read own GB/s  ratio  memory taken at open  result")
    for i, r in enumerate(results):
        print("%8d  %3d  %7.2f  %12.2f  %16.1f  %13.1f  %4.0f%%  %20s  %s" % (
            i, r["device"], r["open_ms"], r["attention_ms"], r["mapped_gbps"], r["local_gbps"],
            100 * r["mapped_gbps"] / r["local_gbps"], "%.1f MiB" % (r["taken"] / 2**20),
            "OK" if r["ok"] and r["no_copy"] else "FAIL (max error %g, no copy: %s)" % (r["max_err"], r["no_copy"])))
    private = (n + 1) * size
    print("\n%d processes use the cache (1 producer, %d consumers on %d GPU(s)):" % (n + 1, n, gpus))
    print("  %d private copies would take %.2f GiB" % (n + 1, private / GiB))
    print("  shared, it took %.2f GiB (the producer's one copy)" % (size / GiB))
    print("  bytes saved: %d (%.2f GiB)" % (private - size, (private - size) / GiB))
    ok = closed and all(r["ok"] and r["no_copy"] for r in results)
    print("torch kvcache: %s" % ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
