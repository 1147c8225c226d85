"""Turns one run of cudapool's benchmark suite into its table.

Reads the lines that bench/cref, bench/gosuite, bench/cudacore.py and
scripts/bench-suite.sh print into one file:

    result IMPL OP UNIT MEDIAN P90 N
    fail IMPL OP REASON...
    meta KEY VALUE...

(raw lines and anything else are skipped), prints the table of the operations
with cudapool's ratio to each other column, the allocation variants and the
targets of issue 6, and with --md writes the same as a Markdown section for the
README (bench/RESULTS.md), with the text of --notes (what a person found out
about the run: why a target was missed) under its own heading.

Usage: python3 bench/table.py RESULTS [--md FILE [--notes FILE]]
"""

import sys

IMPLS = ("cudapool", "c", "legacy", "cudacore")
HEADS = ("cudapool", "C", "legacy IPC", "cuda.core")
OPS = (
    ("alloc/1KiB", "allocate+free pair, 1 KiB"),
    ("alloc/1MiB", "allocate+free pair, 1 MiB"),
    ("alloc/64MiB", "allocate+free pair, 64 MiB"),
    ("export/fresh", "export of a fresh buffer"),
    ("import/pair", "import+free pair (binding)"),
    ("open/first", "open end to end, first time"),
    ("open/exported", "open end to end, already exported"),
    ("release", "release round trip"),
    ("fanout/1", "fan-out to 1 consumer"),
    ("fanout/2", "fan-out to 2 consumers"),
    ("fanout/4", "fan-out to 4 consumers"),
    ("fanout/7", "fan-out to 7 consumers"),
    ("sustained/4", "sustained shares, 1 producer, 4 consumers"),
    ("read/same-gpu", "read of an imported buffer, same GPU"),
    ("read/other-gpu", "read of an imported buffer, other GPU"),
    ("copy/same-gpu", "plain device copy, same GPU"),
    ("copy/other-gpu", "plain device copy, other GPU"),
)
RATES = ("GB/s", "shares/s")
# The parts of scripts/bench-suite.sh and the columns they fill.
PARTS = {"cref": ("c", "legacy"), "gosuite": ("cudapool",), "cudacore": ("cudacore",)}


