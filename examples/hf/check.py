"""Stock transformers models over the KV page pool (cudapool.hf) against transformers'
own generate, on one GPU.

First, the decisive check: a small Llama trained here for a few seconds on the
standard library's .py files (examples/hf/decisive.py: seeded, byte tokens, trained on
8k-byte windows), whose logits decide. Per prompt length (held-out text, 1k, 2k, 4k and
8k bytes), a request computed (and sealed) and the same prompt matched by a second
request must each give greedy tokens equal to transformers' generate (DynamicCache,
sdpa), every one of --new (64); at 32k (past the positions it was trained at) the count
of leading equal tokens is reported, not required.

Then, for speed, two architectures built from configs with seeded random weights (no
downloads): the replicas example's 0.85B Llama and a Qwen3-like model with another head
dim and KV-head count. For each it starts a kvpoold of the model's geometry and checks:

1. prefill logits through the pool (from position 0: SDPA; over pages: the paged
   kernel) within bf16 tolerance of transformers' own forward;
2. the paged kernel against SDPA over K/V gathered from the pages (float32);
3. per prompt length: a request computed (and sealed), the same prompt matched by a
   second request, and the same computed alone into private pages: their greedy tokens
   and first logits equal (the same operations on the same bytes); the prompt's last
   logits within bf16 tolerance of transformers' forward. The greedy tokens against
   transformers' generate, and the pool's argmax fed transformers' tokens, are
   reported only: random weights make near-ties common, which two correct bf16 paths
   break apart (the decisive model is where tokens must be equal);
4. time to first token, computed vs matched, at 32,768 tokens at most 5%; decode
   tokens/s over pool pages at 32,768 tokens at least transformers' fastest own path
   (DynamicCache; StaticCache, eager; with --compile, StaticCache + torch.compile as
   generate does it).

    python3 examples/hf/check.py --kvpoold bin/kvpoold [--lengths 8192,32768] [--raw FILE]

Prints each figure and a summary; --raw FILE appends the figures as the benchmark
suite's lines (impl "hf", bench/table.py). Exits 1 if a check failed, 2 if it could
not run.
"""

import argparse
import contextlib
import inspect
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, HERE)
os.environ.setdefault("CUDAPOOL_LIB", os.path.join(ROOT, "bin", "libcudapool.so"))

import decisive  # noqa: E402 (after the path)
import suitelines  # noqa: E402
from models import ARCHS, build, geometry_flags, kvpoold_flags, params, use_attention  # noqa: E402

T = 16
TOL = 0.05  # bf16 tolerance of logits, relative to the largest
# transformers' own decoding paths, as the figures' ops name them (bench/table.py)
HF_PATHS = {"DynamicCache, sdpa, eager": "dynamic", "StaticCache, sdpa, eager": "static",
            "StaticCache + torch.compile (generate's own)": "static-compiled"}
def tokens(seed, n):
    import random
    r = random.Random(seed)
    return [r.randrange(32000) for _ in range(n)]


def introspect():
    """What the installed transformers offers, as cudapool.hf uses it."""
    import torch
    import transformers
    from transformers import cache_utils, masking_utils
    print("torch %s, transformers %s, GPU %s" % (torch.__version__, transformers.__version__,
                                                  torch.cuda.get_device_name()))
    print("Cache.__init__%s" % (inspect.signature(cache_utils.Cache.__init__),))
    print("Cache.update%s" % (inspect.signature(cache_utils.Cache.update),))
    for n in ("get_seq_length", "get_mask_sizes", "is_compileable"):
        print("Cache.%s: %r" % (n, getattr(cache_utils.Cache, n, None)))
    from transformers.models.llama import modeling_llama as ml
    for f in (ml.LlamaAttention.forward, ml.LlamaModel.forward):
        print(inspect.getsource(f)[:3000])
    src = inspect.getsource(masking_utils._preprocess_mask_arguments)
    body = [l for l in src.splitlines() if l.strip() and not l.strip().startswith('"')]
    print("_preprocess_mask_arguments:\n" + "\n".join(body[:60]))


def hf_generate(model, ids, n, **kw):
    """transformers' generate, greedy: (tokens, first-step logits, seconds)."""
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, **kw)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return out.sequences[0, ids.shape[1]:].tolist(), [x[0] for x in out.logits], dt


