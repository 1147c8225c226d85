"""Stock transformers decoder models generating over the KV page pool's pages: it owns
the bookkeeping of a request's pages (which are matched, written, sealed, released),
the transformers Cache that writes K and V into them, and the attention (registered in
transformers' AttentionInterface) that reads them in place through a block table.

    import cudapool.hf as chf, cudapool.kv as kv
    with kv.Replica("/run/kv", device=0) as r:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda:0",
                                                     attn_implementation=chf.register())
        out = chf.cudapool_generate(model, r, input_ids, max_new_tokens=64)   # [1, prompt + new] token ids

A request matches the prompt's full pages (Replica.hashes, match: leased for reading),
allocates pages of its own for the rest (alloc), prefills only those tokens, seals its
full pages once the first token is known (visible to every replica after the prefill's
work completes, and leased again for reading), decodes greedily with attention over
the pages through a block table (a Triton split-K kernel, cudapool.paged_attention;
each step one CUDA graph), and releases every lease after the stream's work. At least
the prompt's last token is computed: a page it falls in is written and sealed again (a
duplicate, freed) when another replica sealed it first. The prompt and the decoded
tokens past its last full page live in private pages, released unsealed.

model.generate works too, over a PoolCache (eager steps, sealed when it is closed):

    with chf.PoolCache.for_request(model, r, input_ids, max_new_tokens=64) as cache:
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64, do_sample=False)

Served: batch one, greedy, models of type llama, mistral, qwen2 and qwen3 whose every
layer attends fully (GQA included), head dims of a power of two up to 256, and a KV
geometry (layers, KV heads, head dim, dtype) equal to the pool's. Anything else is
refused by name (Unsupported, GeometryMismatch), never served: sliding windows,
chunked or linear attention, MLA, cross-attention, attention soft-capping.

The bookkeeping (Pages, refusal, model_geometry) is plain Python; everything else
imports torch and transformers when first used (Triton only on a GPU: elsewhere the
attention gathers the pages and uses SDPA, for tests).
"""

from __future__ import annotations

import threading
import time
from array import array
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Protocol, Sequence,
                    Tuple)

from . import StreamLike
from . import kv as _kv

__all__ = ["ATTENTION", "BUCKET", "SUPPORTED", "Unsupported", "GeometryMismatch", "PagePool", "Pages", "LocalPool",
           "refusal",
           "model_geometry", "check_model", "register", "Generator", "generator", "cudapool_generate",
           "PoolCache"]

ATTENTION = "cudapool_paged"  # the name register() gives the attention in transformers' registry
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")  # model types checked against transformers' own
BUCKET = 4096  # a Generator keeps one decode graph per capacity, a multiple of this many tokens
EXTEND_MAX = 64  # a prompt's rest of at most this many tokens over matched pages is computed by a CUDA graph


class Unsupported(ValueError):
    """A model cudapool.hf cannot serve; the message names what it has."""


class GeometryMismatch(Unsupported):
    """A model whose KV geometry is not the pool's; the message names both."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# --- which models, and their geometry (plain Python: config attributes only) ---------

def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def model_geometry(config: Any) -> Tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers config's KV cache."""
    c = _text_config(config)
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return int(c.num_hidden_layers), int(kv_heads), int(head_dim)


def refusal(config: Any) -> Optional[str]:
    """Why cudapool.hf cannot serve a model of this transformers config (a sentence
    naming it), or None if it can."""
    c = _text_config(config)
    mtype = getattr(c, "model_type", None)
    if getattr(config, "is_encoder_decoder", False) or getattr(c, "is_encoder_decoder", False):
        return "%s is an encoder-decoder model (cross-attention)" % mtype
    if getattr(c, "add_cross_attention", False) or getattr(c, "cross_attention_layers", None):
        return "%s has cross-attention layers" % mtype
    if getattr(c, "kv_lora_rank", None) or getattr(c, "q_lora_rank", None):
        return "%s uses multi-head latent attention (MLA: kv_lora_rank %s)" % (mtype, getattr(c, "kv_lora_rank", None))
    kinds = sorted(set(getattr(c, "layer_types", None) or ["full_attention"]) - {"full_attention"})
    if kinds:
        return "%s has layers of %s, not only full attention" % (mtype, ", ".join(kinds))
    window = getattr(c, "sliding_window", None)
    if window and getattr(c, "use_sliding_window", True):
        return "%s attends within a sliding window of %d tokens" % (mtype, window)
    if getattr(c, "attention_chunk_size", None):
        return "%s attends in chunks of %d tokens" % (mtype, c.attention_chunk_size)
    if getattr(c, "attn_logit_softcapping", None):
        return "%s soft-caps its attention logits (%s)" % (mtype, c.attn_logit_softcapping)
    if mtype not in SUPPORTED:
        return "model type %r is not one cudapool.hf serves (%s)" % (mtype, ", ".join(SUPPORTED))
    layers, kv_heads, head_dim = model_geometry(config)
    if c.num_attention_heads % kv_heads:
        return "%s has %d attention heads, not a multiple of its %d KV heads" % (mtype, c.num_attention_heads, kv_heads)
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return "%s has a head dim of %d: the paged kernel takes powers of two from 16 to 256" % (mtype, head_dim)
    return None


