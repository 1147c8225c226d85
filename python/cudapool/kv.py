"""The KV page pool from Python: a replica of an owner (cmd/kvpoold) that maps the
owner's slab once and leases its pages by index (ctypes over
libcudapool's KV calls).

    r = cudapool.kv.Replica("/run/kv", device=0, namespace="llama")
    hashes = r.hashes(prompt_tokens)           # one prefix hash per full page
    hit = r.match(hashes, stream=s)            # the longest visible run, leased for reading
    ... attention reads pages hit.pages on s ...
    new = r.alloc(len(hashes) - len(hit))      # a write lease
    ... kernels on s write K and V of pages new.pages ...
    r.seal(new, hashes[len(hit):], stream=s)   # visible once s's work so far is done
    r.release(hit, stream=s)                   # after s's reads
    caches = r.kv_caches()                     # per layer (K, V) torch tensors over the slab
    k, v = r.layer_ptrs(0)                     # or layer 0's K and V device addresses

Each layer's K (and V) is one tensor [pages, tokens_per_page, kv_heads, head_dim] of
the geometry's dtype (the FlashAttention / FlashInfer paged layout), contiguous, and a
page index names the same block in every layer. The slab is on the VMM route: one
range of addresses per tensor (a region; Replica.regions lists them: K0, V0, K1, ...),
whatever its size, into which the owner maps chunks as the slab grows (a page a lease
names is always mapped), so there is no one slab address: use layer_ptrs or
kv_caches. prefix_hashes is the pure-Python reference of the hashes (Replica.hashes
computes the same in Go). Only kv_caches imports torch.

The slab is the unit of trust, as the pool is for shared buffers: every replica maps
its owner's whole slab read-write and can read or overwrite any page, whatever its
namespace. The namespace only seeds the prefix hashes (two models' equal tokens hash
apart); the owner does not enforce it. Run one owner (one kvpoold -dir) per trust
domain.

Timeouts are seconds: None is no bound, 0 is do not wait (an owner that is not there
fails at once), and a Replica's calls default to its own timeout (REPLICA_TIMEOUT).
Every call may raise Gone once the owner is gone, Closed after close, Timeout when its
timeout ran out (the call then holds nothing), TypeError and ValueError for bad
arguments before the library sees them, and InvalidArgument for those it refuses.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
import sys
import threading
from array import array
from dataclasses import dataclass
from typing import (Any, Callable, Dict, Iterable, List, Optional, SupportsIndex, Tuple, Type, TypeVar, Union,
                    overload)

from . import StreamLike, _dlpack, _lib, stream_handle
from ._lib import Closed, Gone, NoSpace, StaleLease  # noqa: F401 (re-exported)

__all__ = ["Geometry", "Hashes", "Lease", "SealResult", "Region", "Replica", "prefix_hashes", "query_stats", "root",
           "HASH_BYTES", "MAX_BATCH", "DEFAULT_TIMEOUT", "REPLICA_TIMEOUT", "NoSpace", "StaleLease", "Gone",
           "Closed"]

HASH_BYTES = 16
MAX_BATCH = 4096  # pages (or hashes, or leases) per request
DEFAULT_TIMEOUT = 30.0

# dtype name: (C enum value, bytes per element).
DTYPES = {"bf16": (1, 2), "fp16": (2, 2), "fp32": (3, 4), "fp8e4m3": (4, 1)}
_DTYPE_NAMES = {code: name for name, (code, _) in DTYPES.items()}

_ROOT_PREFIX = b"cudapool/kv/v1\x00"
_ONE_HASH = "%ds" % HASH_BYTES  # a struct format

if array("i").itemsize != 4:  # pragma: no cover (no such CPython platform today)
    raise ImportError("cudapool.kv needs a 4-byte C int for token ids")


Tokens = Iterable[int]  # int32 token ids: a sequence of ints, array('i'), a buffer of 4-byte ints
# Prefix hashes as match and seal take them: Hashes, any iterable of 16-byte bytes, or
# their bytes joined.
HashesLike = Union[Iterable[bytes], bytes, bytearray, memoryview]
PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


class Hashes(list[bytes]):
    """A list of 16-byte prefix hashes that cannot change, carrying them joined, so
    that match and seal send them without joining and checking each one again.
    prefix_hashes and Replica.hashes return one; any list of 16-byte bytes works too."""

    __slots__ = ("raw",)

    def __init__(self, raw: Union[bytes, bytearray, memoryview]) -> None:
        raw = bytes(raw)
        if len(raw) % HASH_BYTES:
            raise ValueError("%d bytes are not a whole number of %d-byte hashes" % (len(raw), HASH_BYTES))
        super().__init__(struct.unpack(_ONE_HASH * (len(raw) // HASH_BYTES), raw))  # split in C
        self.raw = raw

    @overload
    def __getitem__(self, i: SupportsIndex) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> Hashes: ...

    def __getitem__(self, i: Union[SupportsIndex, slice]) -> Union[bytes, Hashes]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1:
                return Hashes(self.raw[start * HASH_BYTES:max(start, stop) * HASH_BYTES])
            return Hashes(b"".join(super().__getitem__(i)))
        return super().__getitem__(i)

    def _frozen(self, *_: Any, **__: Any) -> Any:
        raise TypeError("Hashes cannot change: make a list of it (list(h)) to edit")

    # list's methods that change it, each raising TypeError (so not list's signatures)
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _frozen  # type: ignore[assignment]
    append = extend = insert = pop = remove = clear = sort = reverse = _frozen  # type: ignore[assignment]

    def __reduce__(self) -> Tuple[Type[Hashes], Tuple[bytes]]:
        return (Hashes, (self.raw,))


def root(namespace: Union[str, bytes] = "") -> bytes:
    """The hash before a namespace's first page: SHA-256("cudapool/kv/v1\\0" + namespace)[:16]."""
    return hashlib.sha256(_ROOT_PREFIX + _namespace_bytes(namespace)).digest()[:HASH_BYTES]


