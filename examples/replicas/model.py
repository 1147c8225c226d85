"""The model the replicas serve: a Llama-architecture transformer (transformers'
LlamaForCausalLM) built from a config with seeded random weights, and a forward of its own
around its modules that keeps K and V in a paged cache it addresses through a block table.

    m = Model.build(seed=1)                 # on the current GPU, identical in every process
    kv = PagedKV(caches, block_table)        # caches: per layer (K, V) [pages, 16, 8, 64]
    logits = m.prefill(ids, kv)              # SDPA (causal); K/V (after rotary) into pages
    logits = m.extend(ids, start, kv)        # the pages read in place (paged_attention)
    dec = Decoder(m, kv, capacity); toks = dec.run(first, start, n)   # CUDA-graphed steps

ContigKV is the same model's private contiguous cache (a preallocated [kv_heads, capacity,
head_dim] tensor per layer, SDPA over its first L positions): the reference for decode
speed. Batch one: a replica serves one sequence at a time.
"""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from paged_attention import Workspace, paged_attention

# ~0.85B parameters; 16 layers x 2 x 8 KV heads x 64 x bf16 = 32 KiB of KV per token.
CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, head_dim=64,
              max_position_embeddings=65536, rms_norm_eps=1e-5, tie_word_embeddings=False)
STD = 0.02


def _rope_fn():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    return apply_rotary_pos_emb


class Model:
    def __init__(self, hf, max_pos):
        self.hf = hf
        cfg = hf.config
        self.layers = list(hf.model.layers)
        self.embed, self.norm, self.lm_head = hf.model.embed_tokens, hf.model.norm, hf.lm_head
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.device = self.embed.weight.device
        self.rotary = _rope_fn()
        # cos/sin of every position from the model's own rotary module (one row per
        # position, computed independently of the others, so a lookup equals a call).
        with torch.no_grad():
            pos = torch.arange(max_pos, device=self.device)[None]
            cos, sin = hf.model.rotary_emb(self.embed.weight[:1, None], pos)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()

    @classmethod
    @torch.no_grad()
    def build(cls, seed=1, device=None, max_pos=65536):
        """The model on device (default: the current one), every weight drawn from one
        generator seeded with seed, in parameter order, on the GPU: the same weights in
        every process of the same GPU type."""
        from transformers import LlamaConfig, LlamaForCausalLM
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        cfg = LlamaConfig(**CONFIG)
        try:
            cfg._attn_implementation = "sdpa"
        except Exception:
            pass
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                hf = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
        hf.eval()
        for p in hf.parameters():  # (buffers such as rotary's inv_freq stay float32)
            if p.dtype != torch.bfloat16 or p.device != device:
                p.data = p.data.to(device=device, dtype=torch.bfloat16)
        g = torch.Generator(device=device).manual_seed(seed)
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm weights
            else:
                p.normal_(0.0, STD, generator=g)
        return cls(hf, max_pos)

    @torch.no_grad()
    def fingerprint(self):
        """An exact checksum of every weight's bits (integer sums: order-independent)."""
        s = torch.zeros((), dtype=torch.int64, device=self.device)
        for i, p in enumerate(self.hf.parameters()):
            s += (p.view(torch.int16).to(torch.int64).sum() * (i + 1)) % (1 << 40)
        return int(s)

    def params(self):
        return sum(p.numel() for p in self.hf.parameters())

    # --- the pieces of a layer -------------------------------------------------------

    def qkv(self, layer, x, cos, sin):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        n = x.shape[0]
        q = a.q_proj(h).view(n, self.heads, self.head_dim)
        k = a.k_proj(h).view(n, self.kv_heads, self.head_dim)
        v = a.v_proj(h).view(n, self.kv_heads, self.head_dim)
        q, k = self.rotary(q, k, cos, sin, unsqueeze_dim=1)
        return q, k, v

    def out(self, layer, x, o):
        x = x + layer.self_attn.o_proj(o.reshape(x.shape[0], -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x):
        return self.lm_head(self.norm(x)).float()

    def _causal(self, q, k, v):
        g = self.heads // self.kv_heads
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(g, 0)[None],
            v.transpose(0, 1).repeat_interleave(g, 0)[None], is_causal=True)
        return o[0].transpose(0, 1)

    # --- whole passes ----------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, ids, kv, all_logits=False):
        """The prompt ids (int64 [n], positions 0..n-1) with SDPA; each layer's K and V
        (after rotary) go into kv. Returns the last position's logits [1, vocab] (every
        position's with all_logits)."""
        n = ids.shape[0]
        pos = torch.arange(n, device=self.device)
        cos, sin = self.cos[pos], self.sin[pos]
        slots = kv.slots(pos)
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = self.qkv(layer, x, cos, sin)
            kv.write(i, slots, k, v)
            x = self.out(layer, x, self._causal(q, k, v))
        return self.logits(x if all_logits else x[-1:])

    @torch.no_grad()
    def extend(self, ids, start, kv, all_logits=False):
        """ids at positions start..start+n-1 over the start tokens kv already holds: their
        K/V are written into the pages, then attention reads the pages in place (causal
        among the new tokens). Returns the last position's logits [1, vocab]."""
        n = ids.shape[0]
        pos = torch.arange(start, start + n, device=self.device)
        cos, sin = self.cos[pos], self.sin[pos]
        slots = kv.slots(pos)
        ctx = torch.tensor([start + n], dtype=torch.int32, device=self.device)
        ws = Workspace(start + n, n, self.heads, self.kv_heads, self.head_dim, self.device)
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = self.qkv(layer, x, cos, sin)
            kv.write(i, slots, k, v)
            o = kv.attend(i, q, ctx, start + n, ws)
            x = self.out(layer, x, o)
        return self.logits(x if all_logits else x[-1:])


