"""One replica's request path over a page pool (cudapool.kv.Replica, or LocalPool):

    match the prompt's full pages by prefix hash
      all of them: extend the rest of the prompt and the suffix over them   (matched)
      else:        alloc pages, prefill the prompt into them with SDPA, extend the suffix,
                   seal the prompt's pages (waiting until visible), match them for reading
    decode greedily over the prefix pages and the request's private pages
    release every lease (after the stream's work)

A partial match (a prefix evicted in part) is released and the prompt recomputed, so the
prompt's pages are always the output of one prefill: their bytes do not depend on which
replica wrote them. The private pages (the prompt's partial last page, the suffix, the
decoded tokens) are a write lease that is released unsealed.
"""

import time

import torch

from model import ContigKV, Decoder, Extender, PagedKV

BUCKET = 4096  # decoders (and their CUDA graphs) are kept per capacity, a multiple of this


def _ceil(a, b):
    return -(-a // b)


class Engine:
    def __init__(self, model, pool):
        self.m, self.pool = model, pool
        self.caches = pool.kv_caches()
        self.page = self.caches[0][0].shape[1]
        self.kvs = {}
        self.exts = {}

    def _kv(self, tokens, mode="graph"):
        cap = _ceil(tokens, BUCKET) * BUCKET
        key = (cap, mode)
        if key not in self.kvs:
            kv = PagedKV(self.caches, [], capacity=cap)
            self.kvs[key] = (kv, Decoder(self.m, kv, cap, mode))
        return self.kvs[key]

    def _extend(self, kv, ids, start):
        """m.extend through a graph kept per (cache, number of tokens)."""
        key = (id(kv), len(ids))
        ext = self.exts.get(key)
        if ext is None:
            ext = self.exts[key] = Extender(self.m, kv, len(ids), kv.capacity())
        return ext.run(ids, start)

    @torch.no_grad()
    def warm(self, lengths, suffix, n_new):
        """Captures the graphs requests of these prompt lengths will replay (the suffix's
        extend, the decode steps) on a few private pages at the start of a sequence."""
        stream = torch.cuda.current_stream()
        for L in lengths:
            kv, dec = self._kv(L + suffix + n_new)
            priv = self.pool.alloc(_ceil(suffix + n_new, self.page))
            try:
                kv.set_pages(list(priv.pages))
                logits = self._extend(kv, [1] * suffix, 0)
                logits = self._extend(kv, [1] * suffix, 0)
                dec.run(int(torch.argmax(logits[-1])), suffix, n_new)
            finally:
                self.pool.release(priv, stream=stream)

    def _ids(self, toks):
        return torch.tensor(toks, dtype=torch.long, device=self.m.device)

    @torch.no_grad()
    def serve(self, prompt, suffix, n_new, share=True, compare=False, time_pieces=False,
              stop=None, on_decode=None):
        """Serves prompt + suffix and decodes n_new tokens (the first included). share:
        match and seal through the pool (else the prompt goes into private pages only,
        never sealed: the reference). compare: also match the sealed prompt pages and check
        their bytes equal the ones computed here (reference runs). time_pieces: decode
        again with attention outside the graphs, for the comparison with the contiguous
        cache. stop: asked during decoding; true ends it early ("interrupted").
        on_decode: called once decoding starts. Returns a dict of what happened."""
        stream = torch.cuda.current_stream()
        T = self.page
        full = len(prompt) // T * T
        n_tok = len(prompt) + len(suffix) + n_new
        kv, dec = self._kv(n_tok)
        held = []
        out = {"prompt": len(prompt)}
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hashes = self.pool.hashes(prompt)
            out["hash_s"] = time.perf_counter() - t0
            lease = self.pool.match(hashes, stream=stream) if share else None
            if lease is not None and len(lease):
                held.append(lease)
            matched = lease is not None and len(lease) == len(hashes) and len(hashes) > 0
            if lease is not None and len(lease) and not matched:
                self.pool.release(lease, stream=stream)
                held.remove(lease)
            t_match = time.perf_counter() - t0
            priv = self.pool.alloc(_ceil(n_tok - full, T))
            held.append(priv)
            if matched:
                prefix = list(lease.pages)
                kv.set_pages(prefix + list(priv.pages))
                logits = self._extend(kv, prompt[full:] + suffix, full)
            else:
                w = self.pool.alloc(len(hashes))
                held.append(w)
                prefix = list(w.pages)
                kv.set_pages(prefix + list(priv.pages))
                if full:
                    self.m.prefill(self._ids(prompt[:full]), kv)
                logits = self._extend(kv, prompt[full:] + suffix, full)
            first = int(torch.argmax(logits[-1]))  # a host sync: the first token is known
            out["ttft_s"] = time.perf_counter() - t0
            out["match_s"] = t_match
            out["matched_pages"] = len(prefix) if matched else 0
            out["computed"] = not matched
            if not matched and share:
                r = self.pool.seal(w, hashes, stream=stream, wait=True)
                held.remove(w)
                out["sealed"], out["duplicates"] = r.visible, r.duplicates
                lease = self.pool.match(hashes, stream=stream)
                held.append(lease)
                if len(lease) != len(hashes):
                    raise RuntimeError("sealed %d pages, matched %d" % (len(hashes), len(lease)))
                prefix = list(lease.pages)
                kv.set_pages(prefix + list(priv.pages))
            if compare:
                ref = self.pool.match(hashes, stream=stream)
                held.append(ref)
                out["kv_compared_pages"] = len(ref)
                out["kv_equal"] = len(ref) == len(hashes) and bool(torch.equal(
                    kv.pages_bytes(prefix), kv.pages_bytes(ref.pages)))
            if on_decode is not None:
                on_decode()
            toks, step_s = dec.run(first, len(prompt) + len(suffix), n_new, timed=True, stop=stop)
            out["tokens"] = toks
            out["interrupted"] = len(toks) < n_new
            out["decode_tok_s"] = 1.0 / step_s if step_s else 0.0
            if time_pieces:
                pkv, pdec = self._kv(n_tok, "pieces")
                pkv.set_pages(prefix + list(priv.pages))
                ptoks, pstep = pdec.run(first, len(prompt) + len(suffix), n_new, timed=True)
                out["decode_pieces_tok_s"] = 1.0 / pstep
                out["pieces_tokens_equal"] = ptoks == toks
        finally:
            try:
                self.pool.release(*held, stream=stream)
            except Exception as e:  # the owner may be gone: nothing to give back to
                out["release_error"] = "%s: %s" % (type(e).__name__, e)
        return out

    @torch.no_grad()
    def contiguous(self, prompt, suffix, n_new):
        """The same request over a private contiguous cache (SDPA), for decode speed:
        prompt and suffix prefilled at once, then n_new tokens decoded ("pieces" graphs,
        attention between them). Returns tokens and tokens/s."""
        n = len(prompt) + len(suffix)
        cap = _ceil(n + n_new, BUCKET) * BUCKET
        ckv = ContigKV(self.m, cap)
        logits = self.m.prefill(self._ids(prompt + suffix), ckv)
        first = int(torch.argmax(logits[-1]))
        dec = Decoder(self.m, ckv, cap, "pieces")
        toks, step_s = dec.run(first, n, n_new, timed=True)
        del dec, ckv
        return {"tokens": toks, "decode_tok_s": 1.0 / step_s}