def prefix_hashes(tokens: Tokens, tokens_per_page: int, namespace: Union[str, bytes] = "",
                  reference: bool = False) -> Hashes:
    """The prefix hash of each full page of tokens, as kv.PrefixHashes computes it:
    h_i = SHA-256(h_{i-1} || le32(tok[i*T]) || ... || le32(tok[i*T+T-1]))[:16],
    h_{-1} = root(namespace). A trailing partial page gets none. Token ids are int32
    (their little-endian uint32 bits are hashed). The library computes them where it
    loads (cudapool_kv_prefix_hashes: no runtime, no owner needed), else hashlib does;
    reference=True always takes hashlib, the pure-Python reference."""
    t = _page_size(tokens_per_page)
    if not reference:
        fast = _library_hashes(tokens, t, _namespace_bytes(namespace))
        if fast is not None:
            return fast
    raw = _token_bytes(tokens)
    h = root(namespace)
    out = bytearray()
    step = 4 * t
    for i in range(0, len(raw) - step + 1, step):
        h = hashlib.sha256(h + raw[i:i + step]).digest()[:HASH_BYTES]
        out += h
    return Hashes(out)


_prefix_fn: Any = None  # the library's cudapool_kv_prefix_hashes, False if it has none


def _library_hashes(tokens: Tokens, t: int, ns: bytes) -> Optional[Hashes]:
    """prefix_hashes through the library, or None where it does not load or lacks the
    call (or t is past its uint32)."""
    global _prefix_fn
    if _prefix_fn is None:
        try:
            f = _lib.lib().cudapool_kv_prefix_hashes
        except (OSError, AttributeError, _lib.CudapoolError):
            f = False
        else:
            f.argtypes = (ctypes.c_char_p, _lib.size_t, _lib.vp, _lib.size_t, ctypes.c_uint32, _lib.vp, _lib.size_t,
                          ctypes.POINTER(_lib.size_t))
            f.restype = _lib.c_int
        _prefix_fn = f
    if not _prefix_fn or t >= 1 << 32:
        return None
    raw = _token_bytes(tokens, "=")
    n_tokens = len(raw) // 4
    cap = n_tokens // t
    out = ctypes.create_string_buffer(max(cap, 1) * HASH_BYTES)
    n = _lib.size_t()
    status = _prefix_fn(ns, len(ns), raw if n_tokens else None, n_tokens, t, out, cap, ctypes.byref(n))
    if status != 0:
        raise _lib.error(status)
    return Hashes(out.raw[:n.value * HASH_BYTES])


def _namespace_bytes(namespace: Union[str, bytes, bytearray]) -> bytes:
    if isinstance(namespace, str):
        return namespace.encode()
    if isinstance(namespace, (bytes, bytearray)):
        return bytes(namespace)
    raise TypeError("namespace must be a str, not %s" % type(namespace).__name__)


def _page_size(tokens_per_page: int) -> int:
    if not isinstance(tokens_per_page, int) or isinstance(tokens_per_page, bool) or tokens_per_page <= 0:
        raise ValueError("tokens_per_page must be a positive int, not %r" % (tokens_per_page,))
    return tokens_per_page


def _token_bytes(tokens: Tokens, order: str = "<") -> bytes:
    """tokens, int32 token ids, as bytes in order ("<" little-endian, "=" native): from
    a sequence of ints, an array('i') or a buffer of 4-byte ints (numpy int32, ...)."""
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError("tokens must be int32 token ids, not %s" % type(tokens).__name__)
    a: array[int]
    if isinstance(tokens, array) and tokens.typecode == "i":
        a = tokens
    else:
        try:
            mv = memoryview(tokens)  # type: ignore[arg-type] # a buffer of 4-byte ints, or TypeError
        except TypeError:
            mv = None
        if mv is not None:
            a = _buffer_ints(mv)
        else:
            seq = tokens if isinstance(tokens, (list, tuple)) else list(tokens)
            try:
                return struct.pack("%s%di" % (order, len(seq)), *seq)
            except struct.error:
                a = _array_ints(seq)  # to say what is wrong
    if order == "<" and sys.byteorder != "little":
        a = array("i", a)
        a.byteswap()
    return a.tobytes()


def _buffer_ints(mv: memoryview) -> array[int]:
    native = "@=" + ("<" if sys.byteorder == "little" else ">")
    if mv.itemsize != 4 or mv.format.lstrip(native) != "i":
        raise TypeError("tokens must be int32 token ids, not a buffer of format %r" % mv.format)
    if not mv.c_contiguous:
        raise ValueError("a buffer of tokens must be C-contiguous")
    a = array("i")
    a.frombytes(mv.cast("B"))
    return a