class Extender:
    """Model.extend of n tokens over a paged cache as one CUDA graph (the length of the
    sequence, like the tokens, is an input in device memory): a suffix over a matched
    prefix costs one launch instead of a thousand. The first run is eager (the warm-up),
    the graph is captured after it."""

    def __init__(self, model, kv, n, capacity):
        assert kv.graph_safe
        self.m, self.kv, self.n, self.capacity = model, kv, n, capacity
        dev = model.device
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        self.ar = torch.arange(n, device=dev)
        self.ws = Workspace(capacity, n, model.heads, model.kv_heads, model.head_dim, dev)
        self.graph = None

    def _body(self):
        m = self.m
        pos = self.start + self.ar
        ctx = (self.start + self.n).to(torch.int32)
        cos, sin = m.cos[pos], m.sin[pos]
        slots = self.kv.slots(pos)
        x = m.embed(self.ids)
        for i, layer in enumerate(m.layers):
            q, k, v = m.qkv(layer, x, cos, sin)
            self.kv.write(i, slots, k, v)
            x = m.out(layer, x, self.kv.attend(i, q, ctx, self.capacity, self.ws))
        self.logits = m.logits(x[-1:])

    @torch.no_grad()
    def run(self, ids, start):
        """The logits [1, vocab] of the last of ids (n tokens at positions start..)."""
        assert len(ids) == self.n and start + self.n <= self.capacity
        self.ids.copy_(torch.tensor(ids, dtype=torch.long))
        self.start.fill_(start)
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body()
        torch.cuda.current_stream().wait_stream(side)
        out = self.logits.clone()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
            self._body()
        self.graph = g
        return out


