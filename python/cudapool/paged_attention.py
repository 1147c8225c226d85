"""Attention that reads a KV page pool in place, through a block table (Triton); it
owns the paged kernel cudapool.hf decodes with. It imports torch and Triton, so the
package imports it only when a model attends over pages.

The cache of one layer is K and V tensors of shape [pages, tokens_per_page, kv_heads,
head_dim] (the layout of Replica.kv_caches: one layer's half of the slab). A sequence's tokens live
in the pages its block table names, in order: token t is slot t % tokens_per_page of page
block_table[t // tokens_per_page]. Pages are never gathered into a contiguous copy.

paged_attention(q, k_cache, v_cache, block_table, ctx_len, ...) attends the q_len newest
tokens of a sequence of ctx_len tokens (their K and V already written into the pages)
over the whole sequence: query i sits at position ctx_len - q_len + i and sees keys
0 .. that position (causal among the new tokens), so one kernel serves a decode step
(q_len 1) and a suffix prefilled over a cached prefix (q_len > 1). Grouped-query
attention: query head h reads KV head h // (heads // kv_heads); the rows of one program
are (query, head-in-group) pairs of one KV head, so each K/V tile is loaded once for all
the heads that share it. The keys are split into chunks processed by separate programs
(split-K, "flash-decoding"), whose partial results a second kernel combines, so a decode
step over 32k tokens keeps the GPU busy. ctx_len is read from device memory, so a CUDA
graph captured once replays for every length up to max_ctx.

The two kernels carry no Python type annotations, only Triton's (tl.constexpr): Triton
reads a kernel's annotations to specialise it, and its untyped jit decorator is Any to
mypy, so they alone are exempt from its checks (their "type: ignore" comments).
"""

import math
from typing import Any, Optional, Tuple