def _array_ints(tokens: Iterable[int]) -> array[int]:
    try:
        return array("i", tokens)
    except OverflowError:
        raise ValueError("a token id does not fit int32") from None
    except TypeError as e:
        raise TypeError("tokens must be int32 token ids: %s" % e) from None


@dataclass(frozen=True)
class Geometry:
    """The KV geometry of an owner's slab: per layer, K and V of pages pages of
    tokens_per_page tokens of kv_heads x head_dim elements of dtype ("bf16", "fp16",
    "fp32" or "fp8e4m3"). Each layer's K (and V) is one tensor [pages]
    [tokens_per_page][kv_heads][head_dim], row-major, a region of the slab of its own
    (Replica.layer_ptrs says where)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_page: int
    pages: int

    @property
    def dtype_size(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def page_bytes(self) -> int:
        """One layer's K (or V) of one page: the block a page index names in each of the
        layers * 2 tensors."""
        return self.tokens_per_page * self.kv_heads * self.head_dim * self.dtype_size

    @property
    def tensor_bytes(self) -> int:
        """One layer's K (or V) tensor: pages * page_bytes."""
        return self.pages * self.page_bytes

    @property
    def page_span_bytes(self) -> int:
        """One page in every layer's K and V (layers * 2 * page_bytes): what a page
        holds of the slab, kvpoold's "page span"."""
        return self.layers * 2 * self.page_bytes

    @property
    def slab_bytes(self) -> int:
        """The whole slab at its bound, every tensor: layers * 2 * tensor_bytes."""
        return self.layers * 2 * self.tensor_bytes


@dataclass(frozen=True)
class Region:
    """One region of a replica's slab in this process, one tensor's (K0, V0, K1, ...):
    its device address ptr and the bytes of addresses it reserves, size (at least the
    tensor's), of which the owner's chunks map the first as the slab grows."""

    ptr: int
    size: int


@dataclass(frozen=True)
class SealResult:
    """What a seal did: pages made visible now (all of them with wait) and pages whose
    hash was visible already (freed, not indexed)."""

    visible: int
    duplicates: int


class Lease:
    """Pages leased from the owner: for writing (alloc) or reading (match). pages is an
    array('I') of page indices; id is the owner's lease id (0 for a match that found
    nothing, which holds no lease)."""

    __slots__ = ("pages", "id", "writable", "_replica")

    def __init__(self, lease_id: int, pages: array[int], writable: bool, replica: Optional[Replica] = None) -> None:
        self.id, self.pages, self.writable, self._replica = lease_id, pages, writable, replica

    def __len__(self) -> int:
        return len(self.pages)

    @property
    def lost(self) -> Optional[StaleLease]:
        """Why an owner's restart lost the lease, as a StaleLease exception (not
        raised), or None while the replica holds it, as Go's Lease.Lost.

        Only a Replica made with reconnect loses leases: the restarted owner did not
        take this one back, and its pages may be another replica's already, so do not
        read or write them. Sealing or releasing it raises that StaleLease and ends
        it. Once the lease ended (sealed, released, the replica closed), and for a
        Lease of len 0, lost is None.
        """
        r = self._replica
        if not self.id or r is None or not r._r.h:
            return None
        try:
            why = _lib.call_sized("cudapool_kv_lease_lost", r._r, self.id, cap=256)
        except (StaleLease, Closed):
            return None  # ended, or the replica closed meanwhile
        return StaleLease(27, why.decode(errors="replace")) if why else None

    def __repr__(self) -> str:
        shown = ", ".join(str(p) for p in self.pages[:8]) + (", ..." if len(self.pages) > 8 else "")
        return "<cudapool.kv.Lease %s id=%#x pages=[%s] (%d)>" % (
            "write" if self.writable else "read", self.id, shown, len(self.pages))


class _Replica(ctypes.Structure):
    _fields_ = [("h", _lib.u64)]


class _Geometry(ctypes.Structure):
    _fields_ = [("size", _lib.size_t)] + [
        (name, ctypes.c_int32) for name in (
            "layers", "kv_heads", "head_dim", "tokens_per_page", "dtype", "dtype_size", "pages", "device")
    ] + [("page_bytes", _lib.u64), ("slab_bytes", _lib.u64), ("region_bytes", _lib.u64),
         ("regions", ctypes.c_int32), ("page_span_bytes", _lib.u64)]


