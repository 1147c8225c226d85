"""Turns one run of cudapool's benchmark suite into its tables.

Reads the lines that bench/cref, bench/gosuite, bench/cudacore.py, bench/torchbench.py,
bench/kvbench.py and scripts/bench-suite.sh print into one raw file, and those of
examples/replicas/run.py --raw (scripts/gpu-examples.sh's replicas-raw.txt), given as a
second raw file or concatenated with the first:

    result IMPL OP UNIT MEDIAN P90 N          a measurement's summary
    raw IMPL OP UNIT V1 V2 ...                its samples (every statistic comes from these)
    sample IMPL SLOT OP ROUND BATCH TURN US   one batch of the allocation ring
    bytes IMPL OP BYTES                       what each allocation of OP allocates
    window IMPL OP ROUND SHARES SLOW SLOW_MS TURNS   one window of a sustained rate
    settle IMPL OP ROUND WAITS WAIT_MS        C's waits for its own earlier frees there
    calls IMPL OP ROUND SIDE CALL N MS MAX_MS  a window's runtime calls on one side (skipped:
                                              read in the raw file, they say where a share's time went)
    validated IMPL all CHECKED GIVEN          buffers a validating run's consumers checked
    fail IMPL OP REASON...                    a measurement that could not be taken
    absent IMPL OP REASON...                  a measurement whose feature is not on main
    needs IMPL OP GPUS                        a measurement this host has too few GPUs for
    meta KEY VALUE...

(anything else is skipped), and prints, the targets last:

  - the allocation pairs of the ring: each batch of Go and cuda.core gets the timing
    state (fast or slow) of the C batch taken next to it on the same CPU, C's state
    being found by splitting C's batches in two clusters; ratios are given state by
    state (fast against fast), and for the best and the median batch;
  - the sharing operations where cudapool and C follow the same protocol, each
    latency with its median, mean, p99 and maximum;
  - the other routes and libraries (legacy IPC, cuda.core), which follow other
    protocols: figures for orientation, never a verdict;
  - the sustained windows: shares, the Opens that stalled and their time;
  - the rows of issues 10 and 11, "not run (feature absent)" where so;
  - a row that needs more GPUs than the host has (a needs line), "not run (needs 2
    GPUs)", which is no failure;
  - the KV page pool (issues 18 and 24): match + lease of 512 pages from Go and Python,
    pages/s by 4 replicas, the Go rows' slab and each replica's dial, and the replicas
    example's dials, time to first token, decode rate and KV bytes, each with the
    reference of the same run ("not run" where no line says it);
  - stock transformers models over the pool (issue 26, examples/hf/check.py --raw's
    hf-raw.txt, a third raw file): time to first token matched vs computed, decode over
    pool pages vs transformers' fastest own path, greedy tokens against its generate;
  - the targets, each verdict computed from one fair pair of this run.

The raw file is checked first: a result whose samples do not give its median or
count, two columns of one allocation row that allocate different bytes, a Go batch
without its C neighbour, a malformed line. Each such problem is printed, the
tables still come, and the exit status is 1.

With --md the same goes, as Markdown, to FILE (bench/RESULTS.md), with the text of
--notes under its own heading, the targets first.

Usage: python3 bench/table.py RAW [RAW...] [--md FILE] [--notes FILE]
"""

import math
import sys

# ---- Reading the raw file.

RATES = ("GB/s", "shares/s", "pages/s", "tok/s")
# The version of the suite's lines and protocols: scripts/bench-suite.sh says it in a
# "meta suite" line; a raw file of another version compared other work.
SUITE = "2"


