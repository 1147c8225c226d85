"""The cuda.core column of cudapool's benchmark suite (issues 6 and 13).

NVIDIA's cuda.core (Python) on the operations bench/cref and bench/gosuite time:
an IPC-enabled DeviceMemoryResource, Buffer IPC descriptors, and consumers in
processes started with multiprocessing's spawn. Every measurement prints

    result cudacore OP UNIT MEDIAN P90 N
    raw cudacore OP UNIT V1 V2 ...

or "fail cudacore OP REASON" where it could not be taken (an API that differs
from the one this script knows, say); the others still run. Times are in
microseconds from CLOCK_MONOTONIC (time.monotonic_ns), the clock the C and Go
columns read. cuda.core leaves stream ordering between processes to its user,
so no consumer here waits on an event of the producer and no release is ordered:
its sharing figures are for less work than cudapool's and C's, and the table
shows them apart, never as a ratio of the same protocol. Its import pair is
cuda.core's own API (Buffer.from_ipc_descriptor and close), not a bare binding.

Usage:
    python3 bench/cudacore.py [--quick]
    python3 bench/cudacore.py alloc --plan PLAN --ring IN,OUT --ready FIFO
                              --round R --batches B --pairs N

"alloc" is one participant of the allocation ring (bench/gosuite/alloc.go says
why): for each plan entry and slot, one untimed warm-up batch and B measured
batches of N allocate+close pairs, one batch a turn, from a new pool of the
entry's kind (IPC-enabled or not; hit and miss, which measure cudapool's
cache, get cuda.core's plain pair on an IPC-enabled pool) and the entry's
bytes; it prints

    sample cudacore api OP ROUND BATCH TURN US
    bytes cudacore OP BYTES

cuda.core has no layer below its API here, so it passes its turns of the
binding slot. Without cuda.core it still takes and passes every turn, so that
the ring goes on, and says "fail cudacore alloc ...".
"""

import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.reduction
import os
import select
import sys
import time
import traceback

from suitelines import summarize  # bench/, the script's own folder

IMPL = "cudacore"
SHARE_SIZE = 2 << 20  # cudapool's granularity: every column shares 2 MiB buffers
TIMEOUT = 60.0  # a hang guard for every wait on a consumer, never a measurement
FANOUTS = (1, 2, 4, 7)
SUSTAIN_CONSUMERS = 4

IMPORT_BUFFERS = 1000  # the import pair's buffers a batch, as bench/cref and bench/gosuite
SLOW_OPEN = 1e-3  # an open in the sustained loop this slow or slower is a stall (as gosuite)
FULL = dict(batches=15, import_buffers=IMPORT_BUFFERS, samples=200, warmup=20, fanout_reps=50, ring=64,
            rounds=5, window=0.3, copies=20, read_size=1 << 30)
QUICK = dict(batches=3, import_buffers=8, samples=10, warmup=2, fanout_reps=3, ring=4,
             rounds=2, window=0.05, copies=2, read_size=8 << 20)


def api():
    """The cuda.core names this script uses, from wherever this version keeps them."""
    try:
        import cuda.core as core
        names = {n: getattr(core, n) for n in
                 ("Device", "DeviceMemoryResource", "DeviceMemoryResourceOptions", "Buffer", "EventOptions")}
    except (ImportError, AttributeError):
        import cuda.core.experimental as core
        names = {n: getattr(core, n) for n in
                 ("Device", "DeviceMemoryResource", "DeviceMemoryResourceOptions", "Buffer", "EventOptions")}
    return names


def version():
    try:
        import cuda.core
        return getattr(cuda.core, "__version__", "unknown")
    except ImportError as e:
        return "none (%s)" % e


def descriptor(buf):
    """The buffer's IPC descriptor, by the method or the property this version has."""
    get = getattr(buf, "get_ipc_descriptor", None)
    if get is not None:
        return get()
    d = buf.ipc_descriptor
    return d() if callable(d) else d


def allocation_handle_fd(mr):
    """The pool's shareable fd, by the method (0.x) or the property (1.x)."""
    get = getattr(mr, "get_allocation_handle", None)
    h = get() if get is not None else mr.allocation_handle
    return h, (h.handle if hasattr(h, "handle") else int(h))