_u32p = ctypes.POINTER(ctypes.c_uint32)
_u64p = ctypes.POINTER(_lib.u64)
_SIGNATURES = {
    "cudapool_kv_dial": (_lib.cstr, _lib.c_int, ctypes.c_char_p, _lib.size_t, _lib.c_int, _lib.i64,
                         ctypes.POINTER(_Replica)),
    "cudapool_kv_geometry_get": (_Replica, ctypes.POINTER(_Geometry)),
    "cudapool_kv_layer_ptrs": (_Replica, ctypes.c_int32, ctypes.POINTER(_lib.vp), ctypes.POINTER(_lib.vp)),
    "cudapool_kv_regions": (_Replica, ctypes.POINTER(_lib.vp), _u64p, _lib.size_t, ctypes.POINTER(_lib.size_t)),
    "cudapool_kv_hashes": (_Replica, _lib.vp, _lib.size_t, _lib.vp, _lib.size_t, ctypes.POINTER(_lib.size_t)),
    "cudapool_kv_alloc": (_Replica, ctypes.c_uint32, _lib.i64, _u64p, _u32p),
    "cudapool_kv_seal": (_Replica, _lib.u64, ctypes.c_char_p, _lib.size_t, _lib.vp, _lib.c_int, _lib.i64,
                         _u32p, _u32p),
    "cudapool_kv_match": (_Replica, ctypes.c_char_p, _lib.size_t, _lib.vp, _lib.i64, _u64p, _u32p,
                          ctypes.POINTER(_lib.size_t)),
    "cudapool_kv_release": (_Replica, _u64p, _lib.size_t, _lib.vp, _lib.i64),
    "cudapool_kv_done_fd": (_Replica, ctypes.POINTER(_lib.c_int)),
    "cudapool_kv_alive": (_Replica, ctypes.POINTER(_lib.c_int)),
    "cudapool_kv_error": (_Replica, ctypes.c_char_p, _lib.size_t, ctypes.POINTER(_lib.size_t)),
    "cudapool_kv_lease_lost": (_Replica, _lib.u64, ctypes.c_char_p, _lib.size_t, ctypes.POINTER(_lib.size_t)),
    "cudapool_kv_stats": (_Replica, _lib.i64, ctypes.c_char_p, _lib.size_t, ctypes.POINTER(_lib.size_t)),
    "cudapool_kv_query_stats": (_lib.cstr, _lib.i64, ctypes.c_char_p, _lib.size_t, ctypes.POINTER(_lib.size_t)),
    "cudapool_kv_close": (_Replica, _lib.i64),
    "cudapool_kv_reattaches": (_Replica, _u64p),
    "cudapool_kv_wait_attached": (_Replica, _lib.i64),
}

# The flags of cudapool_kv_dial.
_DIAL_WAIT_FOR_OWNER = 1
_DIAL_RECONNECT = 2

_lib_kv: Any = None
_load_lock = threading.Lock()


class _ReplicaTimeout:
    """The default of every Replica call's timeout: the Replica's own (its constructor's
    timeout). None is no bound and 0 do not wait, as everywhere in cudapool."""

    def __repr__(self) -> str:
        return "<the replica's timeout>"


REPLICA_TIMEOUT = _ReplicaTimeout()
# A Replica call's timeout: seconds, None (no bound), or REPLICA_TIMEOUT (the replica's).
TimeoutArg = Union[float, None, _ReplicaTimeout]


def _kvlib() -> Any:
    """The library with the KV calls' prototypes set (once)."""
    global _lib_kv
    if _lib_kv is None:
        with _load_lock:
            if _lib_kv is None:
                l = _lib.lib()
                for name, args in _SIGNATURES.items():
                    f = getattr(l, name)
                    f.argtypes = args
                    f.restype = _lib.c_int
                _lib_kv = l
    return _lib_kv


def query_stats(dir: PathLike, timeout: Optional[float] = DEFAULT_TIMEOUT) -> Dict[str, Any]:
    """The statistics of the owner serving dir (as Replica.stats gives them), asked as an
    observer: a connection that maps no slab and takes no leases, so it needs no GPU and
    no Replica.

    Parameters
    ----------
    dir : str or os.PathLike
        The owner's directory (kvpoold -dir).
    timeout : float or None
        Seconds to wait for the answer; None waits without bound, 0 does not wait.

    Raises
    ------
    Gone
        No owner serves dir.
    ValueError, TypeError
        A bad dir or timeout.
    """
    path = os.fsencode(dir)
    if b"\0" in path:
        raise ValueError("dir %r has a NUL byte" % (dir,))
    if not path:
        raise ValueError("dir is empty")
    _kvlib()
    st: Dict[str, Any] = json.loads(_lib.call_sized("cudapool_kv_query_stats", path, _lib.timeout_ms(timeout)))
    return st


def _stream(stream: StreamLike) -> Optional[int]:
    return stream_handle(stream) or None


def _count(n: int, what: str) -> int:
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError("%s must be an int, not %s" % (what, type(n).__name__))
    if n < 0:
        raise ValueError("%s %d is negative" % (what, n))
    if n > MAX_BATCH:
        raise ValueError("%s %d is over MAX_BATCH (%d pages per request)" % (what, n, MAX_BATCH))
    return n


def _hash_bytes(hashes: HashesLike) -> Tuple[bytes, int]:
    """hashes (a Hashes, a list of 16-byte bytes, or their bytes joined) as (bytes, n)."""
    if isinstance(hashes, Hashes) and len(hashes.raw) == HASH_BYTES * len(hashes):
        raw = hashes.raw
    elif isinstance(hashes, (bytes, bytearray, memoryview)):
        raw = bytes(hashes)
        if len(raw) % HASH_BYTES:
            raise ValueError("%d bytes of hashes are not a whole number of %d-byte hashes"
                             % (len(raw), HASH_BYTES))
    else:
        hs = list(hashes)
        try:
            raw = b"".join(hs)
        except TypeError:
            raise TypeError("hashes must be bytes of %d each" % HASH_BYTES) from None
        if len(raw) != HASH_BYTES * len(hs) or (hs and min(map(len, hs)) != HASH_BYTES):
            bad = next(i for i, h in enumerate(hs) if len(h) != HASH_BYTES)
            raise ValueError("hash %d is %d bytes, not %d" % (bad, len(hs[bad]), HASH_BYTES))
    n = len(raw) // HASH_BYTES
    _count(n, "the number of hashes")
    return raw, n


