"""GPU tests of the Python package with torch, CuPy and cuda.core: skipped where there is
no GPU or the package is absent, failed instead under CUDAPOOL_REQUIRE_GPU=1. Every torch
process here is a spawned child: torch's allocator can only be changed before its first
CUDA allocation, and the test runner's own process stays free of CUDA state."""

import multiprocessing
import os
import time
import unittest

from helpers import CHILD_TIMEOUT, cudapool, failure, need, need_gpu, result_of, socket_path, spawn

SEED = 1234
SHAPE = (4, 256, 8, 64)  # layers x tokens x heads x head_dim


def reference(torch, device):
    """A seeded tensor built with real torch ops on device, the same in every process."""
    g = torch.Generator(device="cpu").manual_seed(SEED)
    x = torch.randn(SHAPE[1], 512, generator=g).to(device)
    w = torch.randn(512, SHAPE[2] * SHAPE[3], generator=g).to(device)
    layers = [torch.tanh(x @ (w * (i + 1) / 10)) for i in range(SHAPE[0])]
    return torch.stack(layers).view(SHAPE).to(torch.float16).contiguous()


def checksum(words, index):
    """An exact, order-sensitive checksum of an array's 16-bit words (as int64), with
    index their positions: the consumer's view must hold the producer's very bytes."""
    return int((words * (index % 65521 + 1)).sum())


def torch_checksum(torch, t):
    words = t.reshape(-1).view(torch.int16).to(torch.int64)
    return checksum(words, torch.arange(words.numel(), device=t.device))


def cupy_checksum(cupy, a):
    words = a.reshape(-1).view(cupy.int16).astype(cupy.int64)
    return checksum(words, cupy.arange(words.size, dtype=cupy.int64))


def fail_to(q):
    def report(e):
        q.put(failure(e))
    return report


def allocator_child(q, mode):
    """Runs torch ops on cudapool memory: every tensor (mode "current") or a MemPool's."""
    try:
        import torch
        import cudapool.torch as cpt
        cudapool.init("gpu")
        if mode == "current":
            cpt.use_as_current()
            a = torch.randn(512, 512, device="cuda")
        else:
            pool = cpt.mem_pool()
            with torch.cuda.use_mem_pool(pool):
                a = torch.randn(512, 512, device="cuda")
        want = a.cpu() @ a.cpu()
        got = (a @ a).cpu()
        live = cpt.stats(0).live_buffers
        pair_us = None
        if mode == "current":
            for _ in range(2000):  # warm-up: each tensor is freed as soon as it is made
                torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            n = 20000
            t0 = time.perf_counter()
            for _ in range(n):
                t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
                del t
            pair_us = (time.perf_counter() - t0) / n * 1e6
        q.put({"close": torch.allclose(got, want, rtol=1e-3, atol=1e-2), "live": live, "pair_us": pair_us})
    except Exception as e:
        fail_to(q)(e)


def torch_producer(q, path, go):
    """Builds the reference tensor in cudapool memory, publishes it, holds until go."""
    try:
        import torch
        import cudapool.torch as cpt
        cudapool.init("gpu")
        cpt.use_as_current()
        kv = reference(torch, "cuda:0")
        ex = cudapool.Exporter(path)
        cpt.publish(ex, "kv", kv)
        q.put(("published", torch_checksum(torch, kv)))
        go.wait(CHILD_TIMEOUT)
        ex.close(timeout=CHILD_TIMEOUT)
        q.put("closed")
    except Exception as e:
        fail_to(q)(e)


def torch_consumer(q, path, want, device):
    try:
        import torch
        import cudapool.torch as cpt
        cudapool.init("gpu")
        torch.cuda.set_device(device)
        imp = cudapool.Importer(path, device=device)
        m = cpt.open_tensor(imp, "kv", dtype=torch.float16, shape=SHAPE)
        t = m.tensor
        res = {"device": t.device.index, "ptr_is_mapping": t.data_ptr() == m.ptr,
               "equal": torch_checksum(torch, t) == want}
        m.release()
        imp.close()
        q.put(res)
    except Exception as e:
        fail_to(q)(e)


def cupy_consumer(q, path, want):
    try:
        import cupy
        cudapool.init("gpu")
        imp = cudapool.Importer(path, device=0)
        m = imp.open("kv", stream=cupy.cuda.get_current_stream())
        a = cupy.asarray(m.view("<f2", SHAPE))
        res = {"ptr_is_mapping": a.data.ptr == m.ptr, "equal": cupy_checksum(cupy, a) == want}
        del a
        m.release(stream=cupy.cuda.get_current_stream())
        imp.close()
        q.put(res)
    except Exception as e:
        fail_to(q)(e)