def _geometry_words(layers: int, kv_heads: int, head_dim: int, dtype: str) -> str:
    return "%d layers, %d KV heads, head dim %d, %s" % (layers, kv_heads, head_dim, dtype)


def check_model(config: Any, dtype: str, geometry: _kv.Geometry) -> None:
    """Raises Unsupported if a model of config cannot be served, GeometryMismatch
    (naming both) if its KV geometry with dtype ("bf16", ...) is not geometry's (a
    cudapool.kv.Geometry); returns None when it can be served over that pool."""
    why = refusal(config)
    if why:
        raise Unsupported("cudapool.hf cannot serve this model: " + why)
    mine: Tuple[int, int, int, str] = model_geometry(config) + (dtype,)
    pool = (geometry.layers, geometry.kv_heads, geometry.head_dim, geometry.dtype)
    if mine != pool:
        raise GeometryMismatch("the model's KV geometry (%s) is not the pool's (%s)"
                               % (_geometry_words(*mine), _geometry_words(*pool)))


# --- a request's pages (plain Python: any pool with Replica's calls) ------------------

class PagePool(Protocol):
    """What Pages and Generator use of a pool of KV pages: the calls of
    cudapool.kv.Replica, which LocalPool has too (see theirs)."""

    @property
    def geometry(self) -> _kv.Geometry: ...

    def hashes(self, tokens: Sequence[int]) -> Sequence[bytes]: ...

    def alloc(self, n: int) -> _kv.Lease: ...

    def seal(self, lease: _kv.Lease, hashes: Sequence[bytes], stream: StreamLike = None,
             wait: bool = False) -> _kv.SealResult: ...

    def match(self, hashes: Sequence[bytes], stream: StreamLike = None) -> _kv.Lease: ...

    def release(self, *leases: _kv.Lease, stream: StreamLike = None) -> None: ...

    def kv_caches(self) -> List[Tuple[Any, Any]]: ...


if TYPE_CHECKING:  # mypy checks that both pools are PagePools
    def _page_pools(r: _kv.Replica, local: LocalPool) -> Tuple[PagePool, PagePool]:
        return r, local


