"""A Python producer shares a buffer, with metadata, with a Python consumer process
through cudapool. It runs on the GPU, or on cudapool's software device where there is
none; torch, CuPy and cuda.core are not needed (see examples/torch for them).

    go build -buildmode=c-shared -o bin/libcudapool.so ./capi
    PYTHONPATH=python python3 examples/python/share.py
"""

import json
import multiprocessing
import os
import sys
import tempfile

import cudapool

GREETING = b"hello from a Python producer"


def consume(path, q):
    imp = cudapool.Importer(path, device=0)
    with imp.open("greeting") as m:  # the default stream waits for the producer's writes
        got = cudapool.copy_from_device(0, m.ptr, m.size)
        q.put((got, json.loads(m.meta)))
    imp.close()


def main():
    print(cudapool.init("auto"))  # a GPU, else the software device, saying so
    path = os.path.join(tempfile.mkdtemp(), "share.sock")
    with cudapool.Pool(0, name="py-example") as pool, cudapool.Exporter(path) as ex:
        buf = pool.alloc(1 << 20)  # a Buffer
        cudapool.copy_to_device(0, buf, GREETING)
        ex.publish("greeting", buf, len(GREETING), meta=json.dumps({"encoding": "ascii"}))

        ctx = multiprocessing.get_context("spawn")  # never fork: the library cannot survive it
        q = ctx.Queue()
        consumer = ctx.Process(target=consume, args=(path, q))
        consumer.start()
        got, meta = q.get(timeout=60)
        consumer.join(60)
        buf.free()
    print("consumer read %r (%s)" % (got.decode(meta["encoding"]), meta))
    return 0 if got == GREETING and consumer.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
