"""The suite's line format, shared by bench/cudacore.py and bench/torchbench.py
(bench/table.py reads it): a measurement's summary and its samples."""


def summarize(impl, op, unit, v):
    """Prints "result IMPL OP UNIT MEDIAN P90 N" and "raw IMPL OP UNIT V...", or a fail
    line when there are no samples."""
    if not v:
        print("fail %s %s no samples" % (impl, op), flush=True)
        return
    v = sorted(v)
    p90 = v[int(0.9 * (len(v) - 1) + 0.5)]
    print("result %s %s %s %.4f %.4f %d" % (impl, op, unit, v[len(v) // 2], p90, len(v)))
    print("raw %s %s %s %s" % (impl, op, unit, " ".join("%.4f" % x for x in v)), flush=True)