def hf_rates(model, ids, n, **kw):
    """(tokens, first logits, ttft s, decode tok/s) of transformers' generate: decode
    is (n - 1) tokens over the difference of an n-token and a 1-token generate."""
    _, _, t1 = hf_generate(model, ids, 1, **kw)
    toks, logits, tn = hf_generate(model, ids, n, **kw)
    return toks, logits, t1, (n - 1) / max(tn - t1, 1e-9)


def teacher_forced(model, r, chf, prompt, forced):
    """The pool path's logits [n, vocab] fed forced tokens: the prompt over its matched
    pages, then each forced token in turn (eager steps, paged attention)."""
    import torch
    pages = chf.Pages(r, prompt, len(forced))
    try:
        cache = chf.PoolCache(r.kv_caches(), pages.capacity)
        cache.reset(pages.block_table, pages.start)
        L, s = len(prompt), pages.start
        outs = []
        with torch.no_grad():
            x = model(input_ids=torch.tensor([prompt[s:]], device="cuda"), position_ids=torch.arange(s, L, device="cuda")[None],
                      past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            outs.append(x.float())
            for i, t in enumerate(forced[:-1]):
                x = model(input_ids=torch.tensor([[t]], device="cuda"), position_ids=torch.tensor([[L + i]], device="cuda"),
                          past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
                outs.append(x.float())
        torch.cuda.synchronize()
    finally:
        pages.release()
    return torch.stack(outs)


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Checks:
    def __init__(self):
        self.failures, self.n, self.raw = [], 0, []

    def check(self, ok, what):
        self.n += 1
        if not ok:
            self.failures.append(what)
            print("  FAIL: " + what)
        return ok

    def figure(self, op, unit, values):
        self.raw += suitelines.lines("hf", op, unit, values)


def start_owner(kvpoold, dir, name, flags, pages):
    """kvpoold serving dir with the geometry flags, its log beside dir."""
    log = open(os.path.join(os.path.dirname(dir), "kvpoold-%s.log" % name), "w")
    p = subprocess.Popen([kvpoold, "-dir", dir, "-runtime", "gpu"] + flags +
                         ["-pages", str(pages), "-devices", "0"], stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 60
    while not os.path.exists(os.path.join(dir, "kv.sock")):
        if p.poll() is not None or time.monotonic() > end:
            log.close()
            raise RuntimeError("kvpoold did not start (exit %s):\n%s" % (p.poll(), open(log.name).read()[-3000:]))
        time.sleep(0.02)
    return p, log


def check_logits(model, r, chf, c, arch):
    """Full-prompt logits: from position 0 (SDPA) and over 960 cached tokens (the paged
    kernel), against transformers' forward without a cache."""
    import torch
    ids = torch.tensor([tokens(7, 1024)], device="cuda")
    use_attention(model, "sdpa")
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits[0].float()
    use_attention(model, chf.ATTENTION)
    pages = chf.Pages(r, ids[0].tolist(), 0, share=False)
    try:
        cache = chf.PoolCache(r.kv_caches(), pages.capacity, block_table=pages.block_table)
        pos = torch.arange(1024, device="cuda")[None]
        with torch.no_grad():
            full = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits[0].float()
            cache.reset(pages.block_table, 960)
            ext = model(input_ids=ids[:, 960:], position_ids=pos[:, 960:], past_key_values=cache,
                        use_cache=True).logits[0].float()
        torch.cuda.synchronize()
    finally:
        pages.release()
    scale = ref.abs().max().item()
    e1, e2 = (full - ref).abs().max().item(), (ext - ref[960:]).abs().max().item()
    a1 = (full.argmax(-1) == ref.argmax(-1)).float().mean().item()
    a2 = (ext.argmax(-1) == ref[960:].argmax(-1)).float().mean().item()
    print("  prefill logits, 1024 tokens: max |pool - transformers| %.3g from position 0 (SDPA), %.3g for the last "
          "64 over 960 cached (paged kernel); logits up to %.3g; argmax equal at %.1f%% / %.1f%% of positions"
          % (e1, e2, scale, 100 * a1, 100 * a2))
    c.check(e1 <= TOL * scale and e2 <= TOL * scale, "%s: prefill logits differ from transformers' by %.3g / %.3g "
            "(logits up to %.3g)" % (arch, e1, e2, scale))


def check_kernel(model, c, arch):
    import torch
    from cudapool.paged_attention import paged_attention, reference
    a = ARCHS[arch]
    H, Hk, D = a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"]
    torch.manual_seed(3)
    worst = 0.0
    for ctx, nq in [(1, 1), (37, 5), (1000, 64), (8209, 1), (8209, 17), (32808, 1), (32808, 40)]:
        n_pages = -(-ctx // T)
        K = torch.randn(n_pages + 7, T, Hk, D, dtype=torch.bfloat16, device="cuda")
        V = torch.randn_like(K)
        bt = torch.randperm(n_pages + 7, device="cuda")[:n_pages].to(torch.int32)
        q = torch.randn(nq, H, D, dtype=torch.bfloat16, device="cuda")
        cl = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        err = (paged_attention(q, K, V, bt, cl, ctx).float() - reference(q, K, V, bt, ctx)).abs().max().item()
        worst = max(worst, err)
    print("  paged kernel vs SDPA over gathered pages (float32), %d heads / %d KV heads x %d, contexts 1..32808, "
          "q_len 1..64: worst error %.2e" % (H, Hk, D, worst))
    c.check(worst <= 2e-2, "%s: the paged kernel differs from SDPA by %.2e" % (arch, worst))


@contextlib.contextmanager
def served(kvpoold, work, name, flags, pages):
    """A replica (namespace name) of a kvpoold of the geometry flags serving
    work/kv-NAME: the replica is closed and kvpoold stopped at the end."""
    import cudapool
    import cudapool.kv as ckv
    owner, log = start_owner(kvpoold, os.path.join(work, "kv-" + name), name, flags, pages)
    try:
        r = ckv.Replica(os.path.join(work, "kv-" + name), 0, namespace=name, timeout=60, wait_for_owner=True)
        try:
            yield r
        finally:
            try:
                r.close(timeout=10)
            except cudapool.CudapoolError as e:
                print("  close: %s" % e)
    finally:
        owner.terminate()
        try:
            owner.wait(15)
        except subprocess.TimeoutExpired:
            owner.kill()
        log.close()


def leading_equal(a, b):
    """How many leading tokens a and b share."""
    d = first_difference(a, b)
    return min(len(a), len(b)) if d is None else d


def run_decisive(args, work, c, summary):
    """The decisive check (the module's docstring): greedy tokens through the pool,
    computed and matched, equal to transformers' generate, every one, at each length up
    to decisive.WINDOW; reported beyond."""
    import torch
    import cudapool.hf as chf
    print("\n== decisive: a small Llama trained on the standard library's .py files (%d steps)" % args.train_steps)
    model = decisive.train("cuda:0", args.train_steps)
    text = decisive.corpus()
    attn = chf.register()
    try:
        with served(args.kvpoold, work, "decisive", geometry_flags(decisive.CONFIG, T), args.pages) as r:
            use_attention(model, attn)
            gen = chf.Generator(model, r)
            offset = 0
            for L in args.decisive_lengths:
                prompt = decisive.held_out(L, offset, text)  # prompts apart: no one matches another's pages
                offset += L
                comp = gen.generate(prompt, args.new)[0, L:].tolist()
                mat = gen.generate(prompt, args.new)[0, L:].tolist()
                matched = gen.last["matched_pages"]
                use_attention(model, "sdpa")
                try:
                    hf_toks, _, _ = hf_generate(model, torch.tensor([prompt], device="cuda"), args.new)
                finally:
                    use_attention(model, attn)
                n_c, n_m = leading_equal(comp, hf_toks), leading_equal(mat, hf_toks)
                required = L <= decisive.WINDOW
                print("  %6d tokens: greedy tokens equal to transformers' generate: computed %d of %d, matched %d of "
                      "%d (%d pages matched)%s" % (L, n_c, len(hf_toks), n_m, len(hf_toks), matched,
                                                   "" if required else "; past the trained positions: reported only"))
                c.figure("greedy-equal-tokens/decisive/computed/%d" % L, "tokens", [n_c])
                c.figure("greedy-equal-tokens/decisive/matched/%d" % L, "tokens", [n_m])
                summary.setdefault("decisive", []).append((L, "%d/%d computed" % (n_c, len(hf_toks)),
                                                           "%d/%d matched" % (n_m, len(hf_toks))))
                c.check(matched == (L - 1) // T, "decisive %d: matched %d pages, not %d" % (L, matched, (L - 1) // T))
                if required:
                    c.check(len(hf_toks) == args.new and comp == hf_toks and mat == hf_toks,
                            "decisive %d: greedy tokens over the pool differ from transformers' generate: computed "
                            "%d of %d equal, matched %d of %d" % (L, n_c, args.new, n_m, args.new))
            del gen
    finally:
        del model
        torch.cuda.empty_cache()


def run_arch(args, arch, work, c, summary):
    import torch
    import cudapool.hf as chf
    print("\n== %s" % arch)
    with served(args.kvpoold, work, arch, kvpoold_flags(arch, T), args.pages) as r:
        t0 = time.perf_counter()
        model = build(arch, args.seed, chf.register())
        torch.cuda.synchronize()
        n_params = params(model)
        print("  %s: %.3fB parameters, bf16, built in %.1f s; pool: %r" % (
            type(model).__name__, n_params / 1e9, time.perf_counter() - t0, r.geometry))
        summary["model/" + arch] = "%s %.2fB, %d layers, %d KV heads x %d" % (
            type(model).__name__, n_params / 1e9, ARCHS[arch]["num_hidden_layers"],
            ARCHS[arch]["num_key_value_heads"], ARCHS[arch]["head_dim"])
        check_logits(model, r, chf, c, arch)
        check_kernel(model, c, arch)
        gen = chf.Generator(model, r)
        if gen.graph_error:
            print("  decode graph: %s" % gen.graph_error)
        lengths = sorted(set(args.lengths + args.ttft_lengths))
        # warm-up: Triton's compiles, the decode graphs, the cuBLAS and SDPA plans of each length
        t0 = time.perf_counter()
        gen.warm(lengths, args.new)
        w = tokens(-1, 80)
        gen.generate(w, 4)
        gen.generate(w, 4)
        for L in lengths:
            gen.generate(tokens(-L, L), 4, share=False)
        torch.cuda.synchronize()
        print("  warm-up (kernels, graphs, plans of %s tokens) %.1f s; decode graphs: %s" % (
            ",".join(map(str, lengths)), time.perf_counter() - t0, gen.graph_error or "captured"))
        for L in lengths:
            prompt = tokens(L + 17 * len(arch), L)
            ids = torch.tensor([prompt], device="cuda")
            comp = gen.generate(prompt, args.new)
            ci = dict(gen.last)
            mat = gen.generate(prompt, args.new)
            mi = dict(gen.last)
            ttft_c, ttft_m = ci["ttft_s"], mi["ttft_s"]
            c.figure("ttft/computed/%s/%d" % (arch, L), "ms", [1e3 * ttft_c])
            c.figure("ttft/matched/%s/%d" % (arch, L), "ms", [1e3 * ttft_m])
            print("  %6d tokens: TTFT computed %.2f ms (sealed %s pages), matched %.2f ms (%d pages matched, %d "
                  "tokens computed): %.1f%%" % (L, 1e3 * ttft_c, ci.get("sealed"), 1e3 * ttft_m,
                                                mi["matched_pages"], mi["computed_tokens"], 100 * ttft_m / ttft_c))
            c.check(mi["matched_pages"] == (L - 1) // T, "%s %d: matched %d pages, not %d" % (
                arch, L, mi["matched_pages"], (L - 1) // T))
            c.check(comp.tolist() == mat.tolist(), "%s %d: the matched request's tokens differ from the computed "
                    "one's" % (arch, L))
            c.check(torch.equal(ci["first_logits"], mi["first_logits"]), "%s %d: the matched request's first "
                    "logits differ from the computed one's" % (arch, L))
            if L == 32768:
                c.check(ttft_m <= 0.05 * ttft_c, "%s 32768: matched TTFT is %.1f%% of computing it (target <= 5%%)"
                        % (arch, 100 * ttft_m / ttft_c))
                summary["ttft/" + arch] = (ttft_m, ttft_c)
            if L not in args.lengths:
                continue
            alone = gen.generate(prompt, args.new, share=False)
            c.check(alone.tolist() == comp.tolist(), "%s %d: computed alone (private pages) differs" % (arch, L))
            use_attention(model, "sdpa")
            try:
                hf_toks, hf_steps, hf_ttft, hf_rate = hf_rates(model, ids, args.new)
                hf_logits = hf_steps[0].float()
                kinds = {"DynamicCache, sdpa, eager": hf_rate}
                if L == max(args.lengths):
                    try:
                        s_toks, _, _, s_rate = hf_rates(model, ids, args.new, cache_implementation="static",
                                                        disable_compile=True)
                        kinds["StaticCache, sdpa, eager"] = s_rate
                        print("  transformers' StaticCache tokens = its DynamicCache's: %s" % (s_toks == hf_toks))
                    except Exception as e:
                        print("  transformers' StaticCache (eager) failed: %s: %s" % (type(e).__name__, e))
                    if arch in args.compile:
                        try:
                            t0 = time.perf_counter()
                            hf_generate(model, ids, 4, cache_implementation="static")  # compiles
                            print("  (torch.compile of the StaticCache decode step: %.1f s)"
                                  % (time.perf_counter() - t0))
                            k_toks, _, _, k_rate = hf_rates(model, ids, args.new, cache_implementation="static")
                            kinds["StaticCache + torch.compile (generate's own)"] = k_rate
                            print("  compiled tokens = DynamicCache's: %s" % (k_toks == hf_toks))
                        except Exception as e:
                            print("  transformers' StaticCache + torch.compile failed: %s: %s" % (type(e).__name__, e))
            finally:
                use_attention(model, chf.ATTENTION)
            pool_toks = mat[0, L:].tolist()
            same = pool_toks == hf_toks
            d = first_difference(pool_toks, hf_toks)
            # transformers' own forward (no cache, no mask): the prompt's last logits
            use_attention(model, "sdpa")
            try:
                with torch.no_grad():
                    fwd = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
            finally:
                use_attention(model, chf.ATTENTION)
            scale = fwd.abs().max().item()
            e_c = (ci["first_logits"].float() - fwd).abs().max().item()
            e_m = (mi["first_logits"].float() - fwd).abs().max().item()
            e_g = (hf_logits - fwd).abs().max().item()  # transformers' generate against its forward
            tol = max(TOL * scale, e_g)
            print("  %6d tokens: prompt's last logits vs transformers' forward: max diff %.3g computed (SDPA), %.3g "
                  "matched (paged kernel over %d pages); transformers' generate vs its forward %.3g; logits up to "
                  "%.3g" % (L, e_c, e_m, mi["matched_pages"], e_g, scale))
            c.check(max(e_c, e_m) <= TOL * scale, "%s %d: prefill logits differ from transformers' forward by %.3g"
                    % (arch, L, max(e_c, e_m)))
            # teacher-forced: the pool path fed transformers' tokens, step by step
            tf = teacher_forced(model, r, chf, prompt, hf_toks)
            hl = torch.stack([x.float() for x in hf_steps])
            ours = tf.argmax(-1).tolist()
            bad = [i for i, (a, b) in enumerate(zip(ours, hf_toks)) if a != b]
            margins = [(hl[i, hf_toks[i]] - hl[i, ours[i]]).item() for i in bad]
            e_tf = (tf - hl).abs().max().item()
            print("  %6d tokens: greedy tokens over the pool = transformers' generate (DynamicCache): %s%s; fed "
                  "transformers' tokens, the pool's argmax equals its at %d of %d steps%s; logits max diff %.3g "
                  "(tolerance %.3g)" % (
                      L, same, "" if d is None else " (first difference at token %d)" % d, len(hf_toks) - len(bad),
                      len(hf_toks), "" if not bad else ", the others within transformers' margin %.3g" % max(margins),
                      e_tf, tol))
            if any(m > tol for m in margins):  # random weights: reported, not required (the docstring's 3.)
                print("  %6d tokens: the pool's argmax differs from transformers' beyond a near-tie (margin %.3g > "
                      "%.3g): random weights, not checked" % (L, max(margins), tol))
            summary.setdefault("greedy", []).append((arch, L, same, "%d/%d" % (len(hf_toks) - len(bad),
                                                                              len(hf_toks))))
            c.figure("greedy-equal/%s/%d" % (arch, L), "bool", [1.0 if same else 0.0])
            c.figure("argmax-equal/%s/%d" % (arch, L), "steps", [len(hf_toks) - len(bad)])
            best = max(kinds, key=kinds.get)
            rate = mi["decode_tok_s"]
            c.figure("decode/pool/%s/%d" % (arch, L), "tok/s", [rate])
            for k, v in kinds.items():
                c.figure("decode/transformers/%s/%d/%s" % (arch, L, HF_PATHS[k]), "tok/s", [v])
            print("  %6d tokens: decode %.0f tok/s over pool pages (one CUDA graph a step, paged kernel) vs "
                  "transformers' own: %s; fastest %s: %.0f%%"
                  % (L, rate, ", ".join("%s %.0f" % kv for kv in kinds.items()), best, 100 * rate / kinds[best]))
            if L == 32768:
                summary["decode/" + arch] = (rate, best, kinds[best])
                c.check(rate >= kinds[best], "%s 32768: decode over pool pages is %.0f%% of transformers' fastest "
                        "(%s)" % (arch, 100 * rate / kinds[best], best))
        st = r.stats()
        dev = st["devices"][0] if "devices" in st else st
        print("  owner: sealed %s, hits %s, misses %s, duplicates %s" % (
            dev.get("sealed"), dev.get("hits"), dev.get("misses"), dev.get("duplicates")))
        del gen, model
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvpoold", default=os.environ.get("KVPOOLD", os.path.join(ROOT, "bin", "kvpoold")))
    ap.add_argument("--archs", default="llama,qwen3", help="the random-weight models (empty: the decisive check alone)")
    ap.add_argument("--lengths", default="8192,32768", help="prompt lengths checked against transformers")
    ap.add_argument("--ttft-lengths", default="1024,4096,16384", help="more lengths timed (TTFT only)")
    ap.add_argument("--new", type=int, default=64, help="tokens decoded per request")
    ap.add_argument("--decisive-lengths", default="1024,2048,4096,8192,32768",
                    help="prompt lengths of the decisive check (equal tokens required up to %d; empty: skip it)"
                         % decisive.WINDOW)
    ap.add_argument("--train-steps", type=int, default=decisive.STEPS, help="the decisive model's training steps")
    ap.add_argument("--pages", type=int, default=6144)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--compile", nargs="?", const="llama,qwen3", default="",
                    help="also time transformers' StaticCache + torch.compile for these architectures (default all)")
    ap.add_argument("--introspect", action="store_true", help="print the transformers API cudapool.hf uses")
    ap.add_argument("--raw", metavar="FILE", help="append the figures as the benchmark suite's lines")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.ttft_lengths = [int(x) for x in args.ttft_lengths.split(",") if x]
    args.decisive_lengths = [int(x) for x in args.decisive_lengths.split(",") if x]
    args.compile = [x for x in args.compile.split(",") if x]
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        print("check.py needs torch and transformers: %s" % e)
        return 2
    if not torch.cuda.is_available() or not os.path.exists(args.kvpoold):
        print("check.py needs a GPU and kvpoold (%s)" % args.kvpoold)
        return 2
    import cudapool
    print(cudapool.init("gpu"))
    torch.cuda.set_device(0)
    if args.introspect:
        try:
            introspect()
        except Exception:
            traceback.print_exc()
    c, summary = Checks(), {}
    work = tempfile.mkdtemp(prefix="cudapool-hf-")
    if args.decisive_lengths:
        try:
            run_decisive(args, work, c, summary)
        except Exception as e:
            traceback.print_exc()
            c.check(False, "decisive stopped: %s: %s" % (type(e).__name__, e))
    for arch in [a for a in args.archs.split(",") if a]:
        try:
            run_arch(args, arch, work, c, summary)
        except Exception as e:
            traceback.print_exc()
            c.check(False, "%s stopped: %s: %s" % (arch, type(e).__name__, e))
    print("\n== hf summary")
    for k, v in summary.items():
        print("  %s: %s" % (k, v))
    import transformers
    c.raw[:0] = ["meta hf-run %s on %s, transformers %s, torch %s: %s; prompts of %s tokens, %d decoded" % (
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch.cuda.get_device_name(), transformers.__version__,
        torch.__version__, ", ".join(v for k, v in summary.items() if k.startswith("model/")),
        ",".join(map(str, sorted(set(args.lengths + args.ttft_lengths)))), args.new), "meta hf-new %d" % args.new]
    c.raw.append("meta hf-checks " + ("all %d checks passed" % c.n if not c.failures else
                                      "%d of %d checks FAILED" % (len(c.failures), c.n)))
    for k, f in enumerate(c.failures, 1):
        c.raw.append("fail hf check/%d %s" % (k, " ".join(f.split())))
    if args.raw:
        with open(args.raw, "a") as f:
            f.write("".join(line + "\n" for line in c.raw))
    for f in c.failures:
        print("FAIL:", f)
    print("hf: %s (%d checks)" % ("PASS" if not c.failures else "FAIL", c.n))
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