class Replica:
    """A replica of the KV page pool's owner serving dir (its kv.sock and slab.sock), on
    device: the owner's slab for that device mapped into this process, and page leases.

    Methods are safe for concurrent use. A process holds one Replica of an owner at a
    time. Close it (or use it as a context manager): the slab is unmapped, and tensors
    from kv_caches must not be used after.

    Parameters
    ----------
    dir : str or os.PathLike
        The directory the owner serves (kvpoold -dir).
    device : int
        The device whose slab this replica maps.
    namespace : str or bytes
        Seeds the prefix hashes (hashes, prefix_hashes). It is no boundary: any
        replica of the owner maps the whole slab, read-write, whatever its namespace;
        one owner per trust domain is.
    timeout : float or None
        Seconds the dial may take, and every call's default: None is no bound, 0 is do
        not wait.
    wait_for_owner : bool
        Wait (up to timeout) for an owner that has not started yet.
    reconnect : bool
        Reattach by itself to an owner restarted on dir (kvpoold over its keeper),
        without a new process or CUDA context: once the owner is lost, alive is False
        and calls raise Gone while it redials and re-declares its leases; then they
        work again (wait_attached, reattaches). A lease the new owner did not take
        back is lost (Lease.lost says why): do not read or write its pages; releasing
        or sealing it raises StaleLease and ends it. A lease whose release or seal
        raised Gone is still held, and re-declared: the restarted owner holds its pages
        until you make the call again once attached (wait_attached, then release or
        seal it) or close the replica. Catching Gone and dropping the lease leaks its
        pages until then.

    Attributes
    ----------
    geometry : Geometry
        The slab's geometry: layers, kv_heads, head_dim, dtype, tokens_per_page,
        pages, and the sizes of a page (page_bytes, page_span_bytes) and a tensor.
    regions : tuple of Region
        The slab's regions in this process, one per tensor, in order (K0, V0, K1, ...):
        layer l's K is regions[2 * l], its V regions[2 * l + 1]. Without torch, layer_ptrs is how
        kernels address pages: page p of layer l's K starts at layer_ptrs(l)[0] +
        p * geometry.page_bytes.
    device : int
        The device given.
    namespace : str or bytes
        The namespace given.
    timeout : float or None
        The timeout given: every call's default.

    Raises
    ------
    Gone
        No owner serves dir (without wait_for_owner, or with timeout 0).
    Timeout
        wait_for_owner waited timeout seconds for none.
    Refused, VersionMismatch, ProtocolError
        The owner did not admit this process, speaks another version, or broke the
        protocol.
    DuplicateImporter
        This process holds a Replica of that owner already.
    ValueError, TypeError
        A bad dir, device, namespace or timeout.
    """

    def __init__(self, dir: PathLike, device: int = 0, *, namespace: Union[str, bytes] = "",
                 timeout: Optional[float] = DEFAULT_TIMEOUT, wait_for_owner: bool = False,
                 reconnect: bool = False) -> None:
        path = os.fsencode(dir)
        if b"\0" in path:
            raise ValueError("dir %r has a NUL byte" % (dir,))
        if not path:
            raise ValueError("dir is empty")
        if not isinstance(device, int) or device < 0:
            raise ValueError("device must be a non-negative int, not %r" % (device,))
        ns = _namespace_bytes(namespace)
        self.timeout, self.device, self.namespace = timeout, device, namespace
        self._ms = _lib.timeout_ms(timeout)
        self._l = l = _kvlib()
        self._r = _Replica()
        flags = (_DIAL_WAIT_FOR_OWNER if wait_for_owner else 0) | (_DIAL_RECONNECT if reconnect else 0)
        status = l.cudapool_kv_dial(path, device, ns, len(ns), flags, self._ms, ctypes.byref(self._r))
        if status:
            raise _lib.error(status)
        try:
            g = _Geometry(size=ctypes.sizeof(_Geometry))
            self._call("cudapool_kv_geometry_get", ctypes.byref(g))
            self.geometry = Geometry(g.layers, g.kv_heads, g.head_dim, _DTYPE_NAMES[g.dtype],
                                     g.tokens_per_page, g.pages)
            n = g.regions
            ptrs, sizes, got = (_lib.vp * n)(), (_lib.u64 * n)(), _lib.size_t()
            self._call("cudapool_kv_regions", ptrs, sizes, n, ctypes.byref(got))
            self.regions = tuple(Region(ptrs[i] or 0, sizes[i]) for i in range(got.value))
            k, v = _lib.vp(), _lib.vp()
            layers: List[Tuple[int, int]] = []
            for layer in range(g.layers):
                self._call("cudapool_kv_layer_ptrs", layer, ctypes.byref(k), ctypes.byref(v))
                layers.append((k.value or 0, v.value or 0))
            self._layers = tuple(layers)
        except BaseException:
            self.close()
            raise
        # What one call at a time uses without allocating; a concurrent call makes its own.
        self._busy = threading.Lock()
        self._pages = (ctypes.c_uint32 * MAX_BATCH)()
        self._pages_b = memoryview(self._pages).cast("B")
        self._lease, self._n, self._u32a, self._u32b = _lib.u64(), _lib.size_t(), ctypes.c_uint32(), ctypes.c_uint32()
        self._one = (_lib.u64 * 1)()

    def _call(self, name: str, *args: Any) -> None:
        if not self._r.h:
            raise Closed(4, "cudapool: the kv replica of %r is closed" % (self.namespace,))
        status = getattr(self._l, name)(self._r, *args)
        if status:
            raise _lib.error(status)

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ms_of(self, timeout: TimeoutArg) -> int:
        return self._ms if isinstance(timeout, _ReplicaTimeout) else _lib.timeout_ms(timeout)

    @property
    def alive(self) -> bool:
        """False once the owner is gone (its process died or the connection ended)."""
        a = _lib.c_int()
        self._call("cudapool_kv_alive", ctypes.byref(a))
        return bool(a.value)

    @property
    def reattaches(self) -> int:
        """How many times the replica reattached to a restarted owner (reconnect)."""
        n = _lib.u64()
        self._call("cudapool_kv_reattaches", ctypes.byref(n))
        return int(n.value)

    def wait_attached(self, timeout: TimeoutArg = REPLICA_TIMEOUT) -> None:
        """Wait until the replica is attached to a live owner: at once while it is.

        Parameters
        ----------
        timeout : float or None
            Seconds to wait: the replica's timeout by default, None no bound, 0 do not
            wait (Timeout unless attached).

        Raises
        ------
        Timeout
            If it is not attached within timeout.
        Gone
            Where no reattach can come: without reconnect, or once the slab's keeper
            is gone.
        """
        self._call("cudapool_kv_wait_attached", self._ms_of(timeout))

    @property
    def error(self) -> Optional[Gone]:
        """Why the owner is gone (a Gone exception), or None while it is there."""
        msg = _lib.call_sized("cudapool_kv_error", self._r, cap=256) if self._r.h else b""
        return Gone(9, msg.decode(errors="replace")) if msg else None

    def fileno(self) -> int:
        """A file descriptor that becomes readable when the owner is gone (for select,
        poll or asyncio's add_reader); it stays the replica's, valid until close. With
        reconnect it tells the first loss only, and stays readable: after it, poll
        alive or wait_attached."""
        fd = _lib.c_int()
        self._call("cudapool_kv_done_fd", ctypes.byref(fd))
        return int(fd.value)

    def hashes(self, tokens: Tokens) -> Hashes:
        """The prefix hash of each full page of tokens (int32 ids) in this replica's
        namespace, computed by the library (prefix_hashes computes the same).

        Raises
        ------
        TypeError, ValueError
            tokens are not int32 token ids (a sequence of ints, array('i') or a
            C-contiguous buffer of 4-byte ints).
        """
        raw = _token_bytes(tokens, "=")
        n_tokens = len(raw) // 4
        cap = n_tokens // self.geometry.tokens_per_page
        out = ctypes.create_string_buffer(max(cap, 1) * HASH_BYTES)
        n = _lib.size_t()
        self._call("cudapool_kv_hashes", raw if n_tokens else None, n_tokens, out, cap, ctypes.byref(n))
        return Hashes(out.raw[:n.value * HASH_BYTES])

    def alloc(self, n: int, timeout: TimeoutArg = REPLICA_TIMEOUT) -> Lease:
        """Leases n free (or evicted) pages for writing: all of them or none.

        Returns
        -------
        Lease
            A write lease of n pages, to seal or release.

        Raises
        ------
        NoSpace
            Not n pages are free or evictable (pages being released may be free a
            moment later); nothing is leased.
        ValueError
            n is negative or over MAX_BATCH.
        InvalidArgument
            n is 0, or more than the slab's pages.
        """
        n = _count(n, "n")
        mine = self._busy.acquire(False)
        try:
            pages = self._pages if mine else (ctypes.c_uint32 * max(n, 1))()
            lease = self._lease if mine else _lib.u64()
            self._call("cudapool_kv_alloc", n, self._ms_of(timeout), ctypes.byref(lease), pages)
            return Lease(lease.value, _page_array(pages, n), True, self)
        finally:
            if mine:
                self._busy.release()

    def seal(self, lease: Lease, hashes: HashesLike, stream: StreamLike = None, wait: bool = False,
             timeout: TimeoutArg = REPLICA_TIMEOUT) -> SealResult:
        """Publishes the first len(hashes) pages of the write lease under hashes (the
        rest are freed): they become visible to every replica once the work queued on
        stream before the call has completed; with wait the call returns only then. The
        write lease ends either way, also when the call times out (not when it raises
        Gone with reconnect: see Gone).

        Returns
        -------
        SealResult
            visible: pages visible on return (all with wait); duplicates: pages whose
            hash was visible already (freed).

        Raises
        ------
        StaleLease
            The lease is not this replica's write lease any more (sealed or released
            already, or never issued); nothing changed.
        InvalidArgument
            A read lease (from match), or more hashes than the lease has pages; the
            lease is kept.
        Gone
            The owner is gone. With reconnect the lease is still held, and re-declared
            to the restarted owner: seal it again once attached (wait_attached), or
            close the replica; without it, the lease went with the owner.
        TypeError, ValueError
            lease is not a Lease, or hashes are not 16-byte hashes (or over MAX_BATCH).
        """
        if not isinstance(lease, Lease):
            raise TypeError("seal wants a Lease, not %s" % type(lease).__name__)
        raw, n = _hash_bytes(hashes)
        visible, dup = ctypes.c_uint32(), ctypes.c_uint32()
        self._call("cudapool_kv_seal", lease.id, raw, n, _stream(stream), 1 if wait else 0, self._ms_of(timeout),
                   ctypes.byref(visible), ctypes.byref(dup))
        return SealResult(visible.value, dup.value)

    def match(self, hashes: HashesLike, stream: StreamLike = None, timeout: TimeoutArg = REPLICA_TIMEOUT) -> Lease:
        """Leases for reading the longest run of visible pages under hashes from the
        first. Work queued on any stream after the call may read them; release them after
        it, on that stream. ``stream`` is not used (the match queues nothing: the pages'
        writes completed before they became visible) and is kept for compatibility.

        Returns
        -------
        Lease
            A read lease of the run's pages, in the order of hashes. If the first hash
            is not visible, or hashes is empty (match([]) asks the owner nothing), a
            Lease of len 0 and id 0, which holds nothing: releasing it is skipped.

        Raises
        ------
        TypeError, ValueError
            hashes are not 16-byte hashes, or over MAX_BATCH.
        """
        raw, n = _hash_bytes(hashes)
        if n == 0:
            return Lease(0, array("I"), False)
        mine = self._busy.acquire(False)
        try:
            pages = self._pages if mine else (ctypes.c_uint32 * n)()
            lease, got = (self._lease, self._n) if mine else (_lib.u64(), _lib.size_t())
            self._call("cudapool_kv_match", raw, n, _stream(stream), self._ms_of(timeout), ctypes.byref(lease),
                       pages, ctypes.byref(got))
            return Lease(lease.value, _page_array(pages, got.value), False, self)
        finally:
            if mine:
                self._busy.release()

    def release(self, *leases: Lease, stream: StreamLike = None, timeout: TimeoutArg = REPLICA_TIMEOUT) -> None:
        """Gives leases back once the work queued on stream before the call has
        completed: a page is not evicted or reused before. A Lease of len 0 (id 0, from
        a match that found nothing) holds nothing and is skipped: with only such leases
        the call asks the owner nothing. All or none.

        Raises
        ------
        StaleLease
            A lease was released or sealed already, or is another replica's: none is
            released. Or a lease was lost in an owner's restart (Lease.lost): it is
            ended, and the others are released.
        Gone
            The owner is gone. With reconnect the leases are still held, and
            re-declared to the restarted owner, which holds their pages until they are
            released: release them again once attached (wait_attached), or close the
            replica; without reconnect they went with the owner.
        TypeError, ValueError
            Not Leases, or more than MAX_BATCH of them.
        Timeout
            The owner did not answer in time: the leases are given back all the same
            (after stream's work) and must not be used again.
        """
        ids: List[int] = []
        for l in leases:
            if not isinstance(l, Lease):
                raise TypeError("release wants Leases, not %s" % type(l).__name__)
            if l.id:
                ids.append(l.id)
        if not ids:
            return
        _count(len(ids), "the number of leases")
        if len(ids) == 1 and self._busy.acquire(False):
            try:
                self._one[0] = ids[0]
                self._call("cudapool_kv_release", self._one, 1, _stream(stream), self._ms_of(timeout))
            finally:
                self._busy.release()
            return
        arr = (_lib.u64 * len(ids))(*ids)
        self._call("cudapool_kv_release", arr, len(ids), _stream(stream), self._ms_of(timeout))

    def stats(self, timeout: TimeoutArg = REPLICA_TIMEOUT) -> Dict[str, Any]:
        """The owner's statistics: per device its pages by state (free, writing,
        sealing, sealed, settling; leased, releasing) and counters (hits, misses,
        evictions, seals, duplicates, copied) and, where kvpoold runs with
        -host-bytes, its host tier under "host" (pages by state, spills, restores and
        their bytes, pages lost and evicted), per replica its leases and pages."""
        if not self._r.h:
            raise Closed(4, "cudapool: the kv replica of %r is closed" % (self.namespace,))
        st: Dict[str, Any] = json.loads(_lib.call_sized("cudapool_kv_stats", self._r, self._ms_of(timeout)))
        return st

    def layer_ptrs(self, layer: int) -> Tuple[int, int]:
        """Where layer's K and V tensors begin in this process, on the replica's
        device, as (k, v) addresses: each [pages, tokens_per_page, kv_heads, head_dim]
        of the geometry's dtype, contiguous, page p of it p * geometry.page_bytes
        further on.

        Raises
        ------
        IndexError
            For a layer outside [0, geometry.layers).
        """
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise TypeError("layer must be an int, not %s" % type(layer).__name__)
        if not 0 <= layer < self.geometry.layers:
            raise IndexError("layer %d is outside [0, %d)" % (layer, self.geometry.layers))
        if not self._r.h:
            raise Closed(4, "cudapool: the kv replica of %r is closed" % (self.namespace,))
        return self._layers[layer]

    def tensor_view(self, layer: int, part: int) -> _TensorView:
        """A DLPack and __cuda_array_interface__ view of layer's K (part 0) or V
        (part 1): [pages, tokens_per_page, kv_heads, head_dim] integers of the dtype's
        size (DLPack consumers differ on bf16 and fp8: view them as the dtype). It
        keeps the replica alive while a consumer holds it."""
        if part not in (0, 1):
            raise ValueError("part must be 0 (K) or 1 (V), not %r" % (part,))
        g = self.geometry
        return _TensorView(self, self.layer_ptrs(layer)[part], _WORDS[g.dtype_size],
                           (g.pages, g.tokens_per_page, g.kv_heads, g.head_dim))

    def kv_caches(self) -> List[Tuple[Any, Any]]:
        """Per layer, (K, V) torch tensors [pages, tokens_per_page, kv_heads, head_dim]
        of the geometry's dtype on this replica's device, views of the slab's regions
        (no copy), built from layer_ptrs. Imports torch."""
        import torch
        g = self.geometry
        dtype = getattr(torch, _TORCH_DTYPES[g.dtype])

        def tensor(layer: int, part: int) -> Any:
            t = torch.from_dlpack(self.tensor_view(layer, part))
            return t if t.dtype == dtype else t.view(dtype)

        return _layer_caches(tensor, g.layers)

    def close(self, timeout: TimeoutArg = REPLICA_TIMEOUT) -> None:
        """Gives every lease back, unmaps the slab and hangs up; a second close does
        nothing.

        The leases still held end after the work queued so far on every stream the
        replica has sealed or released on, as a release on those streams would: pages
        a kernel still writes are not given to another replica. Work on a stream never
        passed to ``seal`` or ``release`` is not covered; release such leases first.
        A stream passed to ``seal`` or ``release`` must not be destroyed before the
        close (the driver does not survive a record on a destroyed stream): torch's
        streams never are; a cudapool.Stream may be, as its close hands the replica
        its last record first.

        Parameters
        ----------
        timeout : float or None
            Seconds to wait for that work and for the owner; None means no bound. If it
            passes, close raises the timeout error, and the unmapping completes on its
            own once the work has run.
        """
        if self._r.h:
            r = _Replica(self._r.h)
            self._r.h = 0
            status = self._l.cudapool_kv_close(r, self._ms_of(timeout))
            if status:
                raise _lib.error(status)

    def __repr__(self) -> str:
        return "<cudapool.kv.Replica device=%d namespace=%r %s>" % (
            self.device, self.namespace, "open" if self._r.h else "closed")