def import_buffer(c, mr, desc, stream):
    """Buffer.from_ipc_descriptor: 1.x wants the stream that will free the import,
    keyword-only; 0.x takes none."""
    try:
        return c["Buffer"].from_ipc_descriptor(mr, desc, stream=stream)
    except TypeError as e:
        if "stream" not in str(e):
            raise
        return c["Buffer"].from_ipc_descriptor(mr, desc)


def timing_options(EventOptions):
    """Options of an event that records time: timing_enabled (1.x) or enable_timing (0.x)."""
    try:
        return EventOptions(timing_enabled=True)
    except TypeError:
        return EventOptions(enable_timing=True)


def ipc_resource(c, dev, max_size):
    opts = c["DeviceMemoryResourceOptions"](ipc_enabled=True, max_size=max_size)
    return c["DeviceMemoryResource"](dev, options=opts)


failed = []  # the operations that failed: the exit status says so


def fail(op, err):
    failed.append(op)
    print("fail %s %s %s" % (IMPL, op, str(err).replace("\n", " ")), flush=True)


def needs(op, gpus, n):
    """Says op is not run on a host of n GPUs, or fails it where CUDAPOOL_REQUIRE_GPUS
    demands them."""
    demanded = os.environ.get("CUDAPOOL_REQUIRE_GPUS", "")
    if demanded.isdigit() and int(demanded) >= gpus:
        fail(op, "%d GPU(s) here; CUDAPOOL_REQUIRE_GPUS=%s demands %d" % (n, demanded, gpus))
    else:
        print("needs %s %s %d" % (IMPL, op, gpus), flush=True)


def measure(op, unit, f):
    try:
        summarize(IMPL, op, unit, f())
    except Exception as e:  # one measurement failing must not stop the others
        fail(op, "%s: %s" % (type(e).__name__, e))
        traceback.print_exc(file=sys.stderr)


def us_since(t0):
    return (time.monotonic_ns() - t0) / 1e3


# ---- The consumer process.

def consumer_main(conn, dev_id):
    try:
        c = api()
        dev = c["Device"](dev_id)
        dev.set_current()
        stream = dev.create_stream()
        fd = multiprocessing.reduction.recv_handle(conn)
        mr = c["DeviceMemoryResource"].from_allocation_handle(c["Device"](0), fd)
        os.close(fd)
        conn.send(("ready",))
    except Exception as e:
        conn.send(("error", "consumer setup: %s: %s" % (type(e).__name__, e)))
        return
    cons = Consumer(c, dev, stream, mr, conn)
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd[0] == "quit":
            return
        try:
            getattr(cons, cmd[0])(*cmd[1:])
        except Exception as e:
            conn.send(("error", "%s: %s: %s" % (cmd[0], type(e).__name__, e)))


class Consumer:
    def __init__(self, c, dev, stream, mr, conn):
        self.c, self.dev, self.stream, self.mr, self.conn = c, dev, stream, mr, conn

    def imported(self, desc):
        return import_buffer(self.c, self.mr, desc, self.stream)

    def request(self, i):
        self.conn.send(("req", i))
        return self.imported(self.conn.recv())

    def release(self, buf):
        buf.close(self.stream)
        self.conn.send(("rel",))
        self.conn.recv()

    def open_loop(self, n):
        us = []
        for i in range(n):
            t0 = time.monotonic_ns()
            buf = self.request(i)
            us.append(us_since(t0))
            buf.close(self.stream)
            self.stream.sync()  # a descriptor imported again while its free is queued would alias it
        self.conn.send(("done", us))

    def release_loop(self, n):
        us = []
        for i in range(n):
            self.stream.sync()
            buf = self.request(i)
            t0 = time.monotonic_ns()
            self.release(buf)
            us.append(us_since(t0))
        self.conn.send(("done", us))

    def open_release_loop(self, n):
        us = []
        for i in range(n):
            self.stream.sync()  # untimed: an import of a descriptor whose free is queued would alias it
            t0 = time.monotonic_ns()
            self.release(self.request(i))
            us.append(us_since(t0))
        self.conn.send(("done", us))

    def import_pairs(self, descs, batches):
        us = []
        for b in range(-1, batches):
            t0 = time.monotonic_ns()
            for d in descs:
                self.imported(d).close(self.stream)
            self.stream.sync()
            if b >= 0:
                us.append(us_since(t0) / len(descs))
        self.conn.send(("done", us))

    def fanout(self, reps):
        for _ in range(reps):
            desc = self.conn.recv()
            buf = self.imported(desc)
            self.conn.send(("at", time.monotonic_ns()))
            buf.close(self.stream)
            self.stream.sync()
            self.conn.send(("freed",))

    def sustain(self, window):
        end = time.monotonic() + window
        n, slow, slow_s = 0, 0, 0.0
        while time.monotonic() < end:
            t0 = time.monotonic()
            buf = self.request(n)
            took = time.monotonic() - t0
            if took >= SLOW_OPEN:
                slow += 1
                slow_s += took
            self.release(buf)
            n += 1
        self.stream.sync()
        self.conn.send(("done", [n, slow, slow_s * 1e3]))

    def read(self, desc, copies):
        timing = timing_options(self.c["EventOptions"])
        if self.dev.device_id != 0:
            self.mr.peer_accessible_by = [self.dev.device_id]
        src = self.imported(desc)
        dst = self.dev.allocate(src.size, stream=self.stream)
        dst.copy_from(src, stream=self.stream)
        gbs = []
        for _ in range(copies):
            e0 = self.stream.record(options=timing)
            dst.copy_from(src, stream=self.stream)
            e1 = self.stream.record(options=timing)
            e1.sync()
            ms = e1 - e0
            gbs.append(src.size / (ms / 1e3) / 1e9)
        dst.close(self.stream)
        src.close(self.stream)
        self.stream.sync()
        self.conn.send(("done", gbs))


