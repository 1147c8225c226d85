"""The model's own checks on one GPU, with no owner (LocalPool's in-process slab):

    python3 examples/replicas/check.py [--lengths 8192,32768] [--new 32]

1. this forward's logits against transformers' own forward (LlamaForCausalLM, SDPA) on a
   short prompt: the prompt prefilled whole, and prefilled in part with the rest extended
   over the pages by the paged kernel;
2. the paged kernel against SDPA over K/V gathered from the pages (float32), for decode
   (q_len 1) and suffixes (q_len > 1), up to 32k tokens, over a shuffled block table;
3. per prompt length: a request computed and sealed, one matched, the same request
   computed alone into private pages (its greedy tokens and its prompt's KV bytes must
   equal the matched one's), and the private contiguous cache; time to first token and
   decode tokens/s of each;
4. a second process builds the model and prefills the same prompt: its weights'
   fingerprint, its prompt KV's SHA-256 and its greedy tokens must equal this process's.
Prints each figure; exits 1 if a check fails.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from engine import Engine  # noqa: E402
from localpool import LocalPool  # noqa: E402
from model import Model, PagedKV  # noqa: E402
from paged_attention import paged_attention, reference  # noqa: E402

VOCAB = 32000


def tokens(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def local_pool(m, pages):
    return LocalPool(len(m.layers), m.kv_heads, m.head_dim, 16, pages, m.device)


def kv_digest(pool, pages):
    kv = PagedKV(pool.kv_caches(), pages)
    b = kv.pages_bytes(pages).cpu().numpy()
    return hashlib.sha256(b.tobytes()).hexdigest()


def digest(m, length, seed, new):
    """What a second process must reproduce: the prompt's KV bytes and greedy tokens."""
    pool = local_pool(m, length // 16 + 64)
    eng = Engine(m, pool)
    prompt, suffix = tokens(seed, length), tokens(seed + 1000, 16)
    r = eng.serve(prompt, suffix, new, share=True)
    lease = pool.match(pool.hashes(prompt))
    d = kv_digest(pool, lease.pages)
    return {"fingerprint": m.fingerprint(), "kv_sha256": d, "tokens": r["tokens"]}


def check_hf(m, failures):
    ids = torch.tensor(tokens(7, 128), device=m.device)
    with torch.no_grad():
        hf = m.hf(input_ids=ids[None], use_cache=False).logits[0].float()
    pool = local_pool(m, 32)
    kv = PagedKV(pool.kv_caches(), list(range(8)))
    mine = m.prefill(ids, kv, all_logits=True)
    scale = hf.abs().max().item()
    e1 = (mine - hf).abs().max().item()
    kv2 = PagedKV(pool.kv_caches(), list(range(31, 23, -1)))
    m.prefill(ids[:96], kv2)
    ext = m.extend(ids[96:], 96, kv2, all_logits=True)
    e2 = (ext - hf[96:]).abs().max().item()
    a1 = (mine.argmax(-1) == hf.argmax(-1)).float().mean().item()
    a2 = (ext.argmax(-1) == hf[96:].argmax(-1)).float().mean().item()
    print("HF check (128 tokens): max |logit - HF| prefill %.3g, prefill 96 + paged extend 32 %.3g "
          "(logits up to %.3g); argmax equal to HF's at %.0f%% / %.0f%% of positions"
          % (e1, e2, scale, 100 * a1, 100 * a2))
    if e1 > 0.05 * scale or e2 > 0.05 * scale:
        failures.append("logits differ from HF's")


def check_kernel(m, failures):
    torch.manual_seed(3)
    worst = 0.0
    for ctx, nq in [(1, 1), (5, 5), (37, 5), (1000, 1), (1000, 64), (8209, 1), (8209, 17),
                    (32808, 1), (32808, 40)]:
        n_pages = -(-ctx // 16)
        K = torch.randn(n_pages + 7, 16, 8, 64, dtype=torch.bfloat16, device=m.device)
        V = torch.randn_like(K)
        bt = torch.randperm(n_pages + 7, device=m.device)[:n_pages].to(torch.int32)
        q = torch.randn(nq, 32, 64, dtype=torch.bfloat16, device=m.device)
        c = torch.tensor([ctx], dtype=torch.int32, device=m.device)
        out = paged_attention(q, K, V, bt, c, ctx).float()
        ref = reference(q, K, V, bt, ctx)
        err = (out - ref).abs().max().item()
        worst = max(worst, err)
        print("  kernel ctx %6d q_len %3d: max |out - SDPA(gathered)| %.2e" % (ctx, nq, err))
    print("kernel check: worst error %.2e (bf16 inputs, float32 reference)" % worst)
    if worst > 2e-2:
        failures.append("paged kernel differs from SDPA")


def check_requests(m, lengths, new, failures, results):
    pages = 2 * sum(L // 16 for L in lengths) + 1024
    pool = local_pool(m, pages)
    eng = Engine(m, pool)
    eng.serve(tokens(99, 80), tokens(98, 8), 8, share=False)  # warm-up: compiles, graphs
    eng.serve(tokens(99, 80), tokens(98, 40), 8, share=False)
    for L in lengths:  # the cuBLAS and SDPA plans of each length, outside the timings
        eng.serve(tokens(-L, L), tokens(-L - 1, 16), 4, share=False)
    eng.warm(lengths, 16, new)  # the graphs of the suffix's extend and of decode
    for L in lengths:
        prompt = tokens(L, L)
        sfx = [tokens(L + i + 1, 16) for i in range(2)]
        c = eng.serve(prompt, sfx[0], new, share=True)
        r = eng.serve(prompt, sfx[1], new, share=True, time_pieces=True)
        ref = eng.serve(prompt, sfx[1], new, share=False, compare=True)
        ref2 = eng.serve(prompt, sfx[1], new, share=False)
        con = eng.contiguous(prompt, sfx[1], new)
        ok = r["tokens"] == ref["tokens"] and ref["kv_equal"]
        print("%6d tokens: TTFT computed %.1f ms (sealed %d pages), matched %.2f ms (%d pages, match %.3f ms), "
              "ratio %.1f%%; reference (computed alone) %.1f ms"
              % (L, 1e3 * c["ttft_s"], c.get("sealed", 0), 1e3 * r["ttft_s"], r["matched_pages"],
                 1e3 * r["match_s"], 100 * r["ttft_s"] / ref["ttft_s"], 1e3 * ref["ttft_s"]))
        print("        decode tok/s: pool pages %.0f (whole-step graph), %.0f (graphs between attention); "
              "private contiguous cache %.0f (graphs between attention, SDPA); ratio %.0f%%"
              % (r["decode_tok_s"], r["decode_pieces_tok_s"], con["decode_tok_s"],
                 100 * r["decode_pieces_tok_s"] / con["decode_tok_s"]))
        print("        greedy tokens matched == reference: %s; prompt KV bytes equal: %s; reference "
              "twice equal: %s; pieces == graph: %s; contiguous tokens equal: %d/%d"
              % (r["tokens"] == ref["tokens"], ref["kv_equal"], ref["tokens"] == ref2["tokens"],
                 r["pieces_tokens_equal"], sum(a == b for a, b in zip(con["tokens"], r["tokens"])), new))
        if not ok or ref["tokens"] != ref2["tokens"]:
            failures.append("%d tokens: matched request differs from the reference" % L)
        results[L] = {"computed": c, "matched": r, "reference": ref, "contiguous": con}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--worker", type=int, default=0, help="print digest(length) as JSON and exit")
    ap.add_argument("--no-second-process", action="store_true")
    args = ap.parse_args()
    torch.cuda.set_device(0)
    t0 = time.perf_counter()
    m = Model.build(seed=args.seed)
    torch.cuda.synchronize()
    built = time.perf_counter() - t0
    if args.worker:
        print(json.dumps(digest(m, args.worker, args.seed, args.new)))
        return 0
    print("model: %.3fB parameters, bf16, built on %s in %.1f s, fingerprint %x"
          % (m.params() / 1e9, torch.cuda.get_device_name(), built, m.fingerprint()))
    failures, results = [], {}
    check_hf(m, failures)
    check_kernel(m, failures)
    lengths = [int(x) for x in args.lengths.split(",")]
    check_requests(m, lengths, args.new, failures, results)
    if not args.no_second_process:
        L = lengths[0]
        mine = digest(m, L, args.seed, args.new)
        p = subprocess.run([sys.executable, __file__, "--worker", str(L), "--seed", str(args.seed),
                            "--new", str(args.new)], capture_output=True, text=True, timeout=300)
        try:
            other = json.loads(p.stdout.strip().splitlines()[-1])
        except Exception:
            print(p.stdout[-2000:], p.stderr[-4000:])
            other = {}
        same = {k: other.get(k) == mine[k] for k in mine}
        print("second process (%d tokens): fingerprint equal %s, prompt KV SHA-256 equal %s (%s), "
              "greedy tokens equal %s" % (L, same["fingerprint"], same["kv_sha256"], mine["kv_sha256"][:16],
                                          same["tokens"]))
        if not all(same.values()):
            failures.append("a second process computes other weights, KV or tokens")
    for f in failures:
        print("FAIL:", f)
    print("check: %s" % ("PASS" if not failures else "FAIL"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