class PagedKV:
    """A sequence's cache in pages: caches[l] = (K, V) of layer l, [pages, T, H, D] views
    of a slab; the block table (int32 on the GPU) names the sequence's pages in order."""

    def __init__(self, caches, pages, capacity=None):
        self.caches = caches
        self.page = caches[0][0].shape[1]
        self.kv_heads, self.head_dim = caches[0][0].shape[2], caches[0][0].shape[3]
        n = len(pages) if capacity is None else -(-capacity // self.page)
        if len(pages) > n:
            raise ValueError("%d pages do not fit a capacity of %d tokens" % (len(pages), capacity))
        dev = caches[0][0].device
        self.block_table = torch.zeros(n, dtype=torch.int32, device=dev)
        self.set_pages(pages)

    def set_pages(self, pages):
        """Points the block table at pages (the same tensor: graph-safe)."""
        t = torch.as_tensor(list(pages), dtype=torch.int32)
        self.block_table.zero_()
        self.block_table[:len(t)].copy_(t, non_blocking=False)
        self.n_pages = len(t)

    def capacity(self):
        """The tokens the block table can name (its pages, set or not)."""
        return self.block_table.numel() * self.page

    def slots(self, pos):
        """Flat slot indices (page * T + offset) of positions pos (int64 on the GPU)."""
        return self.block_table[pos // self.page].long() * self.page + pos % self.page

    def write(self, layer, slots, k, v):
        K, V = self.caches[layer]
        K.view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, k)
        V.view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, v)

    def attend(self, layer, q, ctx, max_ctx, ws, out=None):
        K, V = self.caches[layer]
        return paged_attention(q, K, V, self.block_table, ctx, max_ctx, out=out, ws=ws)

    graph_safe = True

    def pages_bytes(self, pages):
        """Every layer's K and V of pages, as one byte tensor (for exact comparisons)."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.block_table.device)
        return torch.cat([t.index_select(0, idx).reshape(-1).view(torch.uint8)
                          for kv in self.caches for t in kv])


class ContigKV:
    """The private contiguous cache: K and V of layer l are [kv_heads, capacity, head_dim]
    tensors allocated once; attention is SDPA over their first L positions."""

    def __init__(self, model, capacity):
        self.kv_heads, self.head_dim = model.kv_heads, model.head_dim
        self.g = model.heads // model.kv_heads
        shape = (len(model.layers), 2, model.kv_heads, capacity, model.head_dim)
        self.kv = torch.zeros(shape, dtype=torch.bfloat16, device=model.device)
        self.cap = capacity

    def capacity(self):
        return self.cap

    def slots(self, pos):
        return pos

    def write(self, layer, pos, k, v):
        self.kv[layer, 0].index_copy_(1, pos, k.transpose(0, 1))
        self.kv[layer, 1].index_copy_(1, pos, v.transpose(0, 1))

    graph_safe = False  # the SDPA call's shape is the host-side length

    def attend(self, layer, q, ctx, length, ws, out=None):
        """A decode step (q [1, heads, D]): the heads of a KV head's group are SDPA's
        queries, so no K/V is repeated."""
        assert q.shape[0] == 1
        k = self.kv[layer, 0, :, :length][None]
        v = self.kv[layer, 1, :, :length][None]
        # the flash kernel: cuDNN's (SDPA's first choice here) builds a plan per length
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            o = F.scaled_dot_product_attention(q.view(1, self.kv_heads, self.g, self.head_dim), k, v)
        o = o.view(1, -1, self.head_dim)
        if out is not None:
            out.copy_(o)
            return out
        return o


class Decoder:
    """Greedy decoding of one sequence, one token a step, from static buffers: no
    allocation and no host sync per step. mode "graph": each step is one CUDA graph
    (paged caches only: the kernel reads the length from device memory); "pieces": a graph
    per layer boundary (norms, projections, rotary, cache write, MLP) with attention
    launched between them, for caches whose attention is not graph-safe; "eager": no
    graphs. The first step runs eagerly (warm-up), the graphs are captured after it."""

    def __init__(self, model, kv, capacity, mode="graph"):
        if mode == "graph" and not kv.graph_safe:
            raise ValueError("this cache's attention cannot be captured whole")
        self.m, self.kv, self.mode, self.capacity = model, kv, mode, capacity
        dev = model.device
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.ctx = torch.zeros(1, dtype=torch.int32, device=dev)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.hist = torch.zeros(capacity, dtype=torch.long, device=dev)
        self.o = torch.zeros(1, model.heads, model.head_dim, dtype=torch.bfloat16, device=dev)
        self.q = torch.zeros_like(self.o)
        self.ws = Workspace(capacity, 1, model.heads, model.kv_heads, model.head_dim, dev)
        self.graphs = None
        self.host_len = 0

    # the step, cut at attention: piece(0) .. piece(L) with attend(l) after piece(l)
    def _piece(self, i):
        m = self.m
        if i == 0:
            self.x = m.embed(self.tok)
            self.cos, self.sin = m.cos[self.pos], m.sin[self.pos]
            self.slot = self.kv.slots(self.pos)
        else:
            self.x = m.out(m.layers[i - 1], self.x, self.o)
        if i < len(m.layers):
            q, k, v = m.qkv(m.layers[i], self.x, self.cos, self.sin)
            self.kv.write(i, self.slot, k, v)
            self.q.copy_(q)
        else:
            nxt = torch.argmax(m.logits(self.x), dim=-1)
            self.hist.index_copy_(0, self.step, nxt)
            self.tok.copy_(nxt)
            self.pos += 1
            self.ctx += 1
            self.step += 1

    def _attend(self, i):
        self.kv.attend(i, self.q, self.ctx, self.host_len if not self.kv.graph_safe else self.capacity,
                       self.ws, out=self.o)

    def _eager_step(self):
        n = len(self.m.layers)
        for i in range(n):
            self._piece(i)
            self._attend(i)
        self._piece(n)

    def _capture(self):
        n = len(self.m.layers)
        pool = torch.cuda.graph_pool_handle()
        if self.mode == "graph":
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._eager_step()
            self.graphs = [g]
        else:
            self.graphs = []
            for i in range(n + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._piece(i)
                self.graphs.append(g)

    def _replay(self):
        if self.mode == "graph":
            self.graphs[0].replay()
            return
        n = len(self.m.layers)
        for i in range(n):
            self.graphs[i].replay()
            self._attend(i)
        self.graphs[n].replay()

    @torch.no_grad()
    def run(self, first, start, n, timed=False, stop=None):
        """Feeds token first at position start (the cache holds positions 0..start-1) and
        decodes greedily until n tokens (first included) are known. Returns the n tokens
        as a list, and with timed also the seconds per step of the replayed steps. stop,
        if given, is asked every 16 steps; when it returns true decoding ends early and
        fewer tokens come back."""
        assert start + n <= self.capacity
        self.tok.fill_(first)
        self.pos.fill_(start)
        self.ctx.fill_(start + 1)
        self.step.zero_()
        self.hist[0] = first
        self.step.fill_(1)
        self.host_len = start + 1
        if n == 1:
            return ([first], 0.0) if timed else [first]
        if self.mode == "eager" or self.graphs is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._eager_step()
            torch.cuda.current_stream().wait_stream(side)
            self.host_len += 1
            if self.mode != "eager":
                torch.cuda.synchronize()
                self._capture()
            done = 1
        else:
            done = 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = n - 1 - done
        for i in range(n - 1 - done):
            if stop is not None and i % 16 == 0:
                # the host runs ahead of the GPU by what it queued: keep it 16 steps close
                torch.cuda.current_stream().synchronize()
                if stop():
                    steps = i
                    break
            if self.mode == "eager":
                self._eager_step()
            else:
                self._replay()
            self.host_len += 1
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        toks = self.hist[:1 + done + steps].tolist()
        return (toks, dt / max(steps, 1)) if timed else toks