# ---- The producer (this process).

def recv(conn, want):
    if not conn.poll(TIMEOUT):
        raise TimeoutError("a consumer said nothing for %.0f s (want %s)" % (TIMEOUT, want))
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError("consumer: " + msg[1])
    if msg[0] != want:
        raise RuntimeError("consumer said %r, want %s" % (msg[0], want))
    return msg[1:]


class Producer:
    def __init__(self, c, shape):
        self.c, self.shape = c, shape
        self.dev = c["Device"](0)
        self.dev.set_current()
        self.stream = self.dev.create_stream()
        self.mr = ipc_resource(c, self.dev, 8 << 30)
        self.consumers = []  # (process, conn)

    def start_consumers(self, devs):
        ctx = mp.get_context("spawn")
        started = []
        for d in devs:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=consumer_main, args=(child, d), daemon=True)
            p.start()
            started.append((p, parent))
        handle, fd = allocation_handle_fd(self.mr)  # handle owns fd: keep it until sent
        for p, conn in started:
            multiprocessing.reduction.send_handle(conn, fd, p.pid)
        for p, conn in started:
            recv(conn, "ready")
        self.consumers.extend(started)
        return [conn for _, conn in started]

    def close(self):
        for p, conn in self.consumers:
            try:
                conn.send(("quit",))
            except OSError:
                pass
        for p, _ in self.consumers:
            p.join(TIMEOUT)
            if p.is_alive():
                p.kill()

    def buffers(self, n, size=SHARE_SIZE):
        bufs = [self.mr.allocate(size, stream=self.stream) for _ in range(n)]
        self.stream.sync()
        return bufs

    def drop(self, bufs):
        for b in bufs:
            b.close(self.stream)
        self.stream.sync()

    def export_fresh(self):
        bufs = self.buffers(self.shape["samples"])
        us = []
        for b in bufs:
            t0 = time.monotonic_ns()
            descriptor(b)
            us.append(us_since(t0))
        self.drop(bufs)
        return us

    def serve(self, conn, fresh, bufs, descs):
        """Answer conn's requests and releases until it says done; its samples."""
        while True:
            if not conn.poll(TIMEOUT):
                raise TimeoutError("consumer said nothing for %.0f s" % TIMEOUT)
            msg = conn.recv()
            if msg[0] == "req":
                i = msg[1] % len(bufs)
                conn.send(descriptor(bufs[i]) if fresh else descs[i])
            elif msg[0] == "rel":
                conn.send(("ack",))
            elif msg[0] == "done":
                return msg[1]
            elif msg[0] == "error":
                raise RuntimeError("consumer: " + msg[1])

    def shared(self, n, fresh):
        bufs = self.buffers(n)
        return bufs, None if fresh else [descriptor(b) for b in bufs]

    def on_consumer(self, conn, verb, fresh):
        s = self.shape
        n = s["warmup"] + s["samples"]
        bufs, descs = self.shared(n if fresh else s["ring"], fresh)
        try:
            conn.send((verb, n))
            us = self.serve(conn, fresh, bufs, descs)
        finally:
            self.drop(bufs)
        return us[s["warmup"]:]

    def import_pairs(self, conn):
        bufs, descs = self.shared(self.shape["import_buffers"], False)
        try:
            conn.send(("import_pairs", descs, self.shape["batches"]))
            (us,) = recv(conn, "done")
        finally:
            self.drop(bufs)
        return us

    def fanout(self, conns):
        s = self.shape
        for conn in conns:
            conn.send(("fanout", s["warmup"] + s["fanout_reps"]))
        us = []
        for rep in range(s["warmup"] + s["fanout_reps"]):
            (buf,) = self.buffers(1)
            t0 = time.monotonic_ns()
            desc = descriptor(buf)
            for conn in conns:
                conn.send(desc)
            last = max([t0] + [recv(conn, "at")[0] for conn in conns])
            for conn in conns:
                recv(conn, "freed")
            self.drop([buf])
            if rep >= s["warmup"]:
                us.append((last - t0) / 1e3)
        return us

    def sustained(self, conns):
        s = self.shape
        bufs, descs = self.shared(s["ring"], False)
        rates = []
        try:
            for _ in range(s["rounds"]):
                for conn in conns:
                    conn.send(("sustain", s["window"]))
                running, total, slow, slow_ms = set(conns), 0, 0, 0.0
                while running:
                    ready = multiprocessing.connection.wait(list(running), TIMEOUT)
                    if not ready:
                        raise TimeoutError("consumers said nothing for %.0f s" % TIMEOUT)
                    for conn in ready:
                        msg = conn.recv()
                        if msg[0] == "req":
                            conn.send(descs[msg[1] % len(descs)])
                        elif msg[0] == "rel":
                            conn.send(("ack",))
                        elif msg[0] == "done":
                            total += msg[1][0]
                            slow += msg[1][1]
                            slow_ms += msg[1][2]
                            running.discard(conn)
                        elif msg[0] == "error":
                            raise RuntimeError("consumer: " + msg[1])
                print("window %s sustained/4 %d %d %d %.3f %.2f" % (IMPL, len(rates), total, slow, slow_ms,
                                                                   total / s["ring"]), flush=True)
                rates.append(total / s["window"])
        finally:
            self.drop(bufs)
        return rates

    def read(self, conn):
        (buf,) = self.buffers(1, self.shape["read_size"])
        try:
            conn.send(("read", descriptor(buf), self.shape["copies"]))
            (gbs,) = recv(conn, "done")
        finally:
            self.drop([buf])
        return gbs