class Run:
    def __init__(self, lines):
        self.results, self.raws, self.fails, self.absent, self.meta = {}, {}, {}, {}, {}
        self.needs = {}  # (impl, op): the GPUs it needs
        self.samples, self.bytes, self.windows, self.settles, self.validated = [], {}, [], [], []
        self.problems = []
        for n, line in enumerate(lines, 1):
            f = line.split()
            if not f:
                continue
            try:
                self.read(f)
            except (ValueError, IndexError) as e:
                self.problems.append("line %d: %s: %r" % (n, e, line.strip()[:120]))
        self.check()

    def read(self, f):
        kind = f[0]
        if kind == "result":
            need(f, 7)
            key = (f[1], f[2])
            if key in self.results:
                raise ValueError("a second result for %s %s" % key)
            self.results[key] = (f[3], float(f[4]), float(f[5]), int(f[6]))
        elif kind == "raw":
            if len(f) < 5:
                raise ValueError("a raw line without samples")
            self.raws[(f[1], f[2])] = (f[3], sorted(float(x) for x in f[4:]))
        elif kind == "sample":
            need(f, 8)
            self.samples.append(dict(impl=f[1], slot=f[2], op=f[3], round=int(f[4]), batch=int(f[5]),
                                     turn=int(f[6]), us=positive(f[7])))
        elif kind == "bytes":
            need(f, 4)
            self.bytes.setdefault(f[2], {})[f[1]] = int(f[3])
        elif kind == "window":
            need(f, 8)
            self.windows.append(dict(impl=f[1], op=f[2], round=int(f[3]), shares=float(f[4]), slow=float(f[5]),
                                     slow_ms=float(f[6]), turns=float(f[7])))
        elif kind == "settle":
            need(f, 6)
            self.settles.append(dict(impl=f[1], op=f[2], round=int(f[3]), waits=float(f[4]), ms=float(f[5])))
        elif kind == "validated":
            need(f, 5)
            self.validated.append((f[1], int(f[3]), int(f[4])))
        elif kind in ("fail", "absent"):
            if len(f) < 3:
                raise ValueError("a %s line without an operation" % kind)
            (self.fails if kind == "fail" else self.absent)[(f[1], f[2])] = " ".join(f[3:])
        elif kind == "needs":
            need(f, 4)
            gpus = int(f[3])
            if gpus < 2:
                raise ValueError("a needs line for %d GPUs" % gpus)
            self.needs[(f[1], f[2])] = gpus
        elif kind == "meta" and len(f) >= 2:
            self.meta[f[1]] = " ".join(f[2:])
        elif f[:2] == ["cref", "runtime"] and len(f) == 5:
            self.meta.setdefault("cuda", "%s (driver API %s)" % (cuda_version(f[2]), cuda_version(f[4])))

    def check(self):
        if self.meta.get("suite") != SUITE:
            self.problems.append("the raw file is of suite version %s, not %s: its columns did other work" % (
                self.meta.get("suite", "1 (no meta suite line)"), SUITE))
        for key, (unit, median, _, n) in self.results.items():
            raw = self.raws.get(key)
            if raw is None:
                self.problems.append("%s %s: a result without its samples" % key)
            elif len(raw[1]) != n or not close(raw[1][len(raw[1]) // 2], median):
                self.problems.append("%s %s: the result says median %g of %d, the samples give %g of %d" % (
                    key + (median, n, raw[1][len(raw[1]) // 2], len(raw[1]))))
        for op, by in self.bytes.items():
            if len(set(by.values())) > 1:
                self.problems.append("%s: the columns allocate different bytes: %s" % (
                    op, ", ".join("%s %d" % kv for kv in sorted(by.items()))))
        seen = set()
        for s in self.samples:
            key = (s["impl"], s["slot"], s["op"], s["round"], s["batch"])
            if key in seen:
                self.problems.append("a second sample for %s %s %s round %d batch %d" % key)
            seen.add(key)
        c = {(s["slot"], s["op"], s["round"], s["batch"]): s for s in self.samples if s["impl"] == "c"}
        for s in self.samples:
            if s["impl"] == "c":
                continue
            n = c.get((s["slot"], s["op"], s["round"], s["batch"]))
            if n is None:
                self.problems.append("%s %s %s round %d batch %d: no C batch beside it" % (
                    s["impl"], s["slot"], s["op"], s["round"], s["batch"]))
            elif abs(n["turn"] - s["turn"]) > 2:
                self.problems.append("%s %s %s round %d batch %d: its C batch is %d turns away, not beside it" % (
                    s["impl"], s["slot"], s["op"], s["round"], s["batch"], abs(n["turn"] - s["turn"])))
        for impl, checked, given in self.validated:
            if checked != given or given == 0:
                self.problems.append("%s's consumers validated %d of the %d buffers they were given" % (
                    impl, checked, given))

    def stats(self, impl, op):
        """Stats of impl's op from its samples, or None."""
        raw = self.raws.get((impl, op))
        return Stats(raw[0], raw[1]) if raw else None

    def failed(self, impl, op):
        """Why impl's op failed (itself, all of impl, or the suite's part), or None."""
        for key in ((impl, op), (impl, "all"), (impl, "sharing"), (impl, op.split("/")[0])):
            if key in self.fails:
                return self.fails[key]
        part = {"c": "cref", "legacy": "cref", "cudapool": "gosuite", "cudart": "gosuite",
                "cudacore": "cudacore", "torch": "torch", "python": "torch"}.get(impl)
        if op.startswith("alloc/"):
            part = "alloc"
        if op.startswith("kv/"):
            part = {"cudapool": "gosuite-kv", "python": "kvbench"}.get(impl)
        if op.startswith("kv/host/"):
            part = "gosuite-kvtier"
        return self.fails.get(("suite", part)) if part else None


def need(f, n):
    if len(f) != n:
        raise ValueError("%d fields, want %d" % (len(f), n))


def positive(x):
    v = float(x)
    if not v > 0:
        raise ValueError("a time that is not positive")
    return v


def close(a, b):
    return abs(a - b) <= 1e-3 * max(abs(a), abs(b), 1e-9)


def cuda_version(v):
    """CUDA's integer version (13000) as 13.0."""
    try:
        v = int(v)
    except ValueError:
        return v
    return "%d.%d" % (v // 1000, v % 1000 // 10)


class Stats:
    def __init__(self, unit, v):
        self.unit, self.v = unit, sorted(v)
        n = len(self.v)
        self.n = n
        self.median = self.v[n // 2]
        self.mean = sum(self.v) / n
        self.max, self.min = self.v[-1], self.v[0]
        self.p99 = self.v[max(0, math.ceil(0.99 * n) - 1)]
        self.p10 = self.v[int(0.1 * (n - 1) + 0.5)]

    def rate(self):
        return self.unit in RATES

    def cells(self):
        """median, mean, p99, max for a time; median, p10 (the slow tail), min for a rate."""
        if self.rate():
            return "%s / %s / %s" % (num(self.median), num(self.p10), num(self.min))
        return "%s / %s / %s / %s" % (num(self.median), num(self.mean), num(self.p99), num(self.max))


def num(x):
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return "{:,.0f}".format(x)
    if abs(x) >= 100:
        return "%.1f" % x
    if abs(x) < 0.1:
        return "%.3g" % x
    return "%.2f" % x


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else None


def ratio(a, b):
    return a / b if a is not None and b else None


def rtext(r):
    return "-" if r is None else "%.2f" % r


# ---- The allocation ring.

ALLOC_OPS = tuple("alloc/%s/%s" % (kind, size) for kind in ("ipc", "hit", "miss") for size in ("1KiB", "1MiB", "64MiB")) + \
    ("alloc/local/1KiB", "alloc/local/1MiB")
ALLOC_WHAT = {"ipc": "exportable pool", "local": "local pool", "hit": "exportable pool, cache hit",
              "miss": "exportable pool, cache miss"}
# Each column of the ring and the C slot it is compared with.
RING_COLUMNS = (("cudapool", "api", "pool.Alloc + Free (Go)"),
                ("cudart", "binding", "bare binding (Go, cgo)"),
                ("cudacore", "api", "cuda.core allocate + close"))
SEPARATION = 1.25  # two clusters of C's batches are two states when their medians differ this much


def two_states(values):
    """The threshold between C's fast and slow batches, or None for one state: the
    split of the sorted logs that leaves the least squares within the two parts,
    kept when their medians differ by SEPARATION at least."""
    v = sorted(values)
    if len(v) < 4:
        return None
    logs = [math.log(x) for x in v]
    best, at = None, None
    for k in range(2, len(v) - 1):
        lo, hi = logs[:k], logs[k:]
        cost = sum((x - sum(lo) / len(lo)) ** 2 for x in lo) + sum((x - sum(hi) / len(hi)) ** 2 for x in hi)
        if best is None or cost < best:
            best, at = cost, k
    if at is None or median(v[at:]) / median(v[:at]) < SEPARATION:
        return None
    return math.sqrt(v[at - 1] * v[at])


class AllocRow:
    """One column of one allocation operation, compared with its C neighbours."""

    def __init__(self, run, op, impl, slot):
        self.op, self.impl, self.slot = op, impl, slot
        mine = [s for s in run.samples if s["impl"] == impl and s["slot"] == slot and s["op"] == op]
        cs = {(s["round"], s["batch"]): s for s in run.samples if s["impl"] == "c" and s["op"] == op
              and s["slot"] == slot}
        self.threshold = two_states([s["us"] for s in run.samples if s["impl"] == "c" and s["op"] == op])
        self.states = self.threshold is not None

        def state(c):
            return "one" if not self.states else ("fast" if c["us"] < self.threshold else "slow")

        pairs = [(s["us"], cs[(s["round"], s["batch"])]) for s in mine if (s["round"], s["batch"]) in cs]
        self.n = len(mine)
        self.values = [v for v, _ in pairs]
        self.c_values = [c["us"] for _, c in pairs]
        self.by_state = {}
        for v, c in pairs:
            self.by_state.setdefault(state(c), []).append((v, c["us"]))
        # How often this column's own clusters agree with its neighbour's state: a
        # check that the state is the CPU's, not the process's.
        own = two_states(self.values)
        self.agreement = None
        if own is not None and self.states:
            same = sum(1 for v, c in pairs if (v < own) == (c["us"] < self.threshold))
            self.agreement = same / len(pairs)

    def state_median(self, state, which):
        got = self.by_state.get(state, [])
        return median([p[which] for p in got]) if got else None

    def fair(self):
        """The fair pair: this column's and C's medians in C's fast state (in its slow
        state where no batch of this column had a fast neighbour; in its one state where
        C showed one), the state's name and how many pairs."""
        state = "one"
        if self.states:
            state = "fast" if self.by_state.get("fast") else "slow"
        n = len(self.by_state.get(state, []))
        return self.state_median(state, 0), self.state_median(state, 1), state, n


def alloc_label(op):
    _, kind, size = op.split("/")
    return "%s %s" % (ALLOC_WHAT.get(kind, kind), size)


def alloc_rows(run):
    head = ["operation", "column", "batches", "best", "median", "fast (n)", "slow (n)",
            "vs C best", "vs C median", "vs C fast", "vs C slow", "state agrees"]
    rows = []
    ops = [op for op in ALLOC_OPS if any(s["op"] == op for s in run.samples)]
    ops += sorted({s["op"] for s in run.samples} - set(ops))
    for op in ops:
        c = [s["us"] for s in run.samples if s["impl"] == "c" and s["op"] == op and s["slot"] == "api"]
        thr = two_states([s["us"] for s in run.samples if s["impl"] == "c" and s["op"] == op])
        fast = [x for x in c if thr is None or x < thr]
        slow = [x for x in c if thr is not None and x >= thr]
        label = alloc_label(op) + " (%s B)" % num(run.bytes.get(op, {}).get("c")) if run.bytes.get(op) else alloc_label(op)
        rows.append([label, "C (states split at %s us)" % num(thr) if thr else "C (one state)", len(c),
                     num(min(c)) if c else "-", num(median(c)),
                     "%s (%d)" % (num(median(fast)), len(fast)) if thr else "%s (one state)" % num(median(c)),
                     "%s (%d)" % (num(median(slow)), len(slow)) if thr else "-", "", "", "", "", ""])
        for impl, slot, what in RING_COLUMNS:
            r = AllocRow(run, op, impl, slot)
            if not r.n:
                why = run.failed(impl, op) or run.fails.get((impl, "alloc"))
                rows.append(["", what, 0, "FAIL" if why else "-"] + [""] * 8)
                continue
            cbest = min(r.c_values) if r.c_values else None
            f, fc = r.state_median("fast" if r.states else "one", 0), r.state_median("fast" if r.states else "one", 1)
            s, sc = r.state_median("slow", 0), r.state_median("slow", 1)
            rows.append(["", what, r.n, num(min(r.values)) if r.values else "-", num(median(r.values)),
                         "%s (%d)" % (num(f), len(r.by_state.get("fast" if r.states else "one", []))),
                         "%s (%d)" % (num(s), len(r.by_state.get("slow", []))) if r.states else "-",
                         rtext(ratio(min(r.values) if r.values else None, cbest)),
                         rtext(ratio(median(r.values), median(r.c_values))),
                         rtext(ratio(f, fc)), rtext(ratio(s, sc)),
                         "-" if r.agreement is None else "%.0f%%" % (100 * r.agreement)])
    return head, rows


# ---- Sharing: the same protocol in cudapool and C.

# (op, what, cudapool's impl, the layer the comparison is at)
SAME_PROTOCOL = (
    ("import/pair", "import+free pair", "cudart", "bare binding: cudaMemPoolImportPointer + cudaFreeAsync"),
    ("export/fresh", "export of a fresh buffer", "cudapool", "Publish / cudaMemPoolExportPointer"),
    ("open/first", "open end to end, first time", "cudapool", "ordered open"),
    ("open/exported", "open end to end, already exported", "cudapool", "ordered open"),
    ("release", "release round trip", "cudapool", "ordered release + reply"),
    ("open+release/exported", "open + release, already exported", "cudapool", "ordered open and release"),
    ("fanout/1", "fan-out to 1 consumer", "cudapool", "push, ordered"),
    ("fanout/2", "fan-out to 2 consumers", "cudapool", "push, ordered"),
    ("fanout/4", "fan-out to 4 consumers", "cudapool", "push, ordered"),
    ("fanout/7", "fan-out to 7 consumers", "cudapool", "push, ordered"),
    ("sustained/4", "sustained shares, 1 producer, 4 consumers", "cudapool", "ordered open and release"),
    ("read/same-gpu", "read of an imported buffer, same GPU", "cudapool", "copy out of the mapping"),
    ("read/other-gpu", "read of an imported buffer, other GPU", "cudapool", "copy out of the mapping"),
)


def cell(run, impl, op):
    st = run.stats(impl, op)
    if st:
        return st.cells(), st
    if (impl, op) in run.absent:
        return "not run (feature absent)", None
    if (impl, op) in run.needs:
        return "not run (needs %d GPUs)" % run.needs[(impl, op)], None
    return ("FAIL" if run.failed(impl, op) else "-"), None


def sharing_rows(run):
    head = ["operation", "unit", "cudapool", "C", "vs C (median)", "vs C (mean)"]
    rows = []
    for op, what, impl, _ in SAME_PROTOCOL:
        g, gs = cell(run, impl, op)
        c, cs = cell(run, "c", op)
        unit = (gs or cs).unit if (gs or cs) else "-"
        rm = rtext(ratio(gs.median, cs.median)) if gs and cs else "-"
        rmean = rtext(ratio(gs.mean, cs.mean)) if gs and cs and not gs.rate() else "-"
        rows.append([what + (" (bare binding)" if impl == "cudart" else ""), unit, g, c, rm, rmean])
    for op, what in (("copy/same-gpu", "plain device copy, same GPU"), ("copy/other-gpu", "plain device copy, other GPU")):
        c, cs = cell(run, "c", op)
        rows.append([what, cs.unit if cs else "GB/s", "-", c, "-", "-"])
    return head, rows


# ---- Other routes and libraries: other protocols, for orientation.

OTHERS = (
    ("legacy", "alloc/1KiB", "cudaMalloc + cudaFree, 1 KiB"),
    ("legacy", "alloc/1MiB", "cudaMalloc + cudaFree, 1 MiB"),
    ("legacy", "alloc/64MiB", "cudaMalloc + cudaFree, 64 MiB"),
    ("legacy", "import/pair", "cudaIpcOpenMemHandle + Close pair"),
    ("cudacore", "import/api", "cuda.core Buffer.from_ipc_descriptor + close (its API, not a binding)"),
) + tuple((impl, op, what) for impl in ("legacy", "cudacore") for op, what, _, _ in SAME_PROTOCOL[1:])
DIFFERS = {"legacy": "legacy IPC: cudaMalloc memory, a handle per allocation, close is synchronous",
           "cudacore": "cuda.core: no wait on the producer's writes, no ordered release, no reply"}


def other_rows(run):
    head = ["column", "operation", "unit", "figure", "cudapool / it (median)"]
    rows = []
    go_of = {op: impl for op, _, impl, _ in SAME_PROTOCOL}
    for impl, op, what in OTHERS:
        c, st = cell(run, impl, op)
        if c == "-":
            continue
        g = run.stats(go_of.get(op, "cudapool"), op)
        rows.append([{"legacy": "legacy IPC", "cudacore": "cuda.core"}[impl], what, st.unit if st else "-", c,
                     rtext(ratio(g.median, st.median)) if g and st else "-"])
    return head, rows


def window_rows(run):
    head = ["column", "operation", "window", "shares", "opens >= 1 ms", "ms in them", "turns", "settle waits (ms)"]
    rows = []
    settles = {(s["impl"], s["op"], s["round"]): s for s in run.settles}
    for w in run.windows:
        s = settles.get((w["impl"], w["op"], w["round"]))
        rows.append([w["impl"], w["op"], w["round"], num(w["shares"]), "%d" % w["slow"], num(w["slow_ms"]),
                     num(w["turns"]), "%d (%s)" % (s["waits"], num(s["ms"])) if s else "-"])
    return head, rows


# ---- Issues 10 and 11.

FEATURE_ROWS = (
    ("cudapool", "sustained/4/recycled", "sustained shares/s, recycled 2 MiB buffers, 4 consumers (issue 11)"),
    ("cudapool", "block/64KiB/b1", "block shares/s, 64 KiB of a 1 GiB slab, batch 1, 4 consumers each holding "
                                   "one block (issue 11)"),
    ("cudapool", "block/64KiB/b64", "block shares/s, 64 KiB of a 1 GiB slab, batch 64, 4 consumers (issue 11)"),
    ("cudapool", "blocklease/64KiB", "block lease latency (open), 64 KiB, the consumer holding one block "
                                     "(issue 11)"),
    ("torch", "alloc/1MiB/native", "torch alloc+free 1 MiB, native caching allocator (issue 10)"),
    ("torch", "alloc/1MiB/cudaMallocAsync", "torch alloc+free 1 MiB, backend:cudaMallocAsync (issue 10)"),
    ("torch", "alloc/1MiB/cudapool", "torch alloc+free 1 MiB, cudapool as the current allocator (issue 10)"),
    ("torch", "alloc/1MiB/cudapool-cache",
     "torch alloc+free 1 MiB, cudapool as the current allocator, its pool's cache on (CUDAPOOL_TORCH_CACHE=64 MiB)"),
    ("python", "open+release/exported", "Python open+release, already exported (issue 10)"),
    ("torch", "read/own", "torch read of its own memory, same GPU (issue 10)"),
    ("torch", "read/mapping", "torch read of a cudapool mapping, same GPU (issue 10)"),
)


def feature_rows(run):
    head = ["operation", "unit", "figure", "why not"]
    rows = []
    for impl, op, what in FEATURE_ROWS:
        st = run.stats(impl, op)
        if st:
            rows.append([what, st.unit, st.cells(), ""])
        elif (impl, op) in run.absent:
            rows.append([what, "-", "not run (feature absent)", run.absent[(impl, op)]])
        elif run.failed(impl, op):
            rows.append([what, "-", "FAIL", run.failed(impl, op)[:120]])
        else:
            rows.append([what, "-", "not reported", "no line in the raw file says why"])
    return head, rows


# ---- The KV page pool (issue 18).

KV_MATCH = (("kv/match512", "match + lease of 512 pages (8,192 tokens), one round trip"),
            ("kv/match512+hash", "the same, the 512 prefix hashes computed each time"))
KV_IMPLS = (("cudapool", "Go"), ("python", "Python"))
# Issue 25's rows of gosuite kv: (op, what) in the table, (op, target, at most) as targets.
KV_HOTPATH = (("kv/hash512", "the 512 prefix hashes of 8,192 tokens alone, Go"),
              ("kv/visible", "seal -> visible after the writer's work completed (one Match included), Go"),
              ("kv/idle-cpu", "the owner (page server and slab exporter, 4 replicas connected) idle for 10 s, % of "
               "a CPU"))
KV_HOTPATH_TARGETS = (("kv/hash512", "prefix hashes of 8,192 tokens (512 pages), Go, p50 at most 60 us", 60),
                      ("kv/visible", "seal -> visible to another replica after the writer's work completed, p50 at "
                       "most 50 us", 50),
                      ("kv/idle-cpu", "an idle owner (page server and slab exporter) under 1% of one CPU over 10 s",
                       1))
KV_BATCHES = (16, 64, 256, 512)
KV_LENGTHS = (8192, 32768)
KV_HOST = (("kv/host/restore32k", "restore of a 32,768-token prompt from the host tier (2,048 pages, 1 GiB), "
                                  "effective over the match, bytes checked"),
           ("kv/host/spill", "spill of pages to the host tier, over its copies"))
GIB = float(1 << 30)


def kv_stats(run, impl, op):
    """impl's op as Stats, or None and why there is none: FAIL and its reason, or not run."""
    st = run.stats(impl, op)
    if st:
        return st, ""
    why = run.failed(impl, op)
    return None, ("FAIL: " + why[:120]) if why else "not run (no line in the raw files)"


def replicas_slab_gib(run):
    """The replicas example's slab in GiB, from its meta line ("64.0 GiB in 21 chunks ..."), or None."""
    f = run.meta.get("replicas-slab", "").split()
    try:
        return float(f[0]) if len(f) > 1 and f[1] == "GiB" else None
    except ValueError:
        return None


def kv_pair(run, op, ref_op, unit, scale=1.0):
    """The cells of replicas' op against ref_op (medians, scaled) and their ratio."""
    a, why_a = kv_stats(run, "replicas", op)
    b, why_b = kv_stats(run, "replicas", ref_op)
    fa = "%s %s (n=%d)" % (num(a.median / scale), unit, a.n) if a else why_a
    fb = "%s %s (n=%d)" % (num(b.median / scale), unit, b.n) if b else why_b
    r = ratio(a.median, b.median) if a and b else None
    return fa, fb, "-" if r is None else "%.1f%%" % (100 * r)


def kv_rows(run):
    head = ["row", "figure", "against (same run)", "ratio"]
    rows = []
    for impl, lang in KV_IMPLS:
        for op, what in KV_MATCH:
            st, why = kv_stats(run, impl, op)
            rows.append(["%s, %s" % (what, lang),
                         "p50 %s us, p99 %s us (n=%d)" % (num(st.median), num(st.p99), st.n) if st else why, "-", "-"])
    slab, why = kv_stats(run, "cudapool", "kv/slab")
    dial, why_d = kv_stats(run, "cudapool", "kv/dial")
    rows.append(["the Go rows' slab: %s" % run.meta.get("kv-slab", "-"),
                 "%s GiB" % num(slab.median / GIB) if slab else why, "-", "-"])
    rows.append(["dial of a replica process, every chunk of that slab mapped, Go",
                 "median %s ms, max %s ms (n=%d)" % (num(dial.median), num(dial.max), dial.n) if dial else why_d,
                 "-", "-"])
    st, why = kv_stats(run, "cudapool", "kv/grow")
    rows.append(["growth of a slab, a chunk from the owner's mapping to every idle replica's, Go: %s" %
                 run.meta.get("kv-grow", "-"),
                 "p50 %s us, p99 %s us (n=%d chunks)" % (num(st.median), num(st.p99), st.n) if st else why, "-", "-"])
    dial, why_d = kv_stats(run, "replicas", "dial")
    rows.append(["dial of a replicas example process (Python): %s" % run.meta.get("replicas-slab", "-"),
                 "median %s ms, max %s ms (n=%d)" % (num(dial.median), num(dial.max), dial.n) if dial else why_d,
                 "-", "-"])
    for b in KV_BATCHES:
        st, why = kv_stats(run, "cudapool", "kv/pages/b%d" % b)
        rows.append(["pages/s through alloc + seal + match + release, batch %d, 4 replicas, Go" % b,
                     "%s pages/s (median / p10 / min of %d windows)" % (st.cells(), st.n) if st else why, "-", "-"])
    for op, what in KV_HOTPATH:
        st, why = kv_stats(run, "cudapool", op)
        rows.append([what, "p50 %s %s, p99 %s (n=%d)" % (num(st.median), st.unit, num(st.p99), st.n) if st else why,
                     "-", "-"])
    for op, what in KV_HOST:
        st, why = kv_stats(run, "cudapool", op)
        rows.append([what + ", Go", "%s GB/s (median / p10 / min of %d)" % (st.cells(), st.n) if st else why, "-", "-"])
    for L in KV_LENGTHS:
        rows.append(["time to first token, %s-token prompt: matched vs computed" % num(L)] +
                     list(kv_pair(run, "ttft/matched/%d" % L, "ttft/computed/%d" % L, "ms")))
    for L in KV_LENGTHS:
        rows.append(["decode tokens/s, %s-token prompt: pool pages vs transformers' generate (DynamicCache)" % num(L)] +
                     list(kv_pair(run, "decode/pool/%d" % L, "decode/transformers/%d" % L, "tok/s")))
    rows.append(["KV bytes of the replicas: with the pool (prompts once, own suffix pages) vs N private copies"] +
                list(kv_pair(run, "kv-bytes/pool", "kv-bytes/private", "GiB", GIB)))
    rows.append(["the prompts' KV the owner holds sealed vs one copy of it"] +
                list(kv_pair(run, "kv-bytes/sealed", "kv-bytes/one-copy", "GiB", GIB)))
    counts = [kv_stats(run, "replicas", "pages/" + k)[0] for k in ("matched", "sealed", "evicted")]
    rows.append(["the owner's pages matched / sealed / evicted",
                 " / ".join("%d" % c.median if c else "-" for c in counts) if any(counts)
                 else kv_stats(run, "replicas", "pages/matched")[1], "-", "-"])
    st, why = kv_stats(run, "cudapool", "kv/restart")
    rows.append(["page server SIGKILLed and restarted over its keeper: all %d replicas reattached and matching all "
                 "2,048 pages (32,768 tokens), ms from its start, Go" % 3,
                 "p50 %s ms, p99 %s ms (n=%d restarts)" % (num(st.median), num(st.p99), st.n) if st else why, "-", "-"])
    rows.append(["greedy tokens of every request equal to the reference run's",
                 run.meta.get("replicas-greedy", kv_stats(run, "replicas", "greedy")[1]),
                 run.meta.get("replicas-checks", "-"), "-"])
    return head, rows


def kv_targets(run):
    """Issues 18's, 24's and 30's targets: (target, the figure of this run, verdict)."""
    out = []

    def judge(name, value, ok, figure, why):
        if value is None:
            out.append((name, why, FAILED if why.startswith("FAIL") else NO_LINES))
        else:
            out.append((name, figure, MET if ok(value) else MISSED))

    for impl, lang, bar in (("cudapool", "Go", 100), ("python", "Python", 150)):
        st, why = kv_stats(run, impl, "kv/match512")
        fig = "p50 %s us, p99 %s us (n=%d)" % (num(st.median), num(st.p99), st.n) if st else ""
        judge("KV match + lease of 512 pages from %s, p50 at most %d us (issue 18)" % (lang, bar),
              st and st.median, lambda x, bar=bar: x <= bar, fig, why)
        judge("KV match + lease of 512 pages from %s, p99 at most 500 us (issue 18)" % lang,
              st and st.p99, lambda x: x <= 500, fig, why)
    slab, why_s = kv_stats(run, "cudapool", "kv/slab")
    dial, why_d = kv_stats(run, "cudapool", "kv/dial")
    big = slab is not None and slab.median >= 100 * GIB
    judge("one GPU's slab of at least 100 GiB mapped by 3 replicas, each dial at most 1 s (issue 24)",
          dial and slab and (slab.median, dial.n, dial.max),
          lambda x: x[0] >= 100 * GIB and x[1] >= 3 and x[2] <= 1000,
          "%s GiB mapped by %d replica processes, dial median %s ms, max %s ms" % (
              num(slab.median / GIB), dial.n, num(dial.median), num(dial.max)) if dial and slab else "",
          why_d or why_s)
    judge("a replica dials a slab of at least 100 GiB, all of it mapped, in at most 200 ms from Go (issue 30)",
          dial and slab and (slab.median, dial.max), lambda x: x[0] >= 100 * GIB and x[1] <= 200,
          "the slowest of %d dials %s ms on %s GiB" % (dial.n, num(dial.max), num(slab.median / GIB))
          if dial and slab else "", why_d or why_s)
    pydial, why_p = kv_stats(run, "replicas", "dial")
    pyslab = replicas_slab_gib(run)
    judge("a replica dials a slab of at least 100 GiB, all of it mapped, in at most 400 ms from Python (issue 30)",
          pydial and (pyslab, pydial.max), lambda x: x[0] is not None and x[0] >= 100 and x[1] <= 400,
          "the slowest of %d dials %s ms on %s" % (pydial.n, num(pydial.max), run.meta.get("replicas-slab", "a slab of "
                                                   "unknown size (no meta replicas-slab line)")) if pydial else "",
          why_p)
    st, why = kv_stats(run, "cudapool", "kv/grow")
    judge("the slab's growth by one chunk visible in every idle replica at most 1 ms after the owner mapped it, p50, Go "
          "(issue 30)", st and st.median, lambda x: x <= 1000,
          "p50 %s us, p99 %s us (n=%d chunks)" % (num(st.median), num(st.p99), st.n) if st else "", why)
    st, why = kv_stats(run, "cudapool", "kv/match512")
    judge("KV match + lease of 512 pages from Go, p50 at most 100 us on the 100 GiB slab (issue 24)",
          st and slab and (st.median, big), lambda x: x[1] and x[0] <= 100,
          "p50 %s us on %s GiB" % (num(st.median), num(slab.median / GIB)) if st and slab else "", why or why_s)
    for b in KV_BATCHES:
        st, why = kv_stats(run, "cudapool", "kv/pages/b%d" % b)
        bar = 300000 if b == 16 else 1000000
        judge("KV pages/s through alloc + seal + match + release, batch %d, 4 replicas, at least %s (issue %s)" % (
            b, num(bar), "25" if b == 16 else "18"), st and st.median, lambda x, bar=bar: x >= bar,
              "%s pages/s (median of %d windows)" % (num(st.median), st.n) if st else "", why)
    for op, name, most in KV_HOTPATH_TARGETS:
        st, why = kv_stats(run, "cudapool", op)
        judge(name + " (issue 25)", st and st.median, lambda x, most=most: x <= most,
              "p50 %s (n=%d)" % (num(st.median), st.n) if st else "", why)

    for op, what in (("kv/host/restore32k", "restore of a 32,768-token prompt from the host tier (2,048 pages, "
                                            "1 GiB), bytes checked"),
                     ("kv/host/spill", "spill to the host tier")):
        st, why = kv_stats(run, "cudapool", op)
        judge("%s at least 45 GB/s (issue 24)" % what, st and st.median, lambda x: x >= 45,
              "%s GB/s (median of %d)" % (num(st.median), st.n) if st else "", why)

    def pair(op, ref_op):
        a, why = kv_stats(run, "replicas", op)
        b, why_b = kv_stats(run, "replicas", ref_op)
        return (ratio(a.median, b.median) if a and b else None), a, b, why or why_b

    r8, m8, c8, _ = pair("ttft/matched/8192", "ttft/computed/8192")
    r, m, c, why = pair("ttft/matched/32768", "ttft/computed/32768")
    judge("time to first token of a matched 32,768-token prompt at most 10% of computing it (issue 18)", r,
          lambda x: x <= 0.10, "%.1f%% (%s ms vs %s ms); at 8,192 tokens %s" % (
              100 * r, num(m.median), num(c.median), "%.1f%% (%s ms vs %s ms)" % (
                  100 * r8, num(m8.median), num(c8.median)) if r8 else "not measured") if r else "", why)
    for L in KV_LENGTHS:
        r, p, q, why = pair("decode/pool/%d" % L, "decode/transformers/%d" % L)
        judge("decode tokens/s over pool pages at least transformers' own generate (DynamicCache), %s tokens "
              "(issues 18, 26)" % num(L), r, lambda x: x >= 1.0, "%.1f%% (%s vs %s tok/s)" % (100 * r, num(p.median), num(q.median)) if r else "",
              why)
    r, sealed, one, why = pair("kv-bytes/sealed", "kv-bytes/one-copy")
    pool, _ = kv_stats(run, "replicas", "kv-bytes/pool")
    private, _ = kv_stats(run, "replicas", "kv-bytes/private")
    judge("the shared prompts' KV held once, whatever N: the pool's sealed bytes are one copy (issue 18)", r,
          lambda x: close(x, 1.0), "%.2f GiB sealed vs %.2f GiB one copy; %s" % (
              sealed.median / GIB, one.median / GIB, "the replicas hold %.2f GiB with the pool vs %.2f GiB in "
              "private copies" % (pool.median / GIB, private.median / GIB) if pool and private else "") if r else "",
          why)
    st, why = kv_stats(run, "cudapool", "kv/restart")
    judge("page server SIGKILLed and restarted: every replica reattached and matching all 2,048 pages of the "
          "32k prompt within 1 s of the restart (issue 24)", st and st.median, lambda x: x <= 1000,
          "%s ms (median of %d restarts, 3 replicas)" % (num(st.median), st.n) if st else "", why)
    g = run.meta.get("replicas-greedy")
    judge("every request's greedy tokens equal the reference run's (issue 18)", g, lambda x: x.startswith("all "),
          g, kv_stats(run, "replicas", "greedy")[1])
    return out


# ---- Stock transformers models over the pool (examples/hf/check.py, issue 26).

HF_ARCHS = (("llama", "Llama 0.85B"), ("qwen3", "Qwen3-like 1.1B"))
HF_LENGTHS = (1024, 4096, 8192, 16384, 32768)
HF_CHECKED = (8192, 32768)  # the lengths checked against transformers' generate
# transformers' own decoding paths, as check.py's ops name them
HF_PATHS = (("dynamic", "DynamicCache, sdpa"), ("static", "StaticCache, sdpa"),
            ("static-compiled", "StaticCache + torch.compile"))


def hf_fastest(run, arch, L):
    """transformers' fastest own decoding path for arch at L in this run: (Stats, its
    name, a text of every path measured), or (None, why, "")."""
    got = [(run.stats("hf", "decode/transformers/%s/%d/%s" % (arch, L, op)), name) for op, name in HF_PATHS]
    got = [(st, name) for st, name in got if st]
    if not got:
        return None, kv_stats(run, "hf", "decode/transformers/%s/%d/dynamic" % (arch, L))[1], ""
    best = max(got, key=lambda x: x[0].median)
    return best[0], best[1], "; ".join("%s %s" % (name, num(st.median)) for st, name in got)


def hf_pair(run, op, ref_op, unit):
    a, why_a = kv_stats(run, "hf", op)
    b, why_b = kv_stats(run, "hf", ref_op)
    r = ratio(a.median, b.median) if a and b else None
    return ("%s %s" % (num(a.median), unit) if a else why_a, "%s %s" % (num(b.median), unit) if b else why_b,
            "-" if r is None else "%.1f%%" % (100 * r))


def hf_greedy(run, arch, L):
    """(free-running tokens equal to transformers', "K of N steps" fed its tokens), or None."""
    eq, _ = kv_stats(run, "hf", "greedy-equal/%s/%d" % (arch, L))
    steps, _ = kv_stats(run, "hf", "argmax-equal/%s/%d" % (arch, L))
    if not eq or not steps:
        return None
    n = run.meta.get("hf-new")
    return eq.median == 1, "%d%s" % (steps.median, " of " + n if n else "")


def hf_rows(run):
    head = ["row", "figure", "against (same run)", "ratio"]
    rows = []
    for arch, name in HF_ARCHS:
        for L in HF_LENGTHS:
            if run.stats("hf", "ttft/matched/%s/%d" % (arch, L)) or L == 32768:
                rows.append(["%s: time to first token, %s-token prompt: matched vs computed" % (name, num(L))] +
                            list(hf_pair(run, "ttft/matched/%s/%d" % (arch, L), "ttft/computed/%s/%d" % (arch, L),
                                         "ms")))
        for L in HF_CHECKED:
            pool, why = kv_stats(run, "hf", "decode/pool/%s/%d" % (arch, L))
            best, best_name, every = hf_fastest(run, arch, L)
            r = ratio(pool.median, best.median) if pool and best else None
            rows.append(["%s: decode tokens/s, %s-token prompt: pool pages vs transformers' fastest own path (%s)"
                         % (name, num(L), best_name if best else "-"),
                         "%s tok/s" % num(pool.median) if pool else why, every or best_name,
                         "-" if r is None else "%.1f%%" % (100 * r)])
        for L in HF_CHECKED:
            g = hf_greedy(run, arch, L)
            rows.append(["%s: greedy tokens, %s-token prompt, against transformers' generate (DynamicCache)"
                         % (name, num(L)),
                         ("equal" if g[0] else "differ") if g else "not run (no line in the raw files)",
                         "fed its tokens, argmax equal at %s steps, the others near-ties" % g[1] if g else "-", "-"])
    if rows and "hf-checks" in run.meta:
        rows.append(["examples/hf/check.py's checks", run.meta["hf-checks"], "-", "-"])
    return head, rows


def hf_targets(run):
    """Issue 26's targets: (target, the figure of this run, verdict)."""
    out = []
    for arch, name in HF_ARCHS:
        m, why = kv_stats(run, "hf", "ttft/matched/%s/32768" % arch)
        c, why_c = kv_stats(run, "hf", "ttft/computed/%s/32768" % arch)
        r = ratio(m.median, c.median) if m and c else None
        if r is None:
            out.append(("%s: TTFT of a matched 32,768-token prompt at most 5%% of computing it (issue 26)" % name,
                        why or why_c, FAILED if (why or why_c).startswith("FAIL") else NO_LINES))
        else:
            out.append(("%s: TTFT of a matched 32,768-token prompt at most 5%% of computing it (issue 26)" % name,
                        "%.1f%% (%s ms vs %s ms)" % (100 * r, num(m.median), num(c.median)),
                        MET if r <= 0.05 else MISSED))
        pool, why = kv_stats(run, "hf", "decode/pool/%s/32768" % arch)
        best, best_name, every = hf_fastest(run, arch, 32768)
        target = "%s: decode tokens/s over pool pages at 32k at least transformers' fastest own path (issue 26)" % name
        if pool and best:
            r = pool.median / best.median
            out.append((target, "%.1f%% (%s vs %s tok/s, %s; measured: %s)" % (
                100 * r, num(pool.median), num(best.median), best_name, every), MET if r >= 1.0 else MISSED))
        else:
            why = why if not pool else best_name
            out.append((target, why, FAILED if why.startswith("FAIL") else NO_LINES))
    got = [(arch, L, hf_greedy(run, arch, L)) for arch, _ in HF_ARCHS for L in HF_CHECKED]
    target = "greedy tokens equal to transformers' generate, both architectures, 8k and 32k (issue 26)"
    if all(g for _, _, g in got):
        out.append((target, "equal in %d of %d; fed transformers' tokens, argmax equal at %s steps (%s), the others "
                    "near-ties; %s" % (sum(1 for _, _, g in got if g[0]), len(got),
                                       ", ".join(g[1] for _, _, g in got),
                                       ", ".join("%s %s" % (a, num(L)) for a, L, _ in got),
                                       run.meta.get("hf-checks", "")),
                    MET if all(g[0] for _, _, g in got) else MISSED))
    else:
        out.append((target, kv_stats(run, "hf", "greedy-equal/llama/8192")[1], NO_LINES))
    return out


# ---- Targets.

MET, MISSED, NOT_RUN, FAILED, NO_PAIR = "met", "MISSED", "NOT RUN (feature absent)", "FAIL (not measured)", "NO FAIR PAIR"
NEEDS_GPUS = "NOT RUN (too few GPUs)"
NO_LINES = "NOT RUN (no lines)"


def targets(run):
    """Each target of issues 6, 10 and 11: (target, the fair pair and figure, verdict)."""
    out = []

    def judge(name, value, ok, figure, absent_key=None):
        if value is None:
            if absent_key and absent_key in run.absent:
                out.append((name, run.absent[absent_key], NOT_RUN))
            elif absent_key and absent_key in run.needs:
                out.append((name, "needs %d GPUs" % run.needs[absent_key], NEEDS_GPUS))
            else:
                out.append((name, figure or "not measured", FAILED))
        else:
            out.append((name, figure, MET if ok(value) else MISSED))

    bars = {"ipc": (1.3, "issue 6"), "local": (1.3, "issue 6's bar, local pool"), "hit": (1.0, "issue 11"),
            "miss": (1.3, "issue 11")}
    for op in ALLOC_OPS:
        kind = op.split("/")[1]
        g = AllocRow(run, op, "cudapool", "api")
        gf, cf, state, n = g.fair()
        bad_bytes = len(set(run.bytes.get(op, {}).values())) > 1
        r = ratio(gf, cf) if n and not bad_bytes else None
        figure = ("%s x C (%s us vs %s us, %s state, %d batch pairs)" % (rtext(r), num(gf), num(cf), state, n)
                  if r else "bytes differ between columns" if bad_bytes else "")
        bar, source = bars[kind]
        judge("alloc+free, %s, at most %.1fx C (%s)" % (alloc_label(op), bar, source), r,
              lambda x, bar=bar: x <= bar, figure)
        if kind == "ipc":
            core = AllocRow(run, op, "cudacore", "api")
            kf, kc, kstate, kn = core.fair()
            r2 = ratio(kf, gf) if kn and n and state == kstate else None
            judge("alloc+free, %s, 2.5x faster than cuda.core (issue 6)" % alloc_label(op), r2, lambda x: x >= 2.5,
                  "%s x faster (%s us vs %s us, %s state)" % (rtext(r2), num(gf), num(kf), state) if r2 else "")
    g, c = run.stats("cudart", "import/pair"), run.stats("c", "import/pair")
    r = ratio(g.median, c.median) if g and c and g.n == c.n else None
    judge("import within 1.5x C, both the bare binding, same N and statistic (issue 6)", r, lambda x: x <= 1.5,
          "%s x C (%s us vs %s us, median of %d batches each)" % (rtext(r), num(g.median), num(c.median), g.n)
          if r else ("different N: %d and %d" % (g.n, c.n) if g and c else ""))
    out.append(("import faster than cuda.core (issue 6)",
                "cuda.core's figure is its API (Buffer.from_ipc_descriptor + close); cudapool has no import-only "
                "API call to set beside it, and its binding is a lower layer", NO_PAIR))
    o = run.stats("cudapool", "open/exported")
    fig = "p50 %s us, mean %s, p99 %s, max %s" % (num(o.median), num(o.mean), num(o.p99), num(o.max)) if o else ""
    judge("open of an exported buffer, p50 under 30 us (issue 6)", o and o.median, lambda x: x < 30, fig)
    judge("open of an exported buffer, p50 at most 25 us (issue 11)", o and o.median, lambda x: x <= 25, fig)
    g, c = run.stats("cudapool", "release"), run.stats("c", "release")
    r = ratio(g.median, c.median) if g and c else None
    judge("release round trip at most 1.0x C, same protocol (issue 11)", r, lambda x: x <= 1.0,
          "%s x C (%s us vs %s us)" % (rtext(r), num(g.median), num(c.median)) if r else "")
    rec, c, core = run.stats("cudapool", "sustained/4/recycled"), run.stats("c", "sustained/4"), \
        run.stats("cudacore", "sustained/4")
    r = ratio(rec.median, c.median) if rec and c else None
    judge("sustained recycled shares/s at least 2x C's per-buffer path (issue 11)", r, lambda x: x >= 2,
          "%s x C" % rtext(r) if r else "", ("cudapool", "sustained/4/recycled"))
    r = ratio(rec.median, core.median) if rec and core else None
    judge("sustained recycled shares/s at least 1.5x cuda.core, which orders nothing (issue 11)", r,
          lambda x: x >= 1.5, "%s x cuda.core" % rtext(r) if r else "", ("cudapool", "sustained/4/recycled"))
    b = run.stats("cudapool", "block/64KiB/b64")
    judge("block shares/s, 64 KiB, batch 64, 4 consumers, at least 250,000/s (issue 11)", b and b.median,
          lambda x: x >= 250000, "%s/s" % num(b.median) if b else "", ("cudapool", "block/64KiB/b64"))
    g, c = run.stats("cudapool", "read/other-gpu"), run.stats("c", "read/other-gpu")
    r = ratio(g.median, c.median) if g and c else None
    judge("other-GPU read at least 95% of C (issue 6)", r, lambda x: x >= 0.95,
          "%.1f%% of C" % (100 * r) if r else "", ("cudapool", "read/other-gpu"))
    t, a = run.stats("torch", "alloc/1MiB/cudapool"), run.stats("torch", "alloc/1MiB/cudaMallocAsync")
    r = ratio(t.median, a.median) if t and a else None
    judge("torch alloc+free 1 MiB through cudapool within 1.5x backend:cudaMallocAsync (issue 10)", r,
          lambda x: x <= 1.5, "%s x (%s us vs %s us)" % (rtext(r), num(t.median), num(a.median)) if r else "",
          ("torch", "alloc/1MiB/cudapool"))
    p, g = run.stats("python", "open+release/exported"), run.stats("cudapool", "open+release/exported")
    r = ratio(p.median, g.median) if p and g else None
    judge("Python open+release within 1.5x Go (issue 10)", r, lambda x: x <= 1.5,
          "%s x Go (%s us vs %s us)" % (rtext(r), num(p.median), num(g.median)) if r else "",
          ("python", "open+release/exported"))
    m, own = run.stats("torch", "read/mapping"), run.stats("torch", "read/own")
    r = ratio(m.median, own.median) if m and own else None
    judge("torch read of a mapping at least 95% of its own memory (issue 10)", r, lambda x: x >= 0.95,
          "%.1f%%" % (100 * r) if r else "", ("torch", "read/mapping"))
    out += kv_targets(run)
    out += hf_targets(run)
    return ["target", "the fair pair in this run", "verdict"], out


# ---- Output.

def text_table(head, rows):
    rows = [[str(x) for x in r] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = "  ".join("%%-%ds" % w for w in widths)
    return "\n".join([fmt % tuple(head)] + [fmt % tuple(r) for r in rows])


def md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


SECTIONS = (
    ("Allocation pairs: the ring (same CPU, batch by batch)", alloc_rows,
     "Each column allocates the bytes in brackets, from a new pool of the row's kind (an exportable pool rounds "
     "to the granularity in every column; a local pool does not round). C, Go and cuda.core ran as one process "
     "each, pinned to one CPU, taking turns one batch each (fresh processes each round, the order rotated), with "
     "nothing else of the suite running. Times are us per pair, per batch. A batch's state is that of the C batch "
     "beside it: C's batches split into a fast and a slow cluster (or one state); 'vs C fast' sets the column's "
     "fast-state batches against C's fast batches, the verdicts' figure. 'state agrees' is how often the column's "
     "own clusters match its C neighbour's state (the state is the CPU's, not the process's). cudart is the bare "
     "binding on the same pool: the pool's own bookkeeping is the difference to cudapool. C runs its pair "
     "twice per entry, in the api slot (the C batches cudapool and cuda.core are set against, the same C run "
     "for both) and in the binding slot (those cudart is set against). 'cache hit' rows: "
     "cudapool's pool with WithCache, every Alloc after the first served by the cache (the suite checks the "
     "pool's hit count); 'cache miss' rows: the cache on but too small for any buffer, every Alloc going to "
     "the driver past it. C and cuda.core have no cache: in those rows they run their plain pair on an "
     "exportable pool, the pair issue 11 compares with."),
    ("Sharing: cudapool and C, same protocol", sharing_rows,
     "C's consumers follow cudapool's protocol call for call (bench/cref says which calls). Latencies are "
     "median / mean / p99 / max in us; rates median / p10 / min. The import pair is the bare binding in both "
     "columns (Go's cudart, C's runtime), 15 batches of 1000 buffers each. Ratios are cudapool over C: below 1 "
     "is faster for times, above 1 for rates."),
    ("Other routes and libraries (other protocols: for orientation, no verdicts)", other_rows,
     DIFFERS["legacy"] + ". " + DIFFERS["cudacore"] + ". Figures as above."),
    ("Sustained windows", window_rows,
     "One line per 300 ms window: the consumers' shares, the Opens that took 1 ms or more and their time, how "
     "often the consumers went round the names they cycle through (64 buffers; the slab's blocks), and (C) how "
     "often an Open had to wait for this process's earlier free of the same record, and for how long."),
    ("Issues 10 and 11", feature_rows, ""),
    ("KV page pool (issue 18)", kv_rows,
     "Go: bin/gpu/gosuite -kv-bytes SIZE kv, an owner in its process and 4 replica processes on GPU 0 "
     "(llama-0.85b pages of 16 tokens), its slab of SIZE (100 GiB in the suite) a region of addresses per tensor, chunks "
     "mapped into them, each replica's dial (every chunk of the whole slab mapped) timed in its process; Python: bench/kvbench.py, cudapool.kv against a kvpoold of its own. "
     "The host tier rows: bin/gpu/gosuite kvtier, an owner with a host tier and one replica process; each cycle a "
     "2,048-page prompt (1 GiB) is sealed, evicted by an alloc of the whole slab and matched again, every restored "
     "byte checked; restore is its bytes over the Match, spill the bytes copied to the host tier over those "
     "copies' time. The match rows time the "
     "Match alone (the read lease included, its release untimed). The rates are the 4 replicas' pages per "
     "second together, one window per sample, each batch with hashes of its own. The model rows come from "
     "examples/replicas/run.py --raw (scripts/gpu-examples.sh): a 0.85B Llama, N replica processes a GPU and "
     "kvpoold; computed TTFT is the first replica's prefill and every reference run's, matched TTFT the other "
     "replicas'; decode is the same replica over pool pages (cudapool.hf: a CUDA graph a step, Triton paged "
     "kernel) and through transformers' own generate (DynamicCache, SDPA)."),
    ("Stock transformers models over the pool (issue 26)", hf_rows,
     "examples/hf/check.py (scripts/gpu-examples.sh): transformers' own LlamaForCausalLM and Qwen3ForCausalLM "
     "built from configs with seeded random weights, each over a kvpoold of its geometry, generating through "
     "cudapool.hf (a CUDA graph a decode step and one for a prompt's last page over matched pages, the Triton "
     "paged kernel). Computed TTFT is the first request of a prompt (prefill and seal), matched TTFT the "
     "second's. transformers' own paths: generate with its DynamicCache, with a StaticCache (eager) and, where "
     "run, a StaticCache with generate's torch.compile. Greedy tokens: free-running against transformers' "
     "generate, and the pool fed transformers' tokens step by step; a near-tie is a step where transformers' "
     "own logits of the two tokens are within the bf16 tolerance (5% of the largest logit) or within its "
     "generate's difference from its own forward, whichever is larger."),
)


def markdown(run, notes):
    m = run.meta
    out = ["# Performance", "",
           "Measured %s on %s, driver %s, CUDA runtime %s; cuda.core %s; torch %s; %s; commit %s. Every figure "
           "below comes from that one run of scripts/bench-suite.sh on that one host, so the ratios compare like "
           "with like; absolute times drift between runs." % (
               m.get("date", "?"), m.get("gpu", "?"), m.get("driver", "?"), m.get("cuda", "?"),
               m.get("cudacore", "?"), m.get("torch", "?"), m.get("go", "Go ?"), m.get("commit", "?")), ""]
    if "replicas-run" in m:
        out += ["The KV page pool's model rows come from one run of examples/replicas/run.py "
                "(scripts/gpu-examples.sh) on the same build: %s." % m["replicas-run"], ""]
    if "hf-run" in m:
        out += ["The rows of stock transformers models over the pool come from one run of examples/hf/check.py "
                "(scripts/gpu-examples.sh): %s." % m["hf-run"], ""]
    head, rows = targets(run)
    out += ["## Targets", "", "Each verdict comes from the fair pair beside it, taken in this run; the tables "
            "below give every figure, and the notes what each column does.", "", md_table(head, rows), ""]
    for title, rows_of, text in SECTIONS:
        head, rows = rows_of(run)
        if not rows:
            continue
        out += ["## " + title, ""] + ([text, ""] if text else []) + [md_table(head, rows), ""]
    fl = failures(run)
    if fl or run.problems:
        out += ["## What failed in this run", ""] + ["- " + f for f in fl + run.problems] + [""]
    if notes.strip():
        out += ["## Notes", "", notes.strip(), ""]
    out += ["## Reproducing", "",
            "    scripts/build-gpu.sh                          # where Go is: test binaries, commands, libcudapool",
            "    OUT=/tmp/out bash scripts/gpu-run.sh          # on the GPU host: the GPU tests, then the suite",
            "    OUT=/tmp/out bash scripts/gpu-examples.sh     # on the GPU host: the examples, the replicas' lines",
            "    python3 bench/table.py /tmp/out/bench-raw.txt /tmp/out/replicas-raw.txt /tmp/out/hf-raw.txt \\",
            "        --md bench/RESULTS.md --notes bench/NOTES.md",
            "",
            "The suite prints these tables last and writes every sample to bench-raw.txt and these tables to "
            "RESULTS.md in $OUT; examples/replicas/run.py --raw writes replicas-raw.txt there, examples/hf/check.py "
            "--raw hf-raw.txt.", ""]
    return "\n".join(out)


def failures(run):
    return ["%s %s: %s" % (impl, op, why[:200]) for (impl, op), why in sorted(run.fails.items())]


def main(argv):
    raws, opts = [], {"--md": None, "--notes": None}
    it = iter(argv)
    for arg in it:
        if arg in opts:
            opts[arg] = next(it, None)
            if opts[arg] is None:
                print("%s needs a file" % arg, file=sys.stderr)
                return 2
        elif arg.startswith("-"):
            print("unknown option %s\n%s" % (arg, __doc__.strip().splitlines()[-1]), file=sys.stderr)
            return 2
        else:
            raws.append(arg)
    if not raws:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    lines = []
    for path in raws:
        with open(path) as f:
            lines += f.read().splitlines()
    run = Run(lines)
    for p in run.problems:
        print("PROBLEM: " + p)
    for title, rows_of, _ in SECTIONS:
        head, rows = rows_of(run)
        if rows:
            print("\n== " + title)
            print(text_table(head, rows))
    fl = failures(run)
    if fl:
        print("\nfailed:")
        for f in fl:
            print("  " + f)
    head, rows = targets(run)
    print("\n== Targets")
    print(text_table(head, rows))
    if run.problems:
        print("\n%d problems in the raw file (PROBLEM lines above): the tables are not to be trusted" %
              len(run.problems))
    text = ""
    if opts["--notes"]:
        with open(opts["--notes"]) as f:
            text = f.read()
    if opts["--md"]:
        with open(opts["--md"], "w") as f:
            f.write(markdown(run, text))
    return 1 if run.problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
