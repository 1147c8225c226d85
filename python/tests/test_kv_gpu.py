"""The KV page pool with torch on GPU 0: a writer replica process fills K and V pages
with torch kernels on a stream of its own and seals them without waiting; a reader
replica process matches them (once visible) and compares every byte of every layer's
K and V pages, with torch, against the same seeded values computed again. That one
importer's kernel writes reach another importer's reads through the owner's slab is
what the pool is for. Skipped without torch or a GPU; failed instead under
CUDAPOOL_REQUIRE_GPU=1."""

import multiprocessing
import time
import unittest

from helpers import CHILD_TIMEOUT, cudapool, failure, need, need_gpu, result_of, spawn, wait_go
from test_kv import Owner, need_kvpoold, tokens

from cudapool import kv

PAGES = 48  # of the slab's 256
SEED = 4321


def expected(torch, g, layer, which, device):
    """The values the writer puts in layer's K (which 0) or V (1) of its pages: seeded,
    computed on the GPU, the same in every process."""
    gen = torch.Generator(device=device).manual_seed(SEED + 2 * layer + which)
    x = torch.randn(PAGES, g.tokens_per_page, g.kv_heads, g.head_dim, generator=gen, device=device,
                    dtype=torch.float32)
    return (torch.tanh(x) * (layer + 1)).to(torch.bfloat16)


def writer(q, serve, go):
    try:
        import torch
        cudapool.init("gpu")
        torch.cuda.set_device(0)
        r = kv.Replica(serve, device=0, timeout=CHILD_TIMEOUT)
        g = r.geometry
        caches = r.kv_caches()
        hs = r.hashes(tokens(PAGES * g.tokens_per_page, SEED))
        s = torch.cuda.Stream(0)
        lease = r.alloc(PAGES)
        with torch.cuda.stream(s):
            idx = torch.tensor(list(lease.pages), device="cuda:0", dtype=torch.long)
            for layer, (k, v) in enumerate(caches):
                k[idx] = expected(torch, g, layer, 0, "cuda:0")  # index_put kernels on s
                v[idx] = expected(torch, g, layer, 1, "cuda:0")
        res = r.seal(lease, hs, stream=s)  # no wait: the owner sees s's work complete
        q.put({"pages": list(lease.pages), "visible_at_seal": res.visible, "duplicates": res.duplicates,
               "k0": caches[0][0].data_ptr() == r.layer_ptrs(0)[0] == r.regions[0].ptr,
               "v3": caches[3][1].data_ptr() == r.layer_ptrs(3)[1],
               "shape": tuple(caches[0][0].shape), "dtype": str(caches[0][0].dtype)})
        wait_go(go)
        s.synchronize()
        r.close()
        q.put("closed")
    except Exception as e:
        q.put(failure(e))


def reader(q, serve):
    try:
        import torch
        cudapool.init("gpu")
        torch.cuda.set_device(0)
        r = kv.Replica(serve, device=0, timeout=CHILD_TIMEOUT)
        g = r.geometry
        hs = r.hashes(tokens(PAGES * g.tokens_per_page, SEED))
        s = torch.cuda.current_stream(0)
        deadline, tries = time.monotonic() + CHILD_TIMEOUT, 0
        while True:
            tries += 1
            lease = r.match(hs, stream=s)
            if len(lease) == PAGES or time.monotonic() > deadline:
                break
            r.release(lease, stream=s)
            time.sleep(0.001)
        if len(lease) != PAGES:
            raise AssertionError("matched %d of %d pages in %d s" % (len(lease), PAGES, CHILD_TIMEOUT))
        caches = r.kv_caches()
        idx = torch.tensor(list(lease.pages), device="cuda:0", dtype=torch.long)
        wrong = []
        for layer, (k, v) in enumerate(caches):
            for which, t in ((0, k), (1, v)):
                got = t[idx].view(torch.int16)
                want = expected(torch, g, layer, which, "cuda:0").view(torch.int16)
                if not torch.equal(got, want):
                    wrong.append((layer, which, int((got != want).sum())))
        r.release(lease, stream=s)
        s.synchronize()
        r.close()
        q.put({"pages": list(lease.pages), "wrong": wrong, "tries": tries})
    except Exception as e:
        q.put(failure(e))


class KVTorchTest(unittest.TestCase):
    def setUp(self):
        need("torch")
        need_gpu()
        need_kvpoold()
        # 256 pages make each layer's K (and V) a tensor of 4 MiB: two chunks of the
        # GPU's granularity (2 MiB), one mapped at the start, the other as pages are
        # needed.
        self.owner = Owner(pages=256)
        self.addCleanup(self.owner.stop)

    def test_kernel_writes_reach_another_replicas_reads(self):
        go = multiprocessing.get_context("spawn").Event()
        w, wq = spawn(writer, self.owner.serve, go)
        try:
            wrote = wq.get(timeout=CHILD_TIMEOUT)
            self.assertIsInstance(wrote, dict, "writer: %s\nkvpoold:\n%s" % (wrote, self.owner.output()))
            self.assertEqual(wrote["duplicates"], 0)
            self.assertTrue(wrote["k0"] and wrote["v3"], "the caches view the mapped slab, no copy")
            self.assertEqual(wrote["shape"], (256, 16, 8, 64))
            self.assertEqual(wrote["dtype"], "torch.bfloat16")
            rd, rq = spawn(reader, self.owner.serve)
            got = result_of(self, rd, rq)
        finally:
            go.set()
        self.assertEqual(result_of(self, w, wq), "closed")
        self.assertEqual(got["pages"], wrote["pages"])
        self.assertEqual(got["wrong"], [], "(layer, K or V, elements that differ)")
        print("\nkv torch: the reader matched after %d tries (visible at seal: %d of %d)"
              % (got["tries"], wrote["visible_at_seal"], PAGES))


if __name__ == "__main__":
    unittest.main()