class CAIOnly:
    """An array that offers only __cuda_array_interface__, not DLPack."""

    def __init__(self, view):
        self.__cuda_array_interface__ = view.__cuda_array_interface__


def cudacore_consumer(q, path, _):
    try:
        try:
            from cuda.core.utils import StridedMemoryView
        except ImportError:
            from cuda.core.experimental.utils import StridedMemoryView
        from cuda.core import Device
        cudapool.init("gpu")
        dev = Device(0)
        dev.set_current()
        s = dev.create_stream()
        imp = cudapool.Importer(path, device=0)
        m = imp.open("kv", stream=s)
        res = {}
        for how, obj in [("dlpack", m.view("<f2", SHAPE)), ("cai", CAIOnly(m.view("<f2", SHAPE)))]:
            v = StridedMemoryView(obj, stream_ptr=int(s.handle))
            res[how] = {"ptr_is_mapping": v.ptr == m.ptr, "shape": tuple(v.shape), "dtype": str(v.dtype)}
        m.release(stream=s)
        imp.close()
        q.put(res)
    except Exception as e:
        fail_to(q)(e)


def mempool_producer(q, path, go):
    """Publishes two small tensors that torch carved out of one MemPool segment."""
    try:
        import torch
        import cudapool.torch as cpt
        cudapool.init("gpu")
        pool = cpt.mem_pool()
        with torch.cuda.use_mem_pool(pool):
            a = torch.arange(1000, dtype=torch.float32, device="cuda") * 3
            b = torch.full((3, 5), 7, dtype=torch.float16, device="cuda")
        ex = cudapool.Exporter(path)
        cpt.publish(ex, "a", a)
        cpt.publish(ex, "b", b)
        q.put(("published", cpt.stats(0).live_buffers))
        go.wait(CHILD_TIMEOUT)
        ex.close(timeout=CHILD_TIMEOUT)
        q.put("closed")
    except Exception as e:
        fail_to(q)(e)


def mempool_consumer(q, path):
    try:
        import torch
        import cudapool.torch as cpt
        cudapool.init("gpu")
        imp = cudapool.Importer(path, device=0)
        ma, mb = cpt.open_tensor(imp, "a"), cpt.open_tensor(imp, "b")  # dtype and shape from the metadata
        a, b = ma.tensor.cpu(), mb.tensor.cpu()
        q.put({"a": (str(a.dtype), tuple(a.shape), bool(torch.equal(a, torch.arange(1000.0) * 3))),
               "b": (str(b.dtype), tuple(b.shape), bool((b == 7).all()))})
        ma.release()
        mb.release()
        imp.close()
    except Exception as e:
        fail_to(q)(e)


VMM_CHUNKS = 3  # chunks of the VMM allocation, 4 granules each