def version(v):
    """CUDA's integer version (13000) as 13.0."""
    try:
        v = int(v)
    except ValueError:
        return v
    return "%d.%d" % (v // 1000, v % 1000 // 10)


class Run:
    def __init__(self, lines):
        self.results, self.fails, self.meta = {}, {}, {}
        for line in lines:
            f = line.split()
            if len(f) == 7 and f[0] == "result":
                try:
                    self.results[(f[1], f[2])] = (f[3], float(f[4]), float(f[5]), int(f[6]))
                except ValueError:
                    continue
            elif len(f) > 4 and f[0] == "raw" and f[3] in RATES and (f[1], f[2]) in self.results:
                # For a rate the slow tail is the low one: beside the median goes the
                # 10th percentile, not the 90th.
                try:
                    v = sorted(float(x) for x in f[4:])
                except ValueError:
                    continue
                unit, median, _, n = self.results[(f[1], f[2])]
                self.results[(f[1], f[2])] = (unit, median, v[int(0.1 * (len(v) - 1) + 0.5)], n)
            elif len(f) == 5 and f[:2] == ["cref", "runtime"] and f[3] == "driver":
                self.meta.setdefault("cuda", "%s (driver API %s)" % (version(f[2]), version(f[4])))
            elif len(f) >= 3 and f[0] == "fail":
                self.fails[(f[1], f[2])] = " ".join(f[3:])
            elif len(f) >= 2 and f[0] == "meta":
                self.meta[f[1]] = " ".join(f[2:])

    def get(self, impl, op):
        return self.results.get((impl, op))

    def failed(self, impl, op):
        """Whether impl's op failed: itself, all of impl, or the suite's part that runs it."""
        if any((impl, o) in self.fails for o in (op, "all", "sharing")):
            return True
        parts = [p for p, impls in PARTS.items() if impl in impls]
        if impl == "cudapool" and op == "import/pair":
            parts = ["cudart-bench"]
        return any(("suite", p) in self.fails for p in parts)

    def cell(self, impl, op):
        r = self.get(impl, op)
        if r:
            return "%s (%s)" % (num(r[1]), num(r[2]))
        return "FAIL" if self.failed(impl, op) else "-"

    def ratio(self, impl, op):
        a, b = self.get("cudapool", op), self.get(impl, op)
        if not a or not b or b[1] == 0:
            return "-"
        return "%.2f" % (a[1] / b[1])


def num(x):
    if x >= 1000:
        return "%.0f" % x
    if x >= 100:
        return "%.1f" % x
    return "%.2f" % x


def unit_of(run, op):
    for impl in IMPLS:
        r = run.get(impl, op)
        if r:
            return r[0]
    return "GB/s" if op.startswith(("read", "copy")) else "shares/s" if op.startswith("sustained") else "us"


def main_rows(run):
    rows = []
    for op, what in OPS:
        row = [what, unit_of(run, op)] + [run.cell(i, op) for i in IMPLS]
        row += [run.ratio(i, op) for i in IMPLS[1:]]
        rows.append(row)
    return rows


MAIN_HEAD = ["operation", "unit"] + list(HEADS) + ["vs C", "vs legacy", "vs cuda.core"]


def variant_rows(run):
    """One row per variant run and size: cudapool, cudart and C under that pinning."""
    labels = []
    for impl, op in run.results:
        if op.startswith("variant/"):
            label = op.split("/")[1]
            if label not in labels:
                labels.append(label)
    rows = []
    for label in labels:
        for size in ("1KiB", "1MiB", "64MiB"):
            op = "variant/%s/alloc/%s" % (label, size)
            cells = [run.get(i, op) for i in ("cudapool", "cudart", "c")]
            if not any(cells):
                continue
            row = [label, size] + ["%s (%s)" % (num(c[1]), num(c[2])) if c else "-" for c in cells]
            c = cells[2]
            row += ["%.2f" % (g[1] / c[1]) if g and c else "-" for g in cells[:2]]
            rows.append(row)
    return rows


VARIANT_HEAD = ["variant", "size", "cudapool", "cudart", "C", "cudapool/C", "cudart/C"]


def targets(run):
    """Issue 6's targets, each a ratio within this run: (target, figure, verdict)."""
    out = []

    def med(impl, op):
        r = run.get(impl, op)
        return r[1] if r else None

    def check(name, value, ok, figure):
        if value is None:
            out.append((name, "not measured", "FAIL"))
        else:
            out.append((name, figure, "met" if ok else "MISSED"))

    for size in ("1KiB", "1MiB", "64MiB"):
        op = "alloc/" + size
        g, c, core = med("cudapool", op), med("c", op), med("cudacore", op)
        r = g / c if g and c else None
        check("alloc+free %s within 1.3x C" % size, r, r is not None and r <= 1.3,
              "%.2fx C" % r if r else "")
        r = core / g if g and core else None
        check("alloc+free %s 2.5x faster than cuda.core" % size, r, r is not None and r >= 2.5,
              "%.2fx faster" % r if r else "")
    g, c, core = med("cudapool", "import/pair"), med("c", "import/pair"), med("cudacore", "import/pair")
    r = g / c if g and c else None
    check("import within 1.5x C", r, r is not None and r <= 1.5, "%.2fx C" % r if r else "")
    check("import faster than cuda.core", g if core else None, g is not None and core is not None and g < core,
          "%s us vs %s us" % (num(g), num(core)) if g and core else "")
    g = med("cudapool", "open/exported")
    check("open of an exported buffer under 30 us", g, g is not None and g < 30, "%s us" % num(g) if g else "")
    g, c = med("cudapool", "read/other-gpu"), med("c", "read/other-gpu")
    r = g / c if g and c else None
    check("other-GPU read at least 95% of C", r, r is not None and r >= 0.95, "%.1f%% of C" % (100 * r) if r else "")
    return out


TARGET_HEAD = ["target", "this run", "verdict"]


def text_table(head, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = "  ".join("%%-%ds" % w for w in widths)
    return "\n".join([fmt % tuple(head)] + [fmt % tuple(r) for r in rows])


def md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def failures(run):
    return ["%s %s: %s" % (impl, op, why) for (impl, op), why in sorted(run.fails.items())]


RATIO_NOTE = ("Each cell is the median (90th percentile; for GB/s and shares/s the 10th, the slow tail). "
              "Ratios are cudapool's median over the other's: for times (us) below 1 means cudapool is faster; "
              "for GB/s and shares/s above 1 means it is.")


def markdown(run, notes=""):
    m = run.meta
    out = ["## Performance", ""]
    out.append("Measured %s on %s, driver %s, CUDA runtime %s; cuda.core %s; %s. "
               "Every figure below comes from that one run on that one host, so the ratios compare like "
               "with like; absolute times drift between runs." % (
                   m.get("date", "?"), m.get("gpu", "?"), m.get("driver", "?"), m.get("cuda", "?"),
                   m.get("cudacore", "?"), m.get("go", "Go ?")))
    out += ["", RATIO_NOTE, "",
            "cudapool is `pool` and `export` (Go, cgo binding); C is the same CUDA runtime calls from C "
            "(bench/cref); legacy IPC is cudaMalloc with cudaIpcGetMemHandle / cudaIpcOpenMemHandle / "
            "cudaIpcCloseMemHandle; cuda.core is NVIDIA's Python library (IPC-enabled DeviceMemoryResource, "
            "IPC buffer descriptors). Shared buffers are 2 MiB (cudapool's granularity) in every column. "
            "Consumers are separate processes on GPU 0 except for the other-GPU read. End-to-end times are "
            "taken in the consumer, fan-out from the producer's export to the last consumer's usable pointer "
            "(CLOCK_MONOTONIC, shared by the processes). cuda.core orders nothing between processes, so its "
            "consumers do less work than cudapool's, which wait on the producer's ready event. Copies are "
            "timed with CUDA events in C and cuda.core and on the host around a synchronize in Go (the cudart "
            "binding has no timing events).", ""]
    out += [md_table(MAIN_HEAD, main_rows(run)), ""]
    out += ["### Targets", "", md_table(TARGET_HEAD, targets(run)), ""]
    vr = variant_rows(run)
    if vr:
        out += ["### Allocation pairs under other thread and CPU settings", "",
                "The same pair loops (fresh pool, one warm-up batch, 15 batches of 10000 pairs, median and p90 "
                "of the batches) with the measuring goroutine locked to its OS thread or not, GOMAXPROCS 1 or "
                "the CPUs allowed, and the process pinned to CPUs 2-9 or to CPU 3 alone; C under the same "
                "pinning. cudart is the binding's own pair, without the pool's bookkeeping.", "",
                md_table(VARIANT_HEAD, vr), ""]
    fl = failures(run)
    if fl:
        out += ["### What failed in this run", ""] + ["- " + f for f in fl] + [""]
    if notes.strip():
        out += ["### Notes on this run", "", notes.strip(), ""]
    out += ["### Reproducing", "",
            "    scripts/build-gpu.sh                # where Go is: test binaries, commands and bench/gosuite",
            "    scripts/bench-suite.sh              # on the GPU host (needs nvcc and cuda.core there)",
            "    scripts/gpu-run.sh                  # or: the GPU tests first, then the suite",
            "",
            "The suite prints this table last, writes every sample to the raw file it names, and this "
            "section to RESULTS.md beside it (`python3 bench/table.py RAW --md FILE` makes it again from "
            "a raw file).", ""]
    return "\n".join(out)


def main(argv):
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        run = Run(f)
    md, notes = option(argv, "--md"), option(argv, "--notes")
    if md is False or notes is False:
        return 2
    print(RATIO_NOTE)
    print(text_table(MAIN_HEAD, main_rows(run)))
    vr = variant_rows(run)
    if vr:
        print()
        print(text_table(VARIANT_HEAD, [r for r in vr if r[1] == "1MiB"]))
    print()
    print(text_table(TARGET_HEAD, targets(run)))
    fl = failures(run)
    if fl:
        print()
        print("failed:")
        for f in fl:
            print("  " + f[:200])
    if md:
        text = ""
        if notes:
            with open(notes) as f:
                text = f.read()
        with open(md, "w") as f:
            f.write(markdown(run, text))
    return 0


def option(argv, name):
    """The value after name in argv: None if name is absent, False if it has none."""
    if name not in argv:
        return None
    i = argv.index(name)
    if i + 1 >= len(argv):
        print("%s needs a file" % name, file=sys.stderr)
        return False
    return argv[i + 1]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