TURN_TIMEOUT = 60.0  # a hang guard for the ring's token


class Ring:
    """This participant's place in the allocation ring: the token (the turn's
    number, a line of text) comes in on one named pipe and goes on by another."""

    def __init__(self, spec):
        ins, outs = spec.split(",")
        # O_RDWR never blocks on a FIFO (Linux), whatever order the participants open in.
        self.inp = os.open(ins, os.O_RDWR)
        self.out = os.open(outs, os.O_RDWR)

    def take(self):
        ready, _, _ = select.select([self.inp], [], [], TURN_TIMEOUT)
        if not ready:
            raise TimeoutError("no turn came for %.0f s: another participant died or runs another plan" % TURN_TIMEOUT)
        return int(os.read(self.inp, 32).decode().strip())

    def give(self, turn):
        os.write(self.out, b"%d\n" % (turn + 1))


def parse_plan(text):
    """"KIND/SIZE=BYTES ..." as (kind, op, bytes)."""
    plan = []
    for entry in text.split():
        name, _, nbytes = entry.partition("=")
        kind = name.split("/")[0]
        if kind not in ("ipc", "local", "hit", "miss") or not nbytes.isdigit() or int(nbytes) == 0:
            raise ValueError("plan entry %r: want KIND/SIZE=BYTES, KIND one of ipc, local, hit, miss" % entry)
        plan.append((kind, "alloc/" + name, int(nbytes)))
    if not plan:
        raise ValueError("empty plan")
    return plan


