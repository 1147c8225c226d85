"""Tests of the VMM route through the Python package (cudapool.vmm and
Exporter.publish_chunks), on the software device where no GPU is (or on the GPU): a
consumer in another process opens an allocation of several chunks as one range and
reads the bytes across a chunk boundary."""

import os
import unittest

from helpers import cudapool, failure, result_of, socket_path, spawn

from cudapool import vmm

SPAN = 4096  # the bytes read on either side of a chunk boundary


def setUpModule():
    cudapool.init(os.environ["CUDAPOOL_RUNTIME"])


def pattern(start, n):
    """The bytes the producer writes at [start, start+n) of an allocation."""
    return bytes((o * 131 + (o >> 12)) & 0xFF for o in range(start, start + n))


def consume_boundary(q, path, name, at):
    """A consumer process: opens name, reads SPAN bytes on either side of offset at (a
    chunk boundary) in one copy, releases."""
    try:
        imp = cudapool.Importer(path, device=0)
        m = imp.open(name)
        got = cudapool.copy_from_device(0, m.ptr + at - SPAN, 2 * SPAN, m.stream)
        m.release()
        imp.close()
        q.put({"bytes": got, "size": m.size, "meta": m.meta})
    except Exception as e:  # the parent reports it
        q.put(failure(e))


def consume_names(q, path, names):
    """A consumer process: opens names, reports each one's offset from the first, size,
    meta and first SPAN bytes, releases them all."""
    try:
        imp = cudapool.Importer(path, device=0)
        ms = imp.open_all(names)
        got = [(m.ptr - ms[0].ptr, m.size, m.meta, cudapool.copy_from_device(0, m.ptr, SPAN, m.stream)) for m in ms]
        imp.release_all(ms)
        imp.close()
        q.put(got)
    except Exception as e:  # the parent reports it
        q.put(failure(e))


class AllocationTest(unittest.TestCase):
    def setUp(self):
        self.g = vmm.granularity(0)

    def test_granularity(self):
        self.assertGreater(self.g, 0)
        self.assertEqual(self.g & (self.g - 1), 0, "a power of two")
        with self.assertRaises(ValueError):
            vmm.granularity(-1)

    def test_chunks_map_as_one_range(self):
        g = self.g
        with vmm.Allocation(0, 5 * g, chunk_size=2 * g) as a:
            self.assertEqual([c.size for c in a.chunks], [2 * g, 2 * g, g], "the last chunk is what is left")
            self.assertNotEqual(a.ptr, 0)
            cai = a.__cuda_array_interface__
            self.assertEqual((cai["shape"], cai["typestr"], cai["data"][0]), ((5 * g,), "|u1", a.ptr))
            self.assertEqual(a.__dlpack_device__()[1], 0)
            self.assertIn("chunks=3", repr(a))
            # One copy across each boundary: the range is contiguous.
            data = pattern(2 * g - SPAN, 2 * SPAN)
            cudapool.copy_to_device(0, a.ptr + 2 * g - SPAN, data)
            self.assertEqual(cudapool.copy_from_device(0, a.ptr + 2 * g - SPAN, 2 * SPAN), data)
        self.assertTrue(a.closed)
        self.assertIn("closed", repr(a))
        self.assertTrue(all(c.handle == 0 for c in a.chunks))
        a.close()  # a second close does nothing
        with self.assertRaises(cudapool.Closed):
            a.ptr

    def test_one_chunk_by_default(self):
        with vmm.Allocation(0, 2 * self.g) as a:
            self.assertEqual(len(a.chunks), 1)

    def test_bad_sizes_raise(self):
        g = self.g
        for size, chunk, err in [(0, None, ValueError), (g + 1, None, cudapool.InvalidArgument),
                                 (2 * g, g + 1, cudapool.InvalidArgument), (2 * g, 0, ValueError),
                                 (-1, None, ValueError), (1 << 64, None, OverflowError),
                                 (4097 * g, g, ValueError)]:
            with self.subTest(size=size, chunk=chunk), self.assertRaises(err):
                vmm.Allocation(0, size, chunk)
        with self.assertRaises(TypeError):
            vmm.Allocation(0, "1")  # type: ignore[arg-type]
        with self.assertRaises(cudapool.InvalidArgument):
            vmm.Chunk(0, g - 1)

    def test_chunk(self):
        with vmm.Chunk(0, self.g) as c:
            self.assertNotEqual(c.handle, 0)
            self.assertIn("size=%d" % self.g, repr(c))
        self.assertEqual(c.handle, 0)
        self.assertIn("closed", repr(c))
        c.close()  # a second close does nothing

    def test_fabric_without_an_imex_channel(self):
        on_gpu, _, _ = cudapool.runtime_info()
        if on_gpu:
            self.skipTest("whether a GPU host has an IMEX channel is the host's (the software device has none)")
        with self.assertRaisesRegex(cudapool.NotSupported, "IMEX"):
            vmm.Allocation(0, vmm.granularity(0, fabric=True), fabric=True)

    def test_with_block_that_raised_keeps_its_exception(self):
        with self.assertRaises(KeyError):
            with vmm.Allocation(0, self.g) as a:
                raise KeyError("the block's")
        self.assertTrue(a.closed)


