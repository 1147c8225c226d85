"""run.py's figures as the benchmark suite's lines (bench/suitelines.py), with no
torch, so that they are tested anywhere (test_rawlines.py). Every line is of impl
"replicas":

    result replicas OP UNIT MEDIAN P90 N   and   raw replicas OP UNIT V...
        ttft/matched/L, ttft/computed/L    time to first token, ms, of the requests
                                           that matched the L-token prompt and of
                                           those that computed it (references included)
        decode/pool/L, decode/transformers/L   decode tokens/s over pool pages
                                           (cudapool.hf) and through transformers'
                                           own generate (DynamicCache), same replica
        kv-bytes/sealed                    the bytes of the pages the owner holds sealed
        kv-bytes/one-copy                  the bytes of one copy of every prompt's KV
        kv-bytes/pool                      the KV of the N replicas with the pool: the
                                           prompts once and each request's own pages
        kv-bytes/private                   the KV of N private copies
        pages/matched, pages/sealed, pages/evicted   the owner's counts
        dial                               ms, each replica process's dial (every
                                           region of the slab reserved, its chunks
                                           mapped)
    meta replicas-run TEXT                 what ran (replicas, GPUs, lengths, attention)
    meta replicas-slab TEXT                the slab: its size, chunks, replicas
    meta replicas-greedy TEXT              how many requests' greedy tokens equal the
                                           reference's: "all N equal" or "K of N equal"
    meta replicas-checks TEXT              "all N checks passed", or how many failed
    fail replicas check/K WHAT             the K-th failed check
    fail replicas all WHAT                 the run stopped before its figures
"""

import os
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import suitelines  # noqa: E402 (after the path)

IMPL = "replicas"


def summary(op, unit, v):
    """The result and raw lines of op's samples v."""
    return suitelines.lines(IMPL, op, unit, [float(x) for x in v])


def one_line(text):
    return " ".join(str(text).split())


def slab(geometry, replicas):
    """The text of the meta replicas-slab line: the slab's size, its chunks and the
    replica processes a GPU that mapped it, from geometry, the owner's Stats geometry
    (a dict: slab_bytes, chunks, chunk_bytes), as bench/table.py reads it (its first
    two words "X GiB")."""
    return "%.1f GiB in %d chunks of %.0f MiB, mapped by %d replica processes a GPU" % (
        geometry["slab_bytes"] / (1 << 30), geometry.get("chunks", 0), geometry.get("chunk_bytes", 0) / (1 << 20),
        replicas)


def lines(fig):
    """The lines of fig, a dict of what run.py measured (each key absent where the run
    did not get that far):

        run       str: what ran
        lengths   {L: {"ttft_matched_s": [...], "ttft_computed_s": [...],
                       "decode_pool_tok_s": x, "decode_transformers_tok_s": y}}
        bytes     {"sealed", "one-copy", "pool", "private": bytes}
        pages     {"matched", "sealed", "evicted": count}
        dial_ms   [ms]: each replica process's dial
        slab      str: the slab's size, chunks and replicas
        greedy    (equal, requests): the requests whose greedy tokens equal the reference
        checks    int: how many checks ran (the greedy ones, the KV bytes, the targets, the faults)
        failures  [str]: the failed ones
        stopped   str: why the run stopped before its end (an exception), or None
    """
    out = []
    if fig.get("run"):
        out.append("meta replicas-run " + one_line(fig["run"]))
    for L, f in sorted(fig.get("lengths", {}).items()):
        if "ttft_matched_s" in f:
            out += summary("ttft/matched/%d" % L, "ms", [1e3 * x for x in f["ttft_matched_s"]])
        if "ttft_computed_s" in f:
            out += summary("ttft/computed/%d" % L, "ms", [1e3 * x for x in f["ttft_computed_s"]])
        if "decode_pool_tok_s" in f:
            out += summary("decode/pool/%d" % L, "tok/s", [f["decode_pool_tok_s"]])
        if "decode_transformers_tok_s" in f:
            out += summary("decode/transformers/%d" % L, "tok/s", [f["decode_transformers_tok_s"]])
    for k in ("sealed", "one-copy", "pool", "private"):
        if k in fig.get("bytes", {}):
            out += summary("kv-bytes/" + k, "B", [fig["bytes"][k]])
    for k in ("matched", "sealed", "evicted"):
        if k in fig.get("pages", {}):
            out += summary("pages/" + k, "pages", [fig["pages"][k]])
    if fig.get("dial_ms"):
        out += summary("dial", "ms", fig["dial_ms"])
    if fig.get("slab"):
        out.append("meta replicas-slab " + one_line(fig["slab"]))
    if "greedy" in fig:
        eq, n = fig["greedy"]
        out.append("meta replicas-greedy " + ("all %d equal" % n if eq == n else "%d of %d equal" % (eq, n)))
    failures = fig.get("failures", [])
    if "checks" in fig:
        n = fig["checks"]
        out.append("meta replicas-checks " + ("all %d checks passed" % n if not failures else
                                              "%d of %d checks FAILED" % (len(failures), n)))
    for k, what in enumerate(failures, 1):
        out.append("fail %s check/%d %s" % (IMPL, k, one_line(what)))
    if fig.get("stopped"):
        out.append("fail %s all %s" % (IMPL, one_line(fig["stopped"])))
    return out


def append(path, fig):
    """Appends fig's lines to the file at path."""
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines(fig)))