_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8e4m3": "float8_e4m3fn"}
# The integer type string of each element size: the slab is handed over as integers of
# the dtype's size and viewed as the dtype (DLPack consumers differ on bf16 and fp8).
_WORDS = {1: "|u1", 2: "<i2", 4: "<i4"}


_T = TypeVar("_T")


def _layer_caches(tensor: Callable[[int, int], _T], layers: int) -> List[Tuple[_T, _T]]:
    """Per layer, (K, V): tensor(layer, 0) and tensor(layer, 1)."""
    return [(tensor(l, 0), tensor(l, 1)) for l in range(layers)]


def _page_array(pages: Any, n: int) -> array[int]:
    a = array("I")
    a.frombytes(memoryview(pages).cast("B")[:4 * n])
    return a


class _TensorView:
    """A typed window on one tensor of a replica's slab for DLPack and
    __cuda_array_interface__ consumers; it keeps the replica alive while a consumer
    holds it."""

    def __init__(self, replica: Replica, ptr: int, typestr: str, shape: Tuple[int, ...]) -> None:
        itemsize = 2 if typestr == "bf16" else int(typestr[2:])
        n = itemsize
        for d in shape:
            n *= d
        if n != replica.geometry.tensor_bytes:
            raise ValueError("a view of %d bytes of a %d-byte tensor" % (n, replica.geometry.tensor_bytes))
        self.replica, self.ptr, self.typestr, self.shape, self.itemsize = (
            replica, ptr, typestr, tuple(shape), itemsize)

    def _ptr(self) -> int:
        if not self.replica._r.h:
            raise Closed(4, "cudapool: the kv replica is closed")
        return self.ptr

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        if self.typestr == "bf16":
            raise TypeError("__cuda_array_interface__ has no bfloat16: use DLPack")
        # No stream: the slab's pages are ordered by the owner's leases, not by a stream.
        return {"shape": self.shape, "typestr": self.typestr, "data": (self._ptr(), False), "version": 3,
                "strides": None, "stream": None}

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return _dlpack.capsule(self, self._ptr(), self.replica.device, _dlpack.dtype_of(self.typestr),
                               self.shape, None, self.itemsize)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (_dlpack.KDL_CUDA, self.replica.device)