def alloc_ring(args):
    """One participant of the allocation ring; returns the exit status."""
    opts = dict(zip(args[0::2], args[1::2]))
    try:
        plan = parse_plan(opts["--plan"])
        ring = Ring(opts["--ring"])
        rnd, batches, pairs = int(opts["--round"]), int(opts["--batches"]), int(opts["--pairs"])
    except (KeyError, ValueError) as e:
        print("cudacore alloc: bad arguments: %s" % e, file=sys.stderr)
        return 2
    work = None
    try:
        c = api()
        dev = c["Device"](0)
        dev.set_current()
        work = (c, dev)
    except Exception as e:
        fail("alloc", "cuda.core %s: %s: %s" % (version(), type(e).__name__, e))
    if "--ready" in opts:
        fd = os.open(opts["--ready"], os.O_RDWR)
        os.write(fd, b"ready cudacore %d\n" % os.getpid())
        os.close(fd)
    for kind, op, nbytes in plan:
        for slot in ("api", "binding"):
            mr = s = None
            for b in range(-1, batches):
                turn = ring.take()
                if work is not None and slot == "api":
                    try:
                        if b == -1:  # set up inside the first turn: nothing of it beside another's batch
                            c, dev = work
                            mr = c["DeviceMemoryResource"](dev, options=c["DeviceMemoryResourceOptions"](
                                ipc_enabled=kind != "local", max_size=max(1 << 30, 2 * nbytes)))
                            s = dev.create_stream()
                            mr.allocate(nbytes, stream=s).close(s)  # the pool reserves its memory once
                            s.sync()
                            print("bytes %s %s %d" % (IMPL, op, nbytes), flush=True)
                        t0 = time.monotonic_ns()
                        for _ in range(pairs):
                            mr.allocate(nbytes, stream=s).close(s)
                        s.sync()
                        us = us_since(t0) / pairs
                        if b >= 0:
                            print("sample %s api %s %d %d %d %.4f" % (IMPL, op, rnd, b, turn, us), flush=True)
                        if b == batches - 1:
                            mr.close()
                    except Exception as e:  # this column fails; the ring goes on
                        fail(op, "%s: %s" % (type(e).__name__, e))
                        traceback.print_exc(file=sys.stderr)
                        work = None
                ring.give(turn)
    return 0  # its failures are fail lines: the ring must go on to its end


def device_count(c):
    try:
        from cuda.core import system
        n = getattr(system, "num_devices", None)
        if n is None:
            n = system.get_num_devices()
        return n() if callable(n) else n
    except Exception:
        try:
            c["Device"](1)
            return 2
        except Exception:
            return 1


def main():
    if sys.argv[1:2] == ["alloc"]:
        return alloc_ring(sys.argv[2:])
    shape = QUICK if "--quick" in sys.argv[1:] else FULL
    # cuda.core checks that IPC objects travel to spawned processes only.
    mp.set_start_method("spawn", force=True)
    print("# cudacore: cuda.core %s, Python %s" % (version(), sys.version.split()[0]), flush=True)
    try:
        c = api()
    except Exception as e:
        fail("all", "cuda.core %s lacks the API this script uses: %s: %s" % (version(), type(e).__name__, e))
        return 1
    try:
        pr = Producer(c, shape)
    except Exception as e:
        fail("sharing", "%s: %s" % (type(e).__name__, e))
        return 1
    try:
        measure("export/fresh", "us", pr.export_fresh)
        ndev = device_count(c)
        devs = [0] * max(max(FANOUTS), SUSTAIN_CONSUMERS) + ([1] if ndev > 1 else [])
        try:
            conns = pr.start_consumers(devs)
        except Exception as e:
            fail("sharing", "starting consumers: %s: %s" % (type(e).__name__, e))
            return 1
        one = conns[0]
        measure("import/api", "us", lambda: pr.import_pairs(one))
        measure("open/first", "us", lambda: pr.on_consumer(one, "open_loop", True))
        measure("open/exported", "us", lambda: pr.on_consumer(one, "open_loop", False))
        measure("release", "us", lambda: pr.on_consumer(one, "release_loop", False))
        measure("open+release/exported", "us", lambda: pr.on_consumer(one, "open_release_loop", False))
        for n in FANOUTS:
            measure("fanout/%d" % n, "us", lambda n=n: pr.fanout(conns[:n]))
        measure("sustained/4", "shares/s", lambda: pr.sustained(conns[:SUSTAIN_CONSUMERS]))
        measure("read/same-gpu", "GB/s", lambda: pr.read(one))
        if ndev > 1:
            measure("read/other-gpu", "GB/s", lambda: pr.read(conns[-1]))
        else:
            needs("read/other-gpu", 2, ndev)
    finally:
        pr.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