class PublishChunksTest(unittest.TestCase):
    """A producer here, consumers in spawned processes."""

    def setUp(self):
        self.g = vmm.granularity(0)
        self.ex = cudapool.Exporter(socket_path("vmm"))
        self.addCleanup(self.ex.close, 10)

    def test_consumer_reads_across_the_chunk_boundary(self):
        g = self.g
        s = cudapool.Stream(0)
        self.addCleanup(s.close)
        with vmm.Allocation(0, 4 * g, chunk_size=2 * g) as a:
            cudapool.copy_to_device(0, a.ptr, pattern(0, 4 * g), s)
            self.ex.publish_chunks("slab", a, stream=s)
            self.ex.publish_chunks("edge", a, 2 * SPAN, stream=s, meta="m", offset=2 * g - SPAN)
            with self.assertRaises(cudapool.NameInUse):
                self.ex.publish_chunks("slab", a, stream=s)
            s.synchronize()
        # The producer's mapping and handles are gone: the exporter holds the memory.
        p, q = spawn(consume_boundary, self.ex.path, "slab", 2 * g)
        r = result_of(self, p, q)
        self.assertEqual(r["size"], 4 * g, "one range, the whole allocation")
        self.assertEqual(r["bytes"], pattern(2 * g - SPAN, 2 * SPAN), "the bytes across the boundary")
        p, q = spawn(consume_boundary, self.ex.path, "edge", SPAN)
        r = result_of(self, p, q)
        self.assertEqual((r["size"], r["meta"]), (2 * SPAN, b"m"))
        self.assertEqual(r["bytes"], pattern(2 * g - SPAN, 2 * SPAN), "the published range")
        self.ex.unpublish("slab")
        self.ex.unpublish("edge")

    def test_names_of_one_allocation_map_once(self):
        g = self.g
        s = cudapool.Stream(0)
        self.addCleanup(s.close)
        with vmm.Allocation(0, 3 * g, chunk_size=g) as a:
            cudapool.copy_to_device(0, a.ptr, pattern(0, 3 * g), s)
            self.ex.publish_chunks_all(a, [("k",), ("v", g, g, b"v"), ("tail", 2 * g, 0)], stream=s)
            s.synchronize()
        p, q = spawn(consume_names, self.ex.path, ["k", "v", "tail"])
        got = result_of(self, p, q)
        self.assertEqual(got, [(0, 3 * g, b"", pattern(0, SPAN)), (g, g, b"v", pattern(g, SPAN)),
                               (2 * g, g, b"", pattern(2 * g, SPAN))],
                         "each name at its offset of one range")
        for n in ("k", "v", "tail"):
            self.ex.unpublish(n)

    def test_bad_publications_publish_nothing(self):
        g = self.g
        with vmm.Allocation(0, 2 * g, chunk_size=g) as a:
            for kw, err in [({"size": 2 * g + 1}, cudapool.InvalidArgument),
                            ({"offset": 2 * g, "size": 1}, cudapool.InvalidArgument),
                            ({"offset": -1}, ValueError),
                            ({"meta": b"x" * (cudapool.MAX_META + 1)}, cudapool.InvalidArgument)]:
                with self.subTest(kw=kw), self.assertRaises(err):
                    self.ex.publish_chunks("bad", a, **kw)
            with self.assertRaises(ValueError):
                self.ex.publish_chunks("nul\0", a)
            with self.assertRaises(TypeError):
                self.ex.publish_chunks("x", a.chunks)  # type: ignore[arg-type]
            for entries, err in [([], ValueError), ([("a", 0)], ValueError), ([("a",), ("a",)], cudapool.NameInUse),
                                 ([("a",), ("b", 3 * g, 0)], cudapool.InvalidArgument)]:
                with self.subTest(entries=entries), self.assertRaises(err):
                    self.ex.publish_chunks_all(a, entries)
        with self.assertRaises(cudapool.Closed):
            self.ex.publish_chunks("closed", a)
        with self.assertRaises(cudapool.Closed):
            self.ex.publish_chunks_all(a, [("closed",)])
        self.assertEqual([n.name for n in self.ex.state().published], [])


if __name__ == "__main__":
    unittest.main()
