"""A Python producer shares a buffer, with metadata, with a Python consumer process
through cudapool. It runs on the GPU, or on cudapool's software device where there is
none (a library built with -tags cudapool_softdevice, as below, has it); torch, CuPy
and cuda.core are not needed (see examples/torch for them).

    go build -buildmode=c-shared -tags cudapool_softdevice -o bin/libcudapool.so ./capi
    PYTHONPATH=python python3 examples/python/share.py
"""

import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile

import cudapool

GREETING = b"hello from a Python producer"


def consume(path, conn):
    # A spawned process chooses its runtime again: without this it asks for a GPU.
    cudapool.init("auto")
    with cudapool.Importer(path, device=0) as imp, imp.open("greeting") as m:
        # The default stream waits for the producer's writes.
        got = cudapool.copy_from_device(0, m.ptr, m.size)
        conn.send((got, json.loads(m.meta)))


def main():
    print(cudapool.init("auto"))  # a GPU, else the software device, saying so
    path = os.path.join(tempfile.mkdtemp(), "share.sock")
    with cudapool.Pool(0, name="py-example") as pool, cudapool.Exporter(path) as ex:
        buf = pool.alloc(1 << 20)  # a Buffer
        cudapool.copy_to_device(0, buf, GREETING)
        ex.publish("greeting", buf, len(GREETING), meta=json.dumps({"encoding": "ascii"}))

        ctx = multiprocessing.get_context("spawn")  # never fork: the library cannot survive it
        mine, theirs = ctx.Pipe()
        consumer = ctx.Process(target=consume, args=(path, theirs))
        consumer.start()
        theirs.close()
        try:
            # Its answer, or its end: a consumer that fails says so at once.
            multiprocessing.connection.wait([mine, consumer.sentinel], timeout=60)
            got, meta = mine.recv() if mine.poll() else (None, None)
            consumer.join(60)
        finally:
            buf.free()
    if got is None:
        print("the consumer failed (exit code %s): see its error above" % consumer.exitcode, file=sys.stderr)
        return 1
    print("consumer read %r (%s)" % (got.decode(meta["encoding"]), meta))
    return 0 if got == GREETING and consumer.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