import torch
import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # the score of a masked key (finite, so that empty rows never make NaN)
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["n_q", "n_splits", "split_tokens"])  # type: ignore[misc]
def _partial(Q, K, V, BT, CTX, O, ML,  # type: ignore[no-untyped-def]
             stride_qt, stride_qh,
             stride_kp, stride_kt, stride_kh,
             stride_vp, stride_vt, stride_vh,
             n_q, n_splits, scale_log2, split_tokens,
             H: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CTX).to(tl.int32)
    q_start = ctx - n_q

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    h = kh * G + rows % G
    row_ok = qi < n_q
    d = tl.arange(0, D)
    q = tl.load(Q + qi[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    q_pos = q_start + qi

    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, ctx)
    last_q = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, n_q * G - 1) // G
    hi = tl.minimum(hi, q_start + last_q + 1)  # no row of this block sees past here

    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        ok = tok < hi
        page = tl.load(BT + tok // PAGE, mask=ok, other=0).to(tl.int64)
        slot = tok % PAGE
        k = tl.load(K + (page * stride_kp + slot * stride_kt + kh * stride_kh)[:, None] + d[None, :],
                    mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        seen = ok[None, :] & (tok[None, :] <= q_pos[:, None])
        s = tl.where(seen, s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + (page * stride_vp + slot * stride_vt + kh * stride_vh)[:, None] + d[None, :],
                    mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # partials: O [splits, n_q, H, D] fp32, ML [2, splits, n_q, H] fp32 (max, sum)
    row = qi * H + h
    tl.store(O + (split * n_q * H + row)[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    tl.store(ML + split * n_q * H + row, m_i, mask=row_ok)
    tl.store(ML + (n_splits + split) * n_q * H + row, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["n_rows", "n_splits"])  # type: ignore[misc]
def _combine(O, ML, OUT, n_rows, n_splits, D: tl.constexpr, BLOCK_S: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    ok = s < n_splits
    m = tl.load(ML + s * n_rows + row, mask=ok, other=NEG)
    l = tl.load(ML + (n_splits + s) * n_rows + row, mask=ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    w = tl.where(ok, w, 0.0)
    d = tl.arange(0, D)
    o = tl.load(O + (s * n_rows + row)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w * l, 0)
    tl.store(OUT + row * D + d, out.to(OUT.dtype.element_ty))


def plan(max_ctx: int, n_q: int, kv_heads: int, group: int) -> Tuple[int, int, int, int]:
    """The launch shape for contexts up to max_ctx: (BLOCK_M, m blocks, splits, tokens
    per split). Splits aim at a few hundred programs over the GPU's 132 SMs."""
    block_n = 64
    block_m = 16 if n_q * group <= 16 else 64
    m_blocks = triton.cdiv(n_q * group, block_m)
    want = max(1, min(64, triton.cdiv(512, kv_heads * m_blocks)))
    split = max(block_n, triton.cdiv(triton.cdiv(max_ctx, want), block_n) * block_n)
    return block_m, m_blocks, triton.cdiv(max_ctx, split), split


class Workspace:
    """The partial results of one launch shape, allocated once (graph-safe reuse)."""

    def __init__(self, max_ctx: int, n_q: int, heads: int, kv_heads: int, head_dim: int, device: Any) -> None:
        self.n_q, self.heads, self.head_dim = n_q, heads, head_dim
        self.block_m, self.m_blocks, self.splits, self.split = plan(max_ctx, n_q, kv_heads, heads // kv_heads)
        self.o = torch.empty(self.splits, n_q, heads, head_dim, dtype=torch.float32, device=device)
        self.ml = torch.empty(2, self.splits, n_q, heads, dtype=torch.float32, device=device)


def paged_attention(q: Any, k_cache: Any, v_cache: Any, block_table: Any, ctx_len: Any, max_ctx: int,
                    out: Any = None, ws: Optional[Workspace] = None, scale: Optional[float] = None) -> Any:
    """softmax(scale q K^T) V of q [q_len, heads, head_dim] over the ctx_len tokens (a
    device int tensor of one element, ctx_len >= q_len, <= max_ctx) the block table
    (int32, at least ceil(max_ctx / page) entries) names; scale defaults to
    1/sqrt(head_dim). Returns [q_len, heads, head_dim] in q's dtype (into out when
    given)."""
    n_q, heads, d = q.shape
    pages, page, kv_heads, d2 = k_cache.shape
    assert d == d2 and heads % kv_heads == 0 and q.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and block_table.dtype == torch.int32
    if ws is None:
        ws = Workspace(max_ctx, n_q, heads, kv_heads, d, q.device)
    assert ws.n_q == n_q
    if out is None:
        out = torch.empty(n_q, heads, d, dtype=q.dtype, device=q.device)
    g = heads // kv_heads
    _partial[(ws.m_blocks, kv_heads, ws.splits)](
        q, k_cache, v_cache, block_table, ctx_len, ws.o, ws.ml,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        n_q, ws.splits, LOG2E * (1.0 / math.sqrt(d) if scale is None else scale), ws.split,
        H=heads, G=g, PAGE=page, D=d, BLOCK_M=ws.block_m, BLOCK_N=64,
        num_warps=4, num_stages=2)
    _combine[(n_q * heads,)](ws.o, ws.ml, out, n_q * heads, ws.splits, D=d,
                             BLOCK_S=triton.next_power_of_2(ws.splits), num_warps=2)
    return out


def reference(q: Any, k_cache: Any, v_cache: Any, block_table: Any, ctx: int, scale: Optional[float] = None) -> Any:
    """The same attention with SDPA over K and V gathered from the pages (a copy), in
    float32; ctx a host int. Where no GPU (or no Triton) is, cudapool.hf attends with
    this."""
    n_q, heads, d = q.shape
    page = k_cache.shape[1]
    kv_heads = k_cache.shape[2]
    t = torch.arange(ctx, device=q.device)
    bt = block_table.long()
    k = k_cache[bt[t // page], t % page]  # [ctx, kv_heads, d]
    v = v_cache[bt[t // page], t % page]
    g = heads // kv_heads
    k = k.float().transpose(0, 1).repeat_interleave(g, 0)  # [heads, ctx, d]
    v = v.float().transpose(0, 1).repeat_interleave(g, 0)
    qpos = ctx - n_q + torch.arange(n_q, device=q.device)
    mask = t[None, :] <= qpos[:, None]  # [n_q, ctx]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k[None], v[None], attn_mask=mask[None, None], scale=scale)
    return o[0].transpose(0, 1)