def vmm_bytes(torch, n, device):
    """The bytes the VMM producer writes: a pattern that differs in every 4 KiB."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    return ((i * 131 + (i >> 12)) & 0xFF).to(torch.uint8)


def vmm_producer(q, path, go):
    """Makes a VMM allocation of VMM_CHUNKS chunks, writes it with torch through DLPack,
    publishes it, closes its own mapping and holds until go: the exporter keeps the
    memory."""
    try:
        import torch
        from cudapool import vmm
        cudapool.init("gpu")
        chunk = 4 * vmm.granularity(0)
        a = vmm.Allocation(0, VMM_CHUNKS * chunk, chunk_size=chunk)
        t = torch.from_dlpack(a)
        t.copy_(vmm_bytes(torch, a.size, t.device))
        ex = cudapool.Exporter(path)
        ex.publish_chunks("slab", a, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        del t
        a.close()
        q.put(("published", chunk))
        go.wait(CHILD_TIMEOUT)
        ex.close(timeout=CHILD_TIMEOUT)
        q.put("closed")
    except Exception as e:
        fail_to(q)(e)


def vmm_consumer(q, path, chunk):
    """Opens the VMM allocation as one range and checks every byte, and those across
    each chunk boundary on their own."""
    try:
        import torch
        cudapool.init("gpu")
        imp = cudapool.Importer(path, device=0)
        m = imp.open("slab", stream=torch.cuda.current_stream())
        t = torch.from_dlpack(m)
        want = vmm_bytes(torch, m.size, t.device)
        edges = [bool(torch.equal(t[b - 4096:b + 4096], want[b - 4096:b + 4096]))
                 for b in range(chunk, m.size, chunk)]
        res = {"size": m.size, "ptr_is_mapping": t.data_ptr() == m.ptr, "equal": bool(torch.equal(t, want)),
               "edges": edges}
        del t
        m.release(stream=torch.cuda.current_stream())
        imp.close()
        q.put(res)
    except Exception as e:
        fail_to(q)(e)


class TorchAllocatorTest(unittest.TestCase):
    def setUp(self):
        need("torch")
        need_gpu()

    def test_every_tensor_from_cudapool(self):
        p, q = spawn(allocator_child, "current")
        r = result_of(self, p, q)
        self.assertTrue(r["close"], "a matmul on cudapool memory")
        self.assertGreaterEqual(r["live"], 1)
        print("\ntorch alloc+free of a 1 MiB tensor through cudapool: %.2f us" % r["pair_us"])

    def test_tensors_inside_a_mem_pool_segment(self):
        go = multiprocessing.get_context("spawn").Event()
        path = socket_path("mempool")
        p, q = spawn(mempool_producer, path, go)
        try:
            r = q.get(timeout=CHILD_TIMEOUT)
            self.assertIsInstance(r, tuple, "producer: %s" % (r,))
            self.assertEqual(r[1], 1, "both tensors lie in one segment, one cudapool buffer")
            c, cq = spawn(mempool_consumer, path)
            got = result_of(self, c, cq)
        finally:
            go.set()
        self.assertEqual(result_of(self, p, q), "closed")
        self.assertEqual(got, {"a": ("torch.float32", (1000,), True), "b": ("torch.float16", (3, 5), True)})

    def test_mem_pool(self):
        p, q = spawn(allocator_child, "mempool")
        r = result_of(self, p, q)
        self.assertTrue(r["close"], "a matmul on cudapool memory")
        self.assertGreaterEqual(r["live"], 1, "the MemPool's segment came from cudapool")


class PairsTest(unittest.TestCase):
    """A torch producer in one process, consumers of each kind in others."""

    def setUp(self):
        need("torch")
        self.gpus = need_gpu()
        self.path = socket_path("gpu-pairs")
        self.go = multiprocessing.get_context("spawn").Event()
        self.producer, self.pq = spawn(torch_producer, self.path, self.go)
        r = self.pq.get(timeout=CHILD_TIMEOUT)
        if not isinstance(r, tuple):
            self.producer.kill()
            self.fail("producer: %s" % r)
        self.want = r[1]

    def tearDown(self):
        self.go.set()
        self.assertEqual(result_of(self, self.producer, self.pq), "closed")

    def consume(self, target, *args):
        p, q = spawn(target, self.path, self.want, *args)
        return result_of(self, p, q)

    def test_torch_same_gpu(self):
        r = self.consume(torch_consumer, 0)
        self.assertEqual(r, {"device": 0, "ptr_is_mapping": True, "equal": True})

    def test_torch_other_gpu(self):
        if self.gpus < 2:
            if os.environ.get("CUDAPOOL_REQUIRE_GPUS", "1") != "1":
                self.fail("CUDAPOOL_REQUIRE_GPUS=%s demands two GPUs for this test" % os.environ["CUDAPOOL_REQUIRE_GPUS"])
            self.skipTest("not run (needs 2 GPUs)")
        r = self.consume(torch_consumer, 1)
        self.assertEqual(r, {"device": 1, "ptr_is_mapping": True, "equal": True})

    def test_cupy(self):
        need("cupy")
        self.assertEqual(self.consume(cupy_consumer), {"ptr_is_mapping": True, "equal": True})

    def test_cuda_core(self):
        need("cuda.core")
        r = self.consume(cudacore_consumer)
        for how in ("dlpack", "cai"):
            self.assertEqual(r[how], {"ptr_is_mapping": True, "shape": SHAPE, "dtype": "float16"}, how)


class VMMTest(unittest.TestCase):
    def test_torch_reads_a_vmm_allocation_as_one_range(self):
        need("torch")
        need_gpu()
        go = multiprocessing.get_context("spawn").Event()
        path = socket_path("gpu-vmm")
        p, q = spawn(vmm_producer, path, go)
        try:
            r = q.get(timeout=CHILD_TIMEOUT)
            self.assertIsInstance(r, tuple, "producer: %s" % (r,))
            chunk = r[1]
            c, cq = spawn(vmm_consumer, path, chunk)
            got = result_of(self, c, cq)
        finally:
            go.set()
        self.assertEqual(result_of(self, p, q), "closed")
        self.assertEqual(got, {"size": VMM_CHUNKS * chunk, "ptr_is_mapping": True, "equal": True,
                               "edges": [True] * (VMM_CHUNKS - 1)})


if __name__ == "__main__":
    unittest.main()