class Pages:
    """The pages one request of tokens (prompt token ids) and up to max_new decoded
    tokens reads and writes in pool (a PagePool: a cudapool.kv.Replica, or anything
    with its hashes, match, alloc, seal and release).

    With share, the first shared tokens (default all) are the prefix other requests
    may match: their longest run of visible full pages is leased for reading
    (matched), leaving at least the last token to compute; the rest of their full
    pages are allocated for writing (written) and sealed by seal(). Every other
    position up to len(tokens) + max_new is in private pages, released unsealed.
    Without share nothing is matched or sealed: every page is private (the request
    computed alone). block_table names the request's pages in order; start is the
    first position the model computes; prefix the tokens of the full pages that may be
    matched (matched or not: a request computes them apart from the rest, so that the
    bytes of a sealed page depend on its prefix alone, shared or not). On failure
    (NoSpace, the owner gone) nothing stays leased. release() gives back what is held,
    after stream's work."""

    def __init__(self, pool: PagePool, tokens: Sequence[int], max_new: int, *, shared: Optional[int] = None,
                 share: bool = True, stream: StreamLike = None) -> None:
        if max_new < 0:
            raise ValueError("max_new %d is negative" % max_new)
        n = len(tokens)
        if n == 0:
            raise ValueError("a request needs at least one prompt token")
        shared = n if shared is None else shared
        if not 0 <= shared <= n:
            raise ValueError("shared %d is not within the %d prompt tokens" % (shared, n))
        self.pool, self.stream = pool, stream
        self.T = T = pool.geometry.tokens_per_page
        self.n_tokens, self.capacity = n, n + max_new
        self.hashes: Sequence[bytes] = pool.hashes(tokens[:shared]) if share and shared >= T else []
        self.read: Optional[_kv.Lease] = None
        self.written: Optional[_kv.Lease] = None
        self.private: Optional[_kv.Lease] = None
        self.sealed = self.duplicates = 0
        try:
            usable = min(len(self.hashes), (n - 1) // T)  # the last token is always computed
            if usable:
                self.read = pool.match(self.hashes[:usable], stream=stream)
            self.matched = len(self.read) if self.read is not None else 0
            if len(self.hashes) > self.matched:
                self.written = pool.alloc(len(self.hashes) - self.matched)
            private = _ceil(self.capacity, T) - len(self.hashes)
            if private:
                self.private = pool.alloc(private)
        except BaseException:
            self.release()
            raise
        self.start = self.matched * T
        # the matchable prefix, whether matched or not: a request computes it apart from the rest,
        # so that its pages' bytes depend on nothing after it
        self.prefix = min(shared // T, (n - 1) // T) * T
        self.block_table = [int(p) for lease in (self.read, self.written, self.private)
                            if lease is not None for p in lease.pages]

    @property
    def to_seal(self) -> int:
        """The number of pages seal() will seal (written, not sealed yet)."""
        return len(self.written) if self.written is not None else 0

    def seal(self, stream: StreamLike = None) -> Optional[_kv.SealResult]:
        """Seals the written pages under their prefix hashes, waits until they are
        visible (the work queued on stream so far has completed), then leases the whole
        prefix for reading again and points block_table's first pages at it (the same
        pages, or another replica's where it sealed one first: a duplicate). Returns
        the SealResult, or None if nothing was written. On failure nothing stays
        written; the read lease stays until release()."""
        if self.written is None:
            return None
        w, self.written = self.written, None
        stream = self.stream if stream is None else stream
        res = self.pool.seal(w, self.hashes[self.matched:], stream=stream, wait=True)
        self.sealed, self.duplicates = res.visible, res.duplicates
        again = self.pool.match(self.hashes, stream=stream)
        if len(again) != len(self.hashes):
            self.pool.release(again, stream=stream)
            raise RuntimeError("sealed %d pages, but only %d of the prefix's %d match again"
                               % (len(self.hashes) - self.matched, len(again), len(self.hashes)))
        old, self.read = self.read, again
        self.block_table[:len(again)] = [int(p) for p in again.pages]
        if old is not None:
            self.pool.release(old, stream=stream)
        return res

    def release(self, stream: StreamLike = None) -> None:
        """Gives back every lease still held (a written page unsealed is freed) once
        the work queued on stream (default: the stream given at creation) has
        completed; a second call does nothing. The leases are forgotten even if the
        owner refuses them (its error is raised)."""
        held = [l for l in (self.read, self.written, self.private) if l is not None and len(l)]
        self.read = self.written = self.private = None
        if held:
            self.pool.release(*held, stream=self.stream if stream is None else stream)

    def __enter__(self) -> Pages:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LocalPool:
    """A pool of pages in this process with the calls of cudapool.kv.Replica that
    Pages and Generator use (geometry, hashes, alloc, seal, match, release, kv_caches),
    for where there is no owner: tests, or a replica whose owner died recomputing into
    memory of its own. Pages by index, write leases (alloc, all or none: NoSpace),
    seal (visible at once; a hash sealed already is a duplicate, its page freed),
    match (the longest visible run), release (a lease it does not hold is StaleLease,
    and then none is released). The slab, torch tensors [layers][2][pages][tokens_per_page]
    [kv_heads][head_dim] on device, is made at the first kv_caches. Not thread-safe."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, tokens_per_page: int, pages: int,
                 device: Any = "cpu", dtype: str = "bf16", namespace: str = "") -> None:
        self.geometry = _kv.Geometry(layers, kv_heads, head_dim, dtype, tokens_per_page, pages)
        self.device, self.namespace = device, namespace
        self.free = list(range(pages - 1, -1, -1))
        self.index: Dict[bytes, int] = {}  # hash -> page (sealed)
        self.leases: Dict[int, _kv.Lease] = {}
        self._next = 1
        self._caches: Optional[List[Tuple[Any, Any]]] = None

    def hashes(self, tokens: Iterable[int]) -> _kv.Hashes:
        return _kv.prefix_hashes(list(tokens), self.geometry.tokens_per_page, self.namespace)

    def _lease(self, pages: Iterable[int], writable: bool) -> _kv.Lease:
        lease = _kv.Lease(self._next, array("I", pages), writable)
        self._next += 1
        self.leases[lease.id] = lease
        return lease

    def alloc(self, n: int, timeout: Optional[float] = None) -> _kv.Lease:
        if n > len(self.free):
            raise _kv.NoSpace(29, "%d pages asked, %d free" % (n, len(self.free)))
        return self._lease([self.free.pop() for _ in range(n)], True)

    def seal(self, lease: _kv.Lease, hashes: Sequence[bytes], stream: StreamLike = None, wait: bool = False,
             timeout: Optional[float] = None) -> _kv.SealResult:
        if self.leases.get(lease.id) is not lease or not lease.writable:
            raise _kv.StaleLease(27, "no write lease %d" % lease.id)
        del self.leases[lease.id]
        visible = dup = 0
        for i, p in enumerate(lease.pages):
            if i < len(hashes) and hashes[i] not in self.index:
                self.index[hashes[i]] = p
                visible += 1
            else:
                dup += i < len(hashes)
                self.free.append(p)
        return _kv.SealResult(visible, dup)

    def match(self, hashes: Sequence[bytes], stream: StreamLike = None, timeout: Optional[float] = None) -> _kv.Lease:
        pages: List[int] = []
        for h in hashes:
            if h not in self.index:
                break
            pages.append(self.index[h])
        return self._lease(pages, False) if pages else _kv.Lease(0, array("I"), False)

    def release(self, *leases: _kv.Lease, stream: StreamLike = None, timeout: Optional[float] = None) -> None:
        held = [l for l in leases if l.id]
        for l in held:
            if self.leases.get(l.id) is not l:
                raise _kv.StaleLease(27, "lease %d is not held" % l.id)
        for l in held:
            del self.leases[l.id]
            if l.writable:
                self.free.extend(l.pages)

    def kv_caches(self) -> List[Tuple[Any, Any]]:
        if self._caches is None:
            import torch
            g = self.geometry
            dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[g.dtype])
            slab = torch.zeros(g.layers, 2, g.pages, g.tokens_per_page, g.kv_heads, g.head_dim, dtype=dtype,
                               device=self.device)
            self._caches = [(slab[i, 0], slab[i, 1]) for i in range(g.layers)]
        return self._caches


# --- the torch side: built when first asked for --------------------------------------

class _Parts(NamedTuple):
    """What _build makes once torch and transformers are imported."""
    torch: Any
    PoolCache: Any  # the class
    attention: Callable[..., Any]


_lock = threading.Lock()
_parts: Optional[_Parts] = None
_active = threading.local()  # (cache, key tensor, layer, how) between a Cache update and its attention
_TORCH_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8e4m3"}


def register() -> str:
    """Registers cudapool.hf's attention in transformers' AttentionInterface (once) and
    returns its name, for attn_implementation=. Over any cache but a PoolCache it
    attends as "sdpa" does for one sequence without padding (transformers makes no mask
    for it); a batch is refused (Unsupported)."""
    _torch_parts()
    return ATTENTION


def __getattr__(name: str) -> Any:
    if name == "PoolCache":
        return _torch_parts().PoolCache
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def _dtype_name(dtype: Any) -> str:
    return _TORCH_DTYPE_NAMES.get(str(dtype).replace("torch.", ""), str(dtype))


def _torch_parts() -> _Parts:
    global _parts
    with _lock:
        if _parts is None:
            _parts = _build()
    return _parts


def _build() -> _Parts:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    try:
        from transformers.cache_utils import CacheLayerMixin
    except ImportError:  # transformers before 4.56: a Cache has no layer objects
        CacheLayerMixin = object

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: Optional[float] = None,
                  dropout: float = 0.0, **kwargs: Any) -> Any:
        """transformers' attention interface: over a PoolCache's layer just updated, the
        pages (or, for a prefill from position 0, SDPA over the new keys); otherwise
        transformers' own SDPA, unchanged."""
        step = getattr(_active, "step", None)
        if step is None or step[1] is not key or step[2] != getattr(module, "layer_idx", None):
            if query.shape[0] != 1:  # transformers makes no padding mask for an attention it has no mask for
                raise Unsupported("cudapool.hf's attention serves one sequence, not a batch of %d: use sdpa for "
                                  "batches" % query.shape[0])
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        _active.step = None
        if kwargs.get("sliding_window"):
            raise Unsupported("cudapool.hf cannot serve this model: layer %d attends within a sliding window of %s "
                              "tokens" % (step[2], kwargs["sliding_window"]))
        if kwargs.get("softcap"):
            raise Unsupported("cudapool.hf cannot serve this model: its attention is soft-capped")
        return step[0]._attend(module, query, key, value, step[2], step[3], scaling, dropout, kwargs)

    AttentionInterface.register(ATTENTION, attention)

    class _Layer(CacheLayerMixin):  # type: ignore[misc] # transformers is Any to mypy
        """One layer of a PoolCache, for the parts of transformers that look at layers."""
        is_compileable = False
        is_sliding = False

        def __init__(self, cache: Any, i: int) -> None:
            if CacheLayerMixin is not object:
                try:
                    super().__init__()
                except TypeError:
                    pass
            self.cache, self.i = cache, i
            self.is_initialized = True
            self.keys, self.values = cache.caches[i]

        def lazy_initialization(self, *_: Any) -> None:
            return None

        def update(self, key_states: Any, value_states: Any, cache_kwargs: Any = None) -> Any:
            return self.cache.update(key_states, value_states, self.i, cache_kwargs)

        def get_seq_length(self, *_: Any) -> int:
            return int(self.cache.lengths[self.i])

        def get_mask_sizes(self, *args: Any, **_: Any) -> Any:
            return self.cache.get_mask_sizes(*args, layer_idx=self.i)

        def get_max_cache_shape(self) -> int:
            return int(self.cache.capacity)

        def get_max_length(self) -> int:
            return int(self.cache.capacity)

    def _missing(name: str) -> Callable[..., Any]:
        def missing(self: Any, *_: Any, **__: Any) -> Any:
            raise Unsupported("a PoolCache layer has no %s (a transformers newer than cudapool.hf knows)" % name)
        return missing

    for name in sorted(getattr(_Layer, "__abstractmethods__", ())):  # what another transformers asks of a layer
        setattr(_Layer, name, _missing(name))
    if getattr(_Layer, "__abstractmethods__", None):
        _Layer.__abstractmethods__ = frozenset()

    class PoolCache(Cache):  # type: ignore[misc] # transformers is Any to mypy
        """A transformers Cache over pool pages: layer l's K and V are caches[l]
        (Replica.kv_caches()), a sequence's token t lives in slot t % tokens_per_page
        of page block_table[t // tokens_per_page]. update writes the new K and V there
        (positions from the tokens the layer holds, or, in a decode graph, from a
        device tensor); the attention registered by register() reads them in place.
        Batch one, capacity tokens at most; no beam search (reorder) or cropping."""

        is_compileable = False  # its positions are host counts: transformers must not compile it

        def __init__(self, caches: List[Tuple[Any, Any]], capacity: int, *, block_table: Optional[Sequence[int]] = None,
                     device: Any = None) -> None:
            self.caches = caches
            K = caches[0][0]
            self.T, self.kv_heads, self.head_dim = K.shape[1], K.shape[2], K.shape[3]
            self.device = K.device if device is None else device
            self.capacity = capacity
            self.block_table = torch.zeros(_ceil(capacity, self.T), dtype=torch.int32, device=self.device)
            self.lengths = [0] * len(caches)
            self.pages: Optional[Pages] = None  # the Pages of for_request
            self._static: Optional[Tuple[Any, Any]] = None  # (positions [1] int64, ctx [1] int32) in a graph's step
            self._memo: Optional[Tuple[Tuple[int, int], Any, Any, Dict[Tuple[int, int], Any]]] = None
            self._ws: Dict[Tuple[int, int], Any] = {}
            layers = [_Layer(self, i) for i in range(len(caches))]
            for args in ({"layers": layers}, {}):  # transformers' Cache.__init__ differs by version
                try:
                    super().__init__(**args)
                    break
                except (TypeError, ValueError, AttributeError):
                    continue
            self.layers = layers
            for name, v in (("offloading", False), ("layer_class_to_replicate", None)):
                if not hasattr(self, name):
                    setattr(self, name, v)
            if block_table is not None:
                self.reset(block_table)

        @classmethod
        def for_request(cls, model: Any, pool: PagePool, input_ids: Any, max_new_tokens: int, *,
                        shared: Optional[int] = None, share: bool = True, stream: StreamLike = None) -> Any:
            """A PoolCache for one request of model.generate: Pages of the prompt
            (matched ones held, the rest allocated), the cache holding the matched
            tokens (generate computes only the others). Close it after generate (or
            use it as a context manager): the written pages are sealed, every lease
            released."""
            check_model(model.config, _dtype_name(model.dtype), pool.geometry)
            tokens = _one_sequence(input_ids)
            if stream is None and torch.cuda.is_available() and model.device.type == "cuda":
                stream = torch.cuda.current_stream(model.device)
            pages = Pages(pool, tokens, max_new_tokens, shared=shared, share=share, stream=stream)
            try:
                c = cls(pool.kv_caches(), pages.capacity, device=model.device)
                c.reset(pages.block_table, pages.start)
            except BaseException:
                pages.release()
                raise
            c.pages = pages
            return c

        def reset(self, block_table: Sequence[int], start: int = 0) -> None:
            """Points the cache at a sequence's pages (its first start tokens already
            written there)."""
            if len(block_table) > self.block_table.numel():
                raise ValueError("%d pages do not fit a capacity of %d tokens" % (len(block_table), self.capacity))
            t = torch.tensor(list(block_table), dtype=torch.int32)
            self.block_table.zero_()
            self.block_table[:len(t)].copy_(t)
            self.lengths = [start] * len(self.caches)
            self._memo = None

        def close(self) -> None:
            """Seals the written pages (visible once the stream's work so far has
            completed) and releases every lease of for_request's Pages."""
            p, self.pages = self.pages, None
            if p is not None:
                try:
                    if self.lengths[0] >= p.n_tokens:
                        p.seal()
                finally:
                    p.release()

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            self.close()

        # what transformers asks of a Cache
        def update(self, key_states: Any, value_states: Any, layer_idx: int,
                   cache_kwargs: Any = None) -> Tuple[Any, Any]:
            b, h, q, d = key_states.shape
            if b != 1:
                raise Unsupported("cudapool.hf serves batch one, not %d sequences" % b)
            if (h, d) != (self.kv_heads, self.head_dim):
                raise GeometryMismatch("the model's keys have %d heads of %d, the pool's pages %d of %d"
                                       % (h, d, self.kv_heads, self.head_dim))
            if self._static is not None:
                pos, ctx = self._static
                slots = self.block_table[pos // self.T].long() * self.T + pos % self.T
                how = (ctx, self.capacity, False, self._ws)
            else:
                start = self.lengths[layer_idx]
                if start + q > self.capacity:
                    raise ValueError("%d tokens over %d do not fit the cache's %d" % (q, start, self.capacity))
                m = self._memo  # what every layer of one forward shares
                if m is None or m[0] != (start, q):
                    pos = torch.arange(start, start + q, device=self.device)
                    slots = self.block_table[pos // self.T].long() * self.T + pos % self.T
                    ctx = torch.tensor([start + q], dtype=torch.int32, device=self.device)
                    self._memo = m = ((start, q), slots, ctx, {})
                slots = m[1]
                how = (m[2], start + q, start == 0, m[3])
                self.lengths[layer_idx] = start + q
            K, V = self.caches[layer_idx]
            K.view(-1, h, d).index_copy_(0, slots, key_states[0].transpose(0, 1))
            V.view(-1, h, d).index_copy_(0, slots, value_states[0].transpose(0, 1))
            _active.step = (self, key_states, layer_idx, how)
            return key_states, value_states

        def _attend(self, module: Any, query: Any, key: Any, value: Any, layer: int, how: Tuple[Any, int, bool, Any],
                    scaling: Optional[float], dropout: float, kwargs: Dict[str, Any]) -> Any:
            ctx, max_ctx, fresh, wss = how
            if fresh:  # a prefill from position 0: the new keys are all there is
                kwargs.pop("is_causal", None)
                return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                              is_causal=True, **kwargs)
            K, V = self.caches[layer]
            q = query[0].transpose(0, 1)
            if q.stride(-1) != 1 or q.stride(0) < q.stride(1):
                q = q.contiguous()
            if q.is_cuda:
                from .paged_attention import Workspace, paged_attention
                key_ = (q.shape[0], max_ctx)
                ws = wss.get(key_)
                if ws is None:  # a decode graph's is kept (it captured it), a forward's only for its layers
                    ws = wss[key_] = Workspace(max_ctx, q.shape[0], q.shape[1], self.kv_heads, self.head_dim,
                                                    q.device)
                out = paged_attention(q, K, V, self.block_table, ctx, max_ctx, ws=ws, scale=scaling)
            else:
                from .paged_attention import reference
                out = reference(q, K, V, self.block_table, int(ctx.item()), scale=scaling).to(q.dtype)
            return out[None], None

        def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
            return self.lengths[layer_idx or 0]

        def get_mask_sizes(self, cache_position: Any = None, layer_idx: Optional[int] = 0, *_: Any,
                           **__: Any) -> Tuple[int, int]:
            q = cache_position.shape[0] if hasattr(cache_position, "shape") else int(cache_position or 0)
            return self.lengths[layer_idx or 0] + q, 0

        def get_max_cache_shape(self, layer_idx: int = 0) -> int:
            return self.capacity

        def get_max_length(self) -> int:
            return self.capacity

        @property
        def max_batch_size(self) -> int:
            return 1

        @property
        def max_cache_len(self) -> int:
            return self.capacity

        @property
        def is_sliding(self) -> List[bool]:
            return [False] * len(self.caches)

        def __len__(self) -> int:
            return len(self.caches)

        def _refuse(self, *_: Any, **__: Any) -> Any:
            raise Unsupported("a PoolCache serves one greedy sequence: no beam search, cropping or batch changes")

        reorder_cache = crop = batch_repeat_interleave = batch_select_indices = to_legacy_cache = _refuse

    return _Parts(torch=torch, PoolCache=PoolCache, attention=attention)


def _one_sequence(input_ids: Any) -> List[int]:
    """input_ids ([1, n] tensor, [n] tensor, or a list of ints) as a list of ints."""
    if hasattr(input_ids, "tolist"):
        shape = tuple(input_ids.shape)
        if len(shape) == 2:
            if shape[0] != 1:
                raise Unsupported("cudapool.hf serves batch one, not %d sequences" % shape[0])
            input_ids = input_ids[0]
        elif len(shape) != 1:
            raise ValueError("input_ids of shape %s: want [1, n] or [n]" % (shape,))
        return [int(t) for t in input_ids.tolist()]
    return [int(t) for t in input_ids]


class Generator:
    """Greedy generation of a model over a pool's pages, keeping per capacity (a
    multiple of BUCKET tokens) one PoolCache and one CUDA graph of a whole decode step
    (the model's forward, attention over the pages, the argmax), captured at its first
    use. graphs=False decodes eagerly (the default off a GPU). Use one Generator per
    (model, pool), from one thread at a time."""

    def __init__(self, model: Any, pool: PagePool, *, graphs: Optional[bool] = None) -> None:
        parts = _torch_parts()
        torch = self.torch = parts.torch
        check_model(model.config, _dtype_name(model.dtype), pool.geometry)
        impl = getattr(model.config, "_attn_implementation", None)
        if impl != ATTENTION:
            raise Unsupported("the model attends with %r: load it with attn_implementation=cudapool.hf.register() "
                              "(or call model.set_attn_implementation(cudapool.hf.register()))" % (impl,))
        self.model, self.pool = model, pool
        self.caches = pool.kv_caches()
        self.device = self.caches[0][0].device
        if model.device != self.device:
            raise ValueError("the model is on %s, the pool's pages on %s" % (model.device, self.device))
        self.graphs = (self.device.type == "cuda") if graphs is None else graphs
        import inspect
        params = inspect.signature(model.forward).parameters
        self._extra: Dict[str, Any] = {}
        if "logits_to_keep" in params:
            self._extra["logits_to_keep"] = 1
        self._cache_position = "cache_position" in params
        self._decoders: Dict[int, _Decoder] = {}
        self._extenders: Dict[Tuple[int, int], _Extender] = {}
        self.last: Dict[str, Any] = {}
        self.graph_error: Optional[str] = None  # why a decode graph could not be captured (then decoding is eager)

    def _stream(self) -> Any:
        return self.torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _decoder(self, tokens: int) -> _Decoder:
        cap = _ceil(tokens, BUCKET) * BUCKET
        d = self._decoders.get(cap)
        if d is None:
            d = self._decoders[cap] = _Decoder(self, cap)
        return d

    def _extender(self, dec: _Decoder, q: int) -> _Extender:
        key = (dec.capacity, q)
        e = self._extenders.get(key)
        if e is None:
            e = self._extenders[key] = _Extender(self, dec.cache, q)
        return e

    def _prefill(self, dec: _Decoder, tokens: List[int], start: int) -> Any:
        """The logits [vocab] of the last of tokens[start:] over the cache holding the
        first start: a CUDA graph for a short rest over matched pages, else eagerly."""
        q = len(tokens) - start
        if self.graphs and start > 0 and q <= EXTEND_MAX:
            logits = self._extender(dec, q).run(tokens[start:], start)
            dec.cache.lengths = [len(tokens)] * len(self.caches)
            return logits
        return self.forward(dec.cache, tokens[start:], start).reshape(-1)

    def forward(self, cache: Any, ids: List[int], start: int) -> Any:
        """The model over token ids at positions start.. with cache: logits [1, 1, vocab]
        of the last."""
        torch = self.torch
        t = torch.tensor([ids], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)
        kw = dict(self._extra)
        if self._cache_position:
            kw["cache_position"] = pos
        with torch.no_grad():
            out = self.model(input_ids=t, position_ids=pos[None], past_key_values=cache, use_cache=True, **kw)
        return out.logits[:, -1:]

    def generate(self, input_ids: Any, max_new_tokens: int = 32, *, shared: Optional[int] = None, share: bool = True,
                 stop: Optional[Callable[[], object]] = None, on_decode: Optional[Callable[[], object]] = None) -> Any:
        """Greedy tokens of the model after input_ids over the pool's pages: the prompt
        and the max_new_tokens decoded (the first included), a [1, n] tensor of int64 on
        the model's device. shared: how many leading prompt tokens other requests may
        match and seal (default all); share=False computes the whole prompt into private
        pages (matches and seals nothing). stop: asked every 16 steps, true ends
        decoding early; on_decode: called once decoding starts. self.last says what
        happened (ttft_s, first_logits, matched_pages, computed_tokens, sealed,
        duplicates, decode_tok_s, interrupted, tokens). On failure every lease is released."""
        torch = self.torch
        tokens = _one_sequence(input_ids)
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1, not %r" % (max_new_tokens,))
        n = len(tokens)
        dec = self._decoder(n + max_new_tokens)
        stream = self._stream()
        info: Dict[str, Any] = {"prompt": n}
        self.last = info
        self._sync()
        t0 = time.perf_counter()
        pages = Pages(self.pool, tokens, max_new_tokens, shared=shared, share=share, stream=stream)
        try:
            info["matched_pages"] = pages.matched
            info["computed_tokens"] = n - pages.start
            info["hashes"] = len(pages.hashes)
            cache = dec.cache
            cache.reset(pages.block_table, pages.start)
            start = pages.start
            if start < pages.prefix:  # the prefix apart from the rest: the same bytes, matched or computed
                self.forward(cache, tokens[start:pages.prefix], start)
                start = pages.prefix
            logits = self._prefill(dec, tokens, start)
            first = int(torch.argmax(logits))  # a host sync: the first token is known
            info["ttft_s"] = time.perf_counter() - t0
            info["first_logits"] = logits.clone()
            res = pages.seal(stream)  # None if nothing was written
            if res is not None:
                info["sealed"], info["duplicates"] = res.visible, res.duplicates
                cache.block_table[:len(pages.hashes)].copy_(torch.tensor(pages.block_table[:len(pages.hashes)],
                                                                         dtype=torch.int32))
            if on_decode is not None:
                on_decode()
            toks, step_s = dec.run(first, n, max_new_tokens, stop=stop)
            info["decode_tok_s"] = 1.0 / step_s if step_s else 0.0
            info["interrupted"] = len(toks) < max_new_tokens
            info["tokens"] = toks
        finally:
            try:
                pages.release(stream)
            except Exception as e:  # the owner may be gone: there is nothing to give back
                info["release_error"] = "%s: %s" % (type(e).__name__, e)
        return torch.tensor([tokens + toks], dtype=torch.long, device=self.device)

    def warm(self, lengths: Iterable[int], max_new_tokens: int) -> None:
        """Builds (and captures) the decode graphs of requests of these prompt lengths
        on private pages, so that no later timing includes them."""
        T = self.pool.geometry.tokens_per_page
        for n in lengths:
            dec = self._decoder(n + max_new_tokens)
            pages = Pages(self.pool, [1] * (2 * T), 4, share=False, stream=self._stream())
            try:
                dec.cache.reset(pages.block_table, 0)
                for _ in range(2):  # eager, then captured (a prompt's last page over matched ones)
                    logits = self._prefill(dec, [1] * (2 * T), T)
                dec.run(int(self.torch.argmax(logits)), 2 * T, 4)
            finally:
                pages.release()


def _capture(gen: Generator, body: Callable[[], object]) -> Any:
    """body() captured in a CUDA graph, or None (and gen.graphs off, saying why in
    gen.graph_error) if it cannot be."""
    torch = gen.torch
    torch.cuda.synchronize(gen.device)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            body()
    except Exception as e:  # run eagerly, and say why
        gen.graphs = False
        gen.graph_error = "%s: %s" % (type(e).__name__, e)
        torch.cuda.synchronize(gen.device)
        return None
    return g


def _eager(gen: Generator, body: Callable[[], object]) -> None:
    """body() once, on a side stream on a GPU (what a capture must follow)."""
    torch = gen.torch
    if gen.device.type != "cuda":
        body()
        return
    side = torch.cuda.Stream(gen.device)
    side.wait_stream(torch.cuda.current_stream(gen.device))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(gen.device).wait_stream(side)


class _Extender:
    """The model's forward of q tokens over a PoolCache's pages as one CUDA graph (the
    tokens, their positions and the sequence's length are device inputs): a prompt's
    last page over its matched ones costs one launch. The first run is eager, the
    graph is captured after it."""

    def __init__(self, gen: Generator, cache: Any, q: int) -> None:
        torch = gen.torch
        self.gen, self.cache, self.q, self.torch = gen, cache, q, torch
        self.ids = torch.zeros(q, dtype=torch.long, device=gen.device)
        self.pos = torch.zeros(q, dtype=torch.long, device=gen.device)
        self.ctx = torch.zeros(1, dtype=torch.int32, device=gen.device)
        self.graph: Any = None
        self.logits: Any = None

    def _body(self) -> None:
        gen, c = self.gen, self.cache
        c._static = (self.pos, self.ctx)
        try:
            out = gen.model(input_ids=self.ids.view(1, -1), position_ids=self.pos.view(1, -1), past_key_values=c,
                            use_cache=True, **gen._extra)
        finally:
            c._static = None
        self.logits = out.logits[0, -1]

    def run(self, ids: List[int], start: int) -> Any:
        """The logits [vocab] of the last of ids (q tokens at positions start..)."""
        torch = self.torch
        if len(ids) != self.q or start + self.q > self.cache.capacity:
            raise ValueError("%d tokens at %d: this graph takes %d within %d" % (len(ids), start, self.q,
                                                                              self.cache.capacity))
        self.ids.copy_(torch.tensor(ids, dtype=torch.long))
        self.pos.copy_(torch.arange(start, start + self.q))
        self.ctx.fill_(start + self.q)
        with torch.no_grad():
            if self.graph is not None and self.gen.graphs:
                self.graph.replay()
                return self.logits
            _eager(self.gen, self._body)
            out = self.logits.clone()
            if self.gen.graphs:
                self.graph = _capture(self.gen, self._body)
        return out


class _Decoder:
    """Greedy decoding of one sequence a token a step from static buffers over a
    PoolCache of capacity tokens: the first step eager (compiles and plans), the others
    replays of one CUDA graph of the whole step (or eager steps without graphs)."""

    def __init__(self, gen: Generator, capacity: int) -> None:
        torch = gen.torch
        self.gen, self.capacity, self.torch = gen, capacity, torch
        dev = gen.device
        self.cache = _torch_parts().PoolCache(gen.caches, capacity, device=dev)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.ctx = torch.zeros(1, dtype=torch.int32, device=dev)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.hist = torch.zeros(capacity, dtype=torch.long, device=dev)
        self.graph: Any = None

    def _step(self) -> None:
        gen, c = self.gen, self.cache
        kw = dict(gen._extra)
        if gen._cache_position:
            kw["cache_position"] = self.pos
        c._static = (self.pos, self.ctx)
        try:
            out = gen.model(input_ids=self.tok.view(1, 1), position_ids=self.pos.view(1, 1), past_key_values=c,
                            use_cache=True, **kw)
        finally:
            c._static = None
        nxt = self.torch.argmax(out.logits[0, -1], dim=-1, keepdim=True)
        self.hist.index_copy_(0, self.step, nxt)
        self.tok.copy_(nxt)
        self.pos += 1
        self.ctx += 1
        self.step += 1

    def run(self, first: int, start: int, n: int,
            stop: Optional[Callable[[], object]] = None) -> Tuple[List[int], float]:
        """Feeds token first at position start (the cache holds 0..start-1) and decodes
        until n tokens (first included) are known or stop() says so (asked every 16
        steps). Returns the tokens and the seconds per step after the first."""
        torch = self.torch
        if start + n > self.capacity:
            raise ValueError("%d + %d tokens do not fit a capacity of %d" % (start, n, self.capacity))
        self.tok.fill_(first)
        self.pos.fill_(start)
        self.ctx.fill_(start + 1)
        self.hist[0] = first
        self.step.fill_(1)
        if n == 1:
            return [first], 0.0
        cuda = self.gen.device.type == "cuda"
        with torch.no_grad():
            done = 0
            if self.graph is None or not self.gen.graphs:
                _eager(self.gen, self._step)
                done = 1
                if self.gen.graphs:  # the capture runs nothing: the state is the eager step's
                    self.graph = _capture(self.gen, self._step)
            self.gen._sync()
            t0 = time.perf_counter()
            steps = n - 1 - done
            for i in range(n - 1 - done):
                if stop is not None and i % 16 == 0:
                    if cuda:
                        torch.cuda.current_stream(self.gen.device).synchronize()
                    if stop():
                        steps = i
                        break
                if self.gen.graphs:
                    self.graph.replay()
                else:
                    self._step()
            self.gen._sync()
            dt = time.perf_counter() - t0
        k = 1 + done + steps
        self.cache.lengths = [start + k - 1] * len(self.cache.caches)
        return self.hist[:k].tolist(), dt / max(steps, 1)


_GENERATORS = "_cudapool_generators"  # the model's attribute: {id(pool): Generator}


def generator(model: Any, pool: PagePool) -> Generator:
    """The Generator of (model, pool), made at the first call and kept by the model (it
    goes with the model; make a new one, or call this again, for a new pool)."""
    gens = getattr(model, _GENERATORS, None)
    if gens is None:
        gens = {}
        setattr(model, _GENERATORS, gens)
    gen = gens.get(id(pool))
    if gen is None or gen.pool is not pool:
        gen = gens[id(pool)] = Generator(model, pool)
    return gen


def cudapool_generate(model: Any, pool: PagePool, input_ids: Any, max_new_tokens: int = 32, **kwargs: Any) -> Any:
    """Greedy generation of model after input_ids over pool's pages (Generator.generate
    of generator(model, pool)): a [1, prompt + max_new_tokens] tensor of token ids."""
    return generator(model, pool).generate(input_ids, max_new_tokens, **kwargs)
