"""A Python producer shares a VMM allocation (cudapool.vmm) with a Python consumer
process: three chunks mapped as one range, which the consumer maps as one range of its
own and reads across each chunk boundary. Unlike a pool's buffer, an allocation of
chunks has no import bound (a pool's is about 4.5 GiB): the same code shares 100 GiB.
It runs on the GPU, or on cudapool's software device where there is none (a library
built with -tags cudapool_softdevice, as below, has it).

    go build -buildmode=c-shared -tags cudapool_softdevice -o bin/libcudapool.so ./capi
    PYTHONPATH=python python3 examples/python/vmm_share.py
"""

import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile

import cudapool
from cudapool import vmm

CHUNKS = 3
MARK = b"chunk %d starts here"


def consume(path, chunk, conn):
    # A spawned process chooses its runtime again: without this it asks for a GPU.
    cudapool.init("auto")
    with cudapool.Importer(path, device=0) as imp, imp.open("slab") as m:
        # One range: the bytes on both sides of every boundary come in one copy each.
        edges = [cudapool.copy_from_device(0, m.ptr + i * chunk - 8, 8 + len(MARK % i)) for i in range(1, CHUNKS)]
        conn.send((m.size, m.meta, edges))


def main():
    print(cudapool.init("auto"))  # a GPU, else the software device, saying so
    chunk = vmm.granularity(0)  # the smallest chunk the device makes: 2 MiB on an H200
    path = os.path.join(tempfile.mkdtemp(), "vmm.sock")
    with cudapool.Exporter(path) as ex, cudapool.Stream(0) as s:
        with vmm.Allocation(0, CHUNKS * chunk, chunk_size=chunk) as a:
            print(a)
            for i in range(CHUNKS):  # the end of chunk i-1, then the start of chunk i
                at, data = (a.ptr + i * chunk - 8, b"-" * 8 + MARK % i) if i else (a.ptr, MARK % i)
                cudapool.copy_to_device(0, at, data, s)
            ex.publish_chunks("slab", a, stream=s, meta=b"%d chunks" % CHUNKS)  # ready once s's copies ran
            s.synchronize()  # before the mapping goes: nothing queued may touch it then
        # The allocation is closed: this process's mapping is gone, and the exporter
        # holds the memory while "slab" is published.

        ctx = multiprocessing.get_context("spawn")  # never fork: the library cannot survive it
        mine, theirs = ctx.Pipe()
        consumer = ctx.Process(target=consume, args=(path, chunk, theirs))
        consumer.start()
        theirs.close()
        # Its answer, or its end: a consumer that fails says so at once.
        multiprocessing.connection.wait([mine, consumer.sentinel], timeout=60)
        got = mine.recv() if mine.poll() else None
        consumer.join(60)
    if got is None:
        print("the consumer failed (exit code %s): see its error above" % consumer.exitcode, file=sys.stderr)
        return 1
    size, meta, edges = got
    print("consumer mapped %d bytes (%s) as one range" % (size, meta.decode()))
    for e in edges:
        print("  across a boundary: %r" % e.decode())
    ok = size == CHUNKS * chunk and edges == [b"-" * 8 + MARK % i for i in range(1, CHUNKS)]
    return 0 if ok and consumer.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
