"""The suite's line format, shared by bench/cudacore.py and bench/torchbench.py
(bench/table.py reads it): a measurement's summary and its samples."""


def lines(impl, op, unit, v):
    """The lines "result IMPL OP UNIT MEDIAN P90 N" and "raw IMPL OP UNIT V...", or a
    fail line when there are no samples."""
    if not v:
        return ["fail %s %s no samples" % (impl, op)]
    v = sorted(v)
    p90 = v[int(0.9 * (len(v) - 1) + 0.5)]
    return ["result %s %s %s %.4f %.4f %d" % (impl, op, unit, v[len(v) // 2], p90, len(v)),
            "raw %s %s %s %s" % (impl, op, unit, " ".join("%.4f" % x for x in v))]


def summarize(impl, op, unit, v):
    """Prints lines(impl, op, unit, v)."""
    print("\n".join(lines(impl, op, unit, v)), flush=True)
