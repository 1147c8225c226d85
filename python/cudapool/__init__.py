"""cudapool for Python: share GPU memory between processes through CUDA's IPC-capable
memory pools, with cudapool's leases and stream ordering (ctypes over libcudapool).

A producer publishes device memory of a cudapool pool under a name; consumers open it
as a Mapping, which any CUDA array library takes without a copy through
__cuda_array_interface__ (torch.as_tensor, cupy.asarray, cuda.core's
StridedMemoryView):

    ex = cudapool.Exporter("/tmp/kv.sock")
    buf = pool.alloc(size, stream=s)               # a Buffer
    ex.publish("kv", buf, stream=s)                # ready once s's work so far is done

    imp = cudapool.Importer("/tmp/kv.sock", device=0)
    with imp.open("kv", stream=s) as m:            # s waits for the producer's writes
        t = torch.as_tensor(m, device="cuda:0")    # uint8 view, no copy

Every call that takes a stream takes the caller's: an int (cudaStream_t), a torch,
CuPy or cuda.core stream, or anything with __cuda_stream__; None is the legacy default
stream. Every call that waits takes a timeout in seconds, by Python's convention:
None is no bound, and 0 is do not wait, as in threading and queue: what is not there
yet (an exporter, a name) fails at once as without wait_for_exporter or wait_for_name,
and a live exporter's
answer is waited for at most a second. Only the standard library is needed;
cudapool.vmm holds the VMM route (an Allocation of chunks mapped as one range, of any
size, which Exporter.publish_chunks publishes and Importer.open maps as one range),
cudapool.torch the PyTorch helpers, cudapool.kv the KV page pool (torch only for
kv_caches), and cudapool.hf runs stock transformers models over its pages (torch and
transformers imported at first use).

The runtime is the GPU unless asked otherwise: init("auto") falls back to cudapool's
software device where no GPU is (and says so), init("test") always uses it, and so does
$CUDAPOOL_RUNTIME. The library logs nothing unless set_log_level asks it to, and then
through the logging module's "cudapool" logger.

Closing and releasing, the rule of every language: a second close changes nothing
(Python returns None, as files and sockets do; Go's Close returns the package's
ErrClosed and C's CUDAPOOL_EHANDLE, which a caller may ignore, as close(2)'s EBADF).
A second release of what was leased (Mapping.release, a KV lease, Buffer.free) is a
bug: it raises (InvalidHandle, StaleLease, ForeignPointer), as Go returns ErrReleased
or kv.ErrStaleLease and C CUDAPOOL_EHANDLE or CUDAPOOL_ESTALE.

The library runs a Go runtime, which does not survive fork(): a process forked after
it was loaded gets ForkedProcess from every call. Use multiprocessing's "spawn" start
method.

Errors: every failure is a CudapoolError subclass carrying the library's message (and
the standard exception it is, where one fits: ValueError, LookupError, TimeoutError,
MemoryError, PermissionError, OSError). Arguments Python can check raise TypeError or
ValueError before the library sees them. Besides those, and Timeout (a call that waited
its timeout out holds nothing) and ForkedProcess anywhere:

    init, runtime_info, Stream    NoRuntime (no GPU, or another runtime chosen already)
    Pool, Pool.alloc              OutOfMemory, Timeout (wait_for_memory), InvalidArgument
    Pool.close                    Busy (live buffers, without force)
    free, Buffer.free             ForeignPointer (no pool's pointer, or freed already)
    Exporter                      NameInUse (a live exporter there), InvalidArgument (path),
                                  BadDirectory (the announce directory)
    Exporter.publish              NameInUse, ForeignPointer, InvalidArgument (range, meta)
    Exporter.publish_chunks       NameInUse, InvalidArgument (range, meta), Closed (allocation),
                                  NotSupported (FABRIC chunks without an IMEX channel)
    publish_chunks_all            the same, for each entry (all or none)
    Exporter.push                 NotFound (no such peer or name)
    Exporter.close                Abandoned (consumers still held buffers: closed anyway)
    Importer                      Gone (no exporter: without wait_for_exporter, or with timeout 0),
                                  Refused, VersionMismatch, DuplicateImporter,
                                  NotSupported (this process's own exporter)
    Importer.open, open_all       NotFound (without wait_for_name), Gone, StreamDevice,
                                  TooManyGrants, ExporterFailed
    Mapping (ptr, view, DLPack)   MappingLost (exporter gone, another GPU), InvalidHandle
                                  (released)
    release, release_all          InvalidHandle, StaleLease
    closed objects                Closed or InvalidHandle

cudapool.kv's calls say theirs (NoSpace, StaleLease, Gone, Closed).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import json
import logging
import selectors
import warnings
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union

from . import _dlpack, _lib
from ._lib import (  # noqa: F401 (re-exported)
    Abandoned, BadDirectory, Busy, Closed, CudaError, CudapoolError, DuplicateImporter,
    ExporterFailed, ForeignPointer, ForkedProcess, Gone, InternalError, InvalidArgument,
    InvalidHandle, MappingLost, NameInUse, NoRuntime, NoSpace, NotFound, NotSupported,
    OutOfMemory, ProtocolError, Refused, StaleLease, StreamDevice, SystemFailure, Timeout,
    TooManyGrants,
    VersionMismatch, library_path)

__all__ = [
    "init", "runtime_info", "RuntimeInfo", "version", "protocol_version", "set_log_level",
    "stream_handle", "stream_wait", "Stream", "Pool", "PoolStats", "Buffer", "free",
    "Exporter", "Importer", "Mapping", "ArrayView", "State", "PublishedName", "Peer",
    "query_state", "copy_to_device", "copy_from_device", "library_path", "MAX_META", "MAX_BATCH",
    "DEFAULT_TIMEOUT",
    "CudapoolError", "InvalidArgument", "InvalidHandle", "ForeignPointer", "Closed", "OutOfMemory",
    "NotFound", "NameInUse", "Busy", "Gone", "Refused", "VersionMismatch", "ProtocolError", "Timeout",
    "NoRuntime", "CudaError", "ForkedProcess", "NotSupported", "InternalError", "SystemFailure",
    "StreamDevice", "DuplicateImporter", "TooManyGrants", "MappingLost", "ExporterFailed",
    "Abandoned", "StaleLease", "BadDirectory", "NoSpace",
]

MAX_META = 4096
MAX_BATCH = 1024
DEFAULT_TIMEOUT = 30.0
HANDLE_TYPES = {"none": 0, "posix-fd": 1, "fabric": 8}

StreamLike = Any  # None, an int cudaStream_t, or a torch, CuPy or cuda.core stream
Timeout_ = Optional[float]


class RuntimeInfo(NamedTuple):
    on_gpu: bool
    devices: int
    name: str


def init(prefer: Optional[str] = None) -> str:
    """Chooses the runtime once per process: "gpu" (the default, also for None unless
    $CUDAPOOL_RUNTIME says otherwise), "auto" (a GPU when one is usable, else the
    software device) or "test" (the software device). Returns the sentence saying which
    and why."""
    why = ctypes.create_string_buffer(512)
    _lib.call("cudapool_init", None if prefer is None else _lib.encode_name(prefer, "prefer"), why, len(why))
    return why.value.decode()


def runtime_info() -> RuntimeInfo:
    """(on_gpu, devices, name) of the runtime in use, choosing it if none is."""
    on_gpu, n = ctypes.c_int(), ctypes.c_int()
    name = ctypes.create_string_buffer(256)
    _lib.call("cudapool_runtime_info", ctypes.byref(on_gpu), ctypes.byref(n), name, len(name))
    return RuntimeInfo(bool(on_gpu.value), n.value, name.value.decode())


def version() -> Tuple[int, int]:
    """The library's (major, minor) version."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _lib.call("cudapool_version", ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def protocol_version() -> int:
    """The sharing protocol's version; metadata travels with a publish from 2 on."""
    v = ctypes.c_int()
    _lib.call("cudapool_protocol_version", ctypes.byref(v))
    return v.value


# ---- Logging ----

logger = logging.getLogger("cudapool")
_LOG_OFF = 127
_to_c = [(logging.DEBUG, -4), (logging.INFO, 0), (logging.WARNING, 4), (logging.ERROR, 8)]


def _log_event(level: int, msg: bytes, _arg: Any) -> None:
    py = logging.ERROR
    for p, c in _to_c:
        if level <= c:
            py = p
            break
    logger.log(py, "%s", msg.decode(errors="replace"))


_log = _lib.LOG_FN(_log_event)  # the C callback: kept here, alive while the library may call it


def set_log_level(level: Union[int, str, None]) -> None:
    """Sends the library's events that no call returns (a connection refused or cut,
    cleanup that failed) at level or above to the "cudapool" logger: a logging level
    (logging.WARNING, "DEBUG", ...), or None to send nothing, the default."""
    if level is None:
        _lib.call("cudapool_set_log", _LOG_OFF, _lib.LOG_NONE, None)
        return
    if isinstance(level, str):
        named = logging.getLevelName(level.upper())
        if not isinstance(named, int):
            raise ValueError("log level %r: want DEBUG, INFO, WARNING, ERROR or None" % level)
        level = named
    level = _lib.integer(level, "log level", 0, 1 << 31)
    c = 8
    for p, cl in _to_c:
        if level <= p:
            c = cl
            break
    _lib.call("cudapool_set_log", c, _log, None)


@atexit.register
def _stop_logging() -> None:  # no callback into an interpreter that is going away
    if _lib._lib is not None:
        _lib.lib().cudapool_set_log(_LOG_OFF, _lib.LOG_NONE, None)


# ---- Streams and copies ----

def stream_handle(stream: StreamLike) -> int:
    """The cudaStream_t of stream as an int: None is 0 (the legacy default stream); an
    int is taken as is; otherwise __cuda_stream__ (cuda.core, CuPy, Stream), .cuda_stream
    (torch) or .ptr (CuPy)."""
    if stream is None:
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _lib.integer(stream, "stream", 0, _lib.PTR_MAX)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        _, handle = proto() if callable(proto) else proto
        return _lib.integer(handle, "stream", 0, _lib.PTR_MAX)
    for attr in ("cuda_stream", "ptr"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return _lib.integer(v, "stream", 0, _lib.PTR_MAX)
    raise TypeError("not a stream: %r (want an int cudaStream_t, a torch, CuPy or cuda.core "
                    "stream, or an object with __cuda_stream__)" % (stream,))


def _vp(stream: StreamLike) -> ctypes.c_void_p:
    return ctypes.c_void_p(stream_handle(stream) or None)


class Stream:
    """A stream of cudapool's runtime, for programs with no other CUDA library (and for
    the software device, which only cudapool's calls reach). A closed Stream raises
    Closed wherever it is given, never standing for the legacy default stream."""

    def __init__(self, device: int = 0):
        self.device = _lib.device(device)
        h = ctypes.c_void_p()
        _lib.call("cudapool_stream_create", self.device, ctypes.byref(h))
        self._handle: int = h.value or 0

    @property
    def handle(self) -> int:
        if not self._handle:
            raise Closed(_lib.CLOSED, "cudapool: stream was closed")
        return self._handle

    def __cuda_stream__(self) -> Tuple[int, int]:
        return (0, self.handle)

    def synchronize(self) -> None:
        _lib.call("cudapool_stream_synchronize", self.device, ctypes.c_void_p(self.handle))

    def close(self) -> None:
        if self._handle:
            h, self._handle = self._handle, 0
            _lib.call("cudapool_stream_destroy", self.device, ctypes.c_void_p(h))

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<cudapool.Stream device=%d %s>" % (self.device, hex(self._handle) if self._handle else "closed")


def stream_wait(device: int, waiter: StreamLike, waited: StreamLike) -> None:
    """Makes the work queued on waiter from now on wait for the work queued on waited so
    far (both on device); the host does not wait."""
    w, d = stream_handle(waiter), stream_handle(waited)
    if w != d:
        _lib.call("cudapool_stream_wait", _lib.device(device), ctypes.c_void_p(w or None), ctypes.c_void_p(d or None))


def copy_to_device(device: int, dst: Any, data: Any, stream: StreamLike = None) -> None:
    """Copies the bytes data (bytes-like) to the device address dst (an int or a
    Buffer), ordered on stream."""
    data = _lib.meta_bytes(data) if not isinstance(data, str) else data.encode()
    buf = ctypes.create_string_buffer(data, len(data))
    _lib.call("cudapool_copy_to_device", _lib.device(device), ctypes.c_void_p(_lib.address(dst, "dst")), buf,
              len(data), _vp(stream))


def copy_from_device(device: int, src: Any, n: int, stream: StreamLike = None) -> bytes:
    """Returns n bytes read from the device address src (an int or a Buffer) after
    stream's work so far."""
    n = _lib.integer(n, "n", 1, 1 << 31)
    buf = ctypes.create_string_buffer(n)
    _lib.call("cudapool_copy_from_device", _lib.device(device), buf, ctypes.c_void_p(_lib.address(src, "src")), n,
              _vp(stream))
    return buf.raw


# ---- Pools ----

@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A pool's figures (cudapool_pool_stats): the driver's reserved and used bytes,
    and cudapool's buffers, leases and cache."""
    device: int
    handle_type: int
    max_size: int
    granularity: int
    reserved_current: int
    reserved_high: int
    used_current: int
    used_high: int
    live_buffers: int
    bytes_requested: int
    bytes_reserved: int
    shared_buffers: int
    active_leases: int
    deferred_frees: int
    failed_frees: int
    cached_buffers: int
    cached_bytes: int


def pool_stats(handle: "_lib.PoolH") -> PoolStats:
    s = _lib.PoolStats()
    _lib.call("cudapool_pool_stats_get", handle, ctypes.byref(s))
    return PoolStats(**{name: getattr(s, name) for name, _ in s._fields_})


def _pool_options(name: Optional[str] = None, handle_type: str = "posix-fd", max_size: int = 0,
                  release_threshold: Optional[int] = None, wait_for_memory: bool = False,
                  peer_devices: Iterable[int] = (), cache_bytes: int = 0) -> "_lib.PoolOptions":
    if handle_type not in HANDLE_TYPES:
        raise ValueError("handle_type %r: want one of %s" % (handle_type, ", ".join(HANDLE_TYPES)))
    o = _lib.options(_lib.PoolOptions)
    o.name = None if name is None else _lib.encode_name(name)
    o.handle_type = HANDLE_TYPES[handle_type]
    o.max_size = _lib.size(max_size, "max_size")
    if release_threshold is not None:
        o.release_threshold, o.has_release_threshold = _lib.size(release_threshold, "release_threshold"), 1
    o.wait_for_memory = 1 if wait_for_memory else 0
    o.cache_bytes = _lib.size(cache_bytes, "cache_bytes")
    peers = [_lib.device(d) for d in peer_devices]
    if peers:
        o.peer_devices = (ctypes.c_int * len(peers))(*peers)
        o.peer_count = len(peers)
    return o


_H = TypeVar("_H", bound="_Handle")


class _Handle:
    """An object of the library, known by its handle; 0 once closed. As a context
    manager it is closed at the end of the with block; a block that raised keeps its
    own exception: a close that fails then (a Pool whose buffers are still live is
    Busy) leaves the object open instead of hiding the cause."""

    _h = 0

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except CudapoolError:
            pass  # the block's exception is the one to see; this object stays open

    def close(self) -> None:
        raise NotImplementedError

    @property
    def handle(self) -> int:
        return self._h


class Pool(_Handle):
    """A cudapool pool on device: pool.New's options, stream-ordered alloc and free.
    With wait_for_memory, alloc on a full pool waits up to its timeout for a free."""

    def __init__(self, device: int = 0, *, name: Optional[str] = None, handle_type: str = "posix-fd",
                 max_size: int = 0, release_threshold: Optional[int] = None, wait_for_memory: bool = False,
                 peer_devices: Iterable[int] = (), cache_bytes: int = 0):
        o = _pool_options(name, handle_type, max_size, release_threshold, wait_for_memory, peer_devices,
                          cache_bytes)
        h = _lib.PoolH()
        self.device = _lib.device(device)
        _lib.call("cudapool_pool_create", self.device, ctypes.byref(o), ctypes.byref(h))
        self._h, self.name = h.h, name

    @property
    def _ch(self) -> "_lib.PoolH":
        return _lib.PoolH(self._h)

    def alloc(self, size: int, stream: StreamLike = None, timeout: Timeout_ = DEFAULT_TIMEOUT) -> "Buffer":
        """A Buffer of at least size bytes, ready for work queued on stream after the
        call. A request that can never fit the pool fails at once with OutOfMemory."""
        size = _lib.size(size)
        s = stream_handle(stream)
        p = ctypes.c_void_p()
        _lib.call("cudapool_alloc", self._ch, size, ctypes.c_void_p(s or None), _lib.timeout_ms(timeout),
                  ctypes.byref(p))
        return Buffer(p.value or 0, size, self.device, self, s)

    def stats(self) -> PoolStats:
        return pool_stats(self._ch)

    def close(self, force: bool = False, timeout: Timeout_ = DEFAULT_TIMEOUT) -> None:
        """Destroys the pool: Busy while buffers are live, unless force, which frees
        them (those other processes hold stay allocated until this process exits)."""
        if self._h:
            _lib.call("cudapool_pool_close", self._ch, 1 if force else 0, _lib.timeout_ms(timeout))
            self._h = 0

    def __repr__(self) -> str:
        return "<cudapool.Pool %sdevice=%d%s>" % ("%r " % self.name if self.name else "", self.device,
                                                  "" if self._h else " closed")


def free(ptr: Any, stream: StreamLike = None) -> None:
    """Frees the buffer at the device address ptr (from Pool.alloc or cudapool's torch
    allocator) once stream's work so far is done; later if other processes hold it."""
    _lib.call("cudapool_free", ctypes.c_void_p(_lib.address(ptr, "ptr") or None), _vp(stream))


class Buffer:
    """Device memory from Pool.alloc: ptr, size (as asked), device, and the stream it
    was allocated on. free(stream) returns it once stream's work so far is done (by
    default the stream it was allocated on); as a context manager it is freed at the
    end. It stands for its address where an int is wanted (operator.index)."""

    def __init__(self, ptr: int, size: int, device: int, pool: Optional[Pool], stream: int = 0):
        self.ptr, self.size, self.device, self.pool, self.stream = ptr, size, device, pool, stream
        self.freed = False

    def free(self, stream: StreamLike = None) -> None:
        if self.freed:
            raise ForeignPointer(3, "cudapool: buffer %#x was freed already" % self.ptr)
        free(self.ptr, self.stream if stream is None else stream)
        self.freed = True

    def __index__(self) -> int:
        return self.ptr

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.freed:
            self.free()

    def __repr__(self) -> str:
        return "<cudapool.Buffer %#x size=%d device=%d%s>" % (self.ptr, self.size, self.device,
                                                              " freed" if self.freed else "")


# ---- State ----

def _fields(cls: Any, d: Dict[str, Any]) -> Dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclasses.dataclass(frozen=True)
class PublishedName:
    name: str
    pool: int
    buffer_id: int
    size: int
    offset: int = 0
    length: int = 0
    meta_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    remote: bool = False
    device: str = ""
    leases: int = 0
    grants: int = 0
    bytes_leased: int = 0
    connected_since: str = ""
    awaiting_exit: bool = False


@dataclasses.dataclass(frozen=True)
class State:
    """An exporter's state, poolstat's schema: its pools (as the schema's dicts), the
    names it publishes and its peers."""
    schema: int
    name: str
    pid: int
    socket: str
    started: str
    devices: List[Dict[str, Any]]
    pools: List[Dict[str, Any]]
    published: List[PublishedName]
    peers: List[Peer]

    @classmethod
    def from_json(cls, raw: bytes) -> "State":
        d = json.loads(raw)
        d["published"] = [PublishedName(**_fields(PublishedName, n)) for n in d.get("published") or []]
        d["peers"] = [Peer(**_fields(Peer, p)) for p in d.get("peers") or []]
        d["devices"], d["pools"] = d.get("devices") or [], d.get("pools") or []
        return cls(**_fields(cls, d))


# ---- Exporter ----

def _pointer_and_size(obj: Any, size: int) -> Tuple[int, int]:
    """A publishable (address, size) from a Buffer, an int address or a
    __cuda_array_interface__."""
    if isinstance(obj, Buffer):
        return obj.ptr, _lib.size(size)
    if isinstance(obj, int) and not isinstance(obj, bool):
        return _lib.address(obj, "address"), _lib.size(size)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError("publish wants a Buffer, a device address (int) or an object with "
                        "__cuda_array_interface__, not %s" % type(obj).__name__)
    if cai.get("strides") is not None:
        raise ValueError("publish wants contiguous memory (strides must be None)")
    n = int(cai["typestr"][2:])
    for d in cai["shape"]:
        n *= d
    return _lib.address(cai["data"][0]), _lib.size(size or n)


class Exporter(_Handle):
    """The producer's side: publishes memory of cudapool pools under names, on a Unix
    socket at path. name is the process name poolstat shows; with retain_imports
    consumers keep a buffer's import after releasing it, so that leasing memory recycled
    through a pool's cache (cache_bytes) again costs no import; with announce=False
    poolstat does not list the exporter. The policy: by default processes of this user;
    with allow_uids or allow_gids exactly those, and socket_follows_policy opens the
    socket (mode 0600 otherwise) so that they can connect. max_grants caps the grants one
    connection may hold (0: the library's default)."""

    def __init__(self, path: str, name: Optional[str] = None, *, retain_imports: bool = False,
                 announce: bool = True, allow_uids: Iterable[int] = (), allow_gids: Iterable[int] = (),
                 socket_follows_policy: bool = False, max_grants: int = 0):
        o = _lib.options(_lib.ListenOptions)
        o.name = None if name is None else _lib.encode_name(name)
        o.flags = (1 if retain_imports else 0) | (0 if announce else 2) | (4 if socket_follows_policy else 0)
        uids = [_lib.integer(u, "uid", 0, (1 << 32) - 1) for u in allow_uids]
        gids = [_lib.integer(g, "gid", 0, (1 << 32) - 1) for g in allow_gids]
        if uids:
            o.allow_uids, o.uid_count = (_lib.u32 * len(uids))(*uids), len(uids)
        if gids:
            o.allow_gids, o.gid_count = (_lib.u32 * len(gids))(*gids), len(gids)
        o.max_grants = _lib.integer(max_grants, "max_grants", 0, _lib.INT_MAX)
        h = _lib.ExporterH()
        _lib.call("cudapool_exporter_listen", _lib.encode_name(path, "path"), ctypes.byref(o), ctypes.byref(h))
        self._h, self.path, self.name = h.h, path, name
        self._kept: Dict[str, Any] = {}  # name -> the array published under it, kept alive

    @property
    def _ch(self) -> "_lib.ExporterH":
        return _lib.ExporterH(self._h)

    def publish(self, name: str, obj: Any, size: int = 0, stream: StreamLike = None,
                meta: Union[bytes, str, None] = b"") -> None:
        """Makes the memory at obj (a Buffer, an address in a cudapool pool, or an object
        with __cuda_array_interface__) available under name, ready once the work queued
        on stream before the call is done. size 0 is to the end of obj's buffer (or obj's
        own size). meta (bytes-like or str, at most MAX_META bytes) goes to every
        consumer. An array obj is kept alive until unpublish or close: an allocator that
        caches (torch's, in a MemPool) would otherwise give its memory to another array
        while consumers still read it. Unpublish only once they have released it."""
        ptr, size = _pointer_and_size(obj, size)
        m = _lib.meta_bytes(meta)
        _lib.call("cudapool_exporter_publish", self._ch, _lib.encode_name(name), ctypes.c_void_p(ptr or None),
                  size, _vp(stream), m or None, len(m))
        if not isinstance(obj, (int, Buffer)):
            self._kept[name] = obj

    def publish_all(self, entries: Iterable[Sequence[Any]], stream: StreamLike = None) -> None:
        """Publishes many names at once, each ready once the work queued on stream before
        the call is done: entries are (name, obj) or (name, obj, size, meta), as publish
        takes them; their buffers are on one device. All of them, or none."""
        es = list(entries)
        if not 0 < len(es) <= MAX_BATCH:
            raise ValueError("%d entries: want 1 to %d" % (len(es), MAX_BATCH))
        arr = (_lib.PublishEntry * len(es))()
        keep = []
        for i, e in enumerate(es):
            name, obj = e[0], e[1]
            size = e[2] if len(e) > 2 else 0
            meta = _lib.meta_bytes(e[3] if len(e) > 3 else b"")
            ptr, size = _pointer_and_size(obj, size)
            n = _lib.encode_name(name)
            keep.append((n, meta))
            arr[i].name, arr[i].ptr, arr[i].size = n, ptr or None, size
            arr[i].meta, arr[i].meta_len = meta or None, len(meta)
        _lib.call("cudapool_exporter_publish_all", self._ch, arr, len(es), _vp(stream))
        for e in es:
            if not isinstance(e[1], (int, Buffer)):
                self._kept[e[0]] = e[1]

    def publish_chunks(self, name: str, allocation: "vmm.Allocation", size: int = 0, stream: StreamLike = None,
                       meta: Union[bytes, str, None] = b"", *, offset: int = 0) -> None:
        """Makes the memory of a cudapool.vmm.Allocation available under name, as publish
        does a pool's, ready once the work queued on stream before the call is done:
        [offset, offset+size) of it (size 0: to the end), with meta (at most MAX_META
        bytes). A consumer's Importer.open maps it as one range, whatever its chunks.
        The exporter keeps a descriptor of every chunk until the name is unpublished (or
        the exporter closed): the allocation may be closed once its queued work has run,
        and the memory lives on. Each call publishes an allocation of its own. Raises
        NameInUse, InvalidArgument (range, meta), Closed (a closed allocation) and
        NotSupported (FABRIC chunks on a host without an IMEX channel)."""
        arr = _chunk_array(allocation, "publish_chunks")
        m = _lib.meta_bytes(meta)
        _lib.call("cudapool_exporter_publish_chunks", self._ch, _lib.encode_name(name), arr, len(arr),
                  _lib.size(offset, "offset"), _lib.size(size), _vp(stream), m or None, len(m))

    def publish_chunks_all(self, allocation: "vmm.Allocation", entries: Iterable[Sequence[Any]],
                           stream: StreamLike = None) -> None:
        """Publishes one cudapool.vmm.Allocation under many names at once, each for its
        range, all ready once the work queued on stream before the call is done: entries
        are (name,), (name, offset, size) or (name, offset, size, meta), size 0 being to
        the end. A consumer maps the allocation once, however many of its names it opens:
        their Mappings lie in one range, at their offsets. The exporter keeps the chunks'
        descriptors until the last name is unpublished. All of them, or none."""
        arr = _chunk_array(allocation, "publish_chunks_all")
        es = list(entries)
        if not 0 < len(es) <= MAX_BATCH:
            raise ValueError("%d entries: want 1 to %d" % (len(es), MAX_BATCH))
        ces = (_lib.ChunkEntry * len(es))()
        keep = []  # the bytes the entries point at, alive until the call returns
        for i, e in enumerate(es):
            if len(e) not in (1, 3, 4):
                raise ValueError("entry %d has %d fields: want (name,), (name, offset, size) or "
                                 "(name, offset, size, meta)" % (i, len(e)))
            meta = _lib.meta_bytes(e[3] if len(e) > 3 else b"")
            name = _lib.encode_name(e[0])
            keep.append((name, meta))
            ces[i].name, ces[i].meta, ces[i].meta_len = name, meta or None, len(meta)
            if len(e) > 1:
                ces[i].offset, ces[i].size = _lib.size(e[1], "offset"), _lib.size(e[2])
        _lib.call("cudapool_exporter_publish_chunks_all", self._ch, arr, len(arr), ces, len(es), _vp(stream))

    def unpublish(self, name: str) -> None:
        _lib.call("cudapool_exporter_unpublish", self._ch, _lib.encode_name(name))
        self._kept.pop(name, None)

    def push(self, pid: int, name: str, timeout: Timeout_ = DEFAULT_TIMEOUT) -> None:
        """Leases the buffer published under name to process pid, unasked."""
        _lib.call("cudapool_exporter_push", self._ch, _lib.integer(pid, "pid", 1, _lib.INT_MAX),
                  _lib.encode_name(name), _lib.timeout_ms(timeout))

    def state(self) -> State:
        """The exporter's state, as poolstat -json shows it."""
        return State.from_json(_lib.call_sized("cudapool_exporter_state", self._ch))

    def close(self, timeout: Timeout_ = DEFAULT_TIMEOUT) -> None:
        """Stops sharing and waits up to timeout for consumers to release what they hold.
        If they do not, it raises Abandoned: the exporter is closed all the same, and
        each buffer still held goes back to its pool once its consumer releases it or
        exits."""
        if self._h:
            h, self._h = self._h, 0
            try:
                _lib.call("cudapool_exporter_close", _lib.ExporterH(h), _lib.timeout_ms(timeout))
            finally:
                self._kept.clear()

    def __repr__(self) -> str:
        return "<cudapool.Exporter %r%s>" % (self.path, "" if self._h else " closed")


def _chunk_array(allocation: Any, what: str) -> "ctypes.Array[_lib.ChunkH]":
    """The chunks of allocation, a cudapool.vmm.Allocation, as the library takes them."""
    if not isinstance(allocation, vmm.Allocation):
        raise TypeError("%s wants a cudapool.vmm.Allocation, not %s" % (what, type(allocation).__name__))
    return allocation._chunk_array()


def query_state(socket: str, timeout: Timeout_ = DEFAULT_TIMEOUT) -> State:
    """Asks the exporter at socket for its state, as poolstat does."""
    return State.from_json(_lib.call_sized("cudapool_query_state", _lib.encode_name(socket, "socket"),
                                           _lib.timeout_ms(timeout)))


# ---- Importer ----

def _renamed(new: str, value: bool, old: str, old_value: Optional[bool]) -> bool:
    """The value of keyword new, given as value or under its former name old (then
    old_value is not None, and a DeprecationWarning names both): a TypeError if both
    were given."""
    if old_value is None:
        return value
    if value:
        raise TypeError("%s= is %s='s former name: give one of them" % (old, new))
    warnings.warn("%s= is deprecated: use %s=" % (old, new), DeprecationWarning, stacklevel=3)
    return bool(old_value)


class Importer(_Handle):
    """The consumer's side: a connection to the exporter at path, mapping its buffers on
    device. One per exporter per process (DuplicateImporter otherwise); a process cannot
    import its own exports (NotSupported: use the buffer's pointer). With
    wait_for_exporter, it waits (up to timeout) for an exporter to listen there, as a
    replica started before its producer does. (A keyword that makes a call wait for
    something to be there, instead of failing at once, is wait_for_<thing>, as Go's
    WaitFor<Thing> options: wait_for_exporter, wait_for_name, Pool's wait_for_memory,
    kv.Replica's wait_for_owner. wait=, their former name here, still works, with a
    DeprecationWarning.)

    When the exporter's process ends, alive turns False, error says why, done_fd() becomes
    readable (for selectors, asyncio's add_reader, poll) and wait_done returns True;
    opens raise Gone, and mappings on another GPU than the exporter's raise MappingLost
    (release them)."""

    def __init__(self, path: str, device: int = 0, timeout: Timeout_ = DEFAULT_TIMEOUT, *,
                 wait_for_exporter: bool = False, wait: Optional[bool] = None):
        wait_for_exporter = _renamed("wait_for_exporter", wait_for_exporter, "wait", wait)
        o = _lib.options(_lib.DialOptions)
        o.flags = 1 if wait_for_exporter else 0
        h = _lib.ImporterH()
        self.device = _lib.device(device)
        _lib.call("cudapool_importer_dial", _lib.encode_name(path, "path"), self.device, ctypes.byref(o),
                  _lib.timeout_ms(timeout), ctypes.byref(h))
        self._h, self.path = h.h, path

    @property
    def _ch(self) -> "_lib.ImporterH":
        return _lib.ImporterH(self._h)

    def open(self, name: str, stream: StreamLike = None, timeout: Timeout_ = DEFAULT_TIMEOUT, *,
             wait_for_name: bool = False, local_copy: Union[bool, Pool] = False,
             replica: Union[bool, Pool, None] = None, wait: Optional[bool] = None) -> "Mapping":
        """Leases the buffer published under name and maps it. Work queued on stream (of
        this importer's device) after the call sees the producer's writes. With
        wait_for_name (wait, its former name, still works with a DeprecationWarning), it
        waits (up to timeout) for the name to be published. With local_copy (True, or a
        Pool that grants the exporter's device access) it copies the buffer into memory of
        this device and gives the lease back: the Mapping then outlives its producer on
        any GPU. replica is local_copy's former name, still accepted. Release the Mapping
        when done."""
        wait_for_name = _renamed("wait_for_name", wait_for_name, "wait", wait)
        if replica is not None:
            local_copy = replica
        o = _lib.options(_lib.OpenOptions)
        o.flags = (1 if wait_for_name else 0) | (2 if local_copy is not False and local_copy is not None else 0)
        if isinstance(local_copy, Pool):
            o.replica_pool = _lib.PoolH(local_copy.handle)
        elif not isinstance(local_copy, bool) and local_copy is not None:
            raise TypeError("local_copy must be a bool or a Pool, not %s" % type(local_copy).__name__)
        h = _lib.MappingH()
        s = stream_handle(stream)
        _lib.call("cudapool_importer_open", self._ch, _lib.encode_name(name), ctypes.c_void_p(s or None),
                  ctypes.byref(o), _lib.timeout_ms(timeout), ctypes.byref(h))
        return Mapping(h.h, name, self.device, s)

    def open_all(self, names: Sequence[str], stream: StreamLike = None,
                 timeout: Timeout_ = DEFAULT_TIMEOUT) -> List["Mapping"]:
        """Opens every name in one round trip: the Mappings in the order of names, all or
        none (at most MAX_BATCH)."""
        names = list(names)
        if not 0 < len(names) <= MAX_BATCH:
            raise ValueError("%d names: want 1 to %d" % (len(names), MAX_BATCH))
        arr = (_lib.cstr * len(names))(*[_lib.encode_name(n) for n in names])
        out = (_lib.MappingH * len(names))()
        s = stream_handle(stream)
        _lib.call("cudapool_importer_open_all", self._ch, arr, len(names), ctypes.c_void_p(s or None),
                  _lib.timeout_ms(timeout), out)
        return [Mapping(out[i].h, n, self.device, s) for i, n in enumerate(names)]

    def release_all(self, mappings: Sequence["Mapping"], stream: StreamLike = None,
                    timeout: Timeout_ = DEFAULT_TIMEOUT) -> None:
        """Releases the mappings in one round trip, once the work queued on stream (None:
        the legacy default stream) before the call is done."""
        ms = list(mappings)
        if not 0 < len(ms) <= MAX_BATCH:
            raise ValueError("%d mappings: want 1 to %d" % (len(ms), MAX_BATCH))
        for m in ms:
            if not isinstance(m, Mapping):
                raise TypeError("release_all takes Mappings, not %s" % type(m).__name__)
            if not m.handle:
                raise InvalidHandle(2, "cudapool: mapping %r was released" % m.name)
        arr = (_lib.MappingH * len(ms))(*[_lib.MappingH(m.handle) for m in ms])
        try:
            _lib.call("cudapool_importer_release_all", self._ch, arr, len(ms), _vp(stream), _lib.timeout_ms(timeout))
        except (InvalidArgument, InvalidHandle, ProtocolError):
            raise  # refused before anything was released: the mappings stay held
        except CudapoolError:
            for m in ms:  # released all the same, but for what the exporter refused
                m._h = 0
            raise
        for m in ms:
            m._h = 0

    @property
    def alive(self) -> bool:
        """Whether the exporter is still there (False once closed)."""
        return self._h != 0 and self.error is None

    @property
    def error(self) -> Optional[CudapoolError]:
        """None while the exporter is there, else why not (Gone; Closed after close)."""
        if not self._h:
            return Closed(_lib.CLOSED, "cudapool: importer was closed")
        status = _lib.lib().cudapool_importer_err(self._ch)
        return None if status == 0 else _lib.error(status)

    def done_fd(self) -> int:
        """A file descriptor that becomes readable once the exporter is gone. It is the
        importer's: do not close it, nor use it after close."""
        fd = ctypes.c_int(-1)
        _lib.call("cudapool_importer_done_fd", self._ch, ctypes.byref(fd))
        return fd.value

    def wait_done(self, timeout: Optional[float]) -> bool:
        """Waits up to timeout seconds (None: no bound; 0: just look) for the exporter to
        be gone; True if it is."""
        if timeout is not None and timeout < 0:
            raise ValueError("timeout %r is negative" % timeout)
        with selectors.DefaultSelector() as sel:
            sel.register(self.done_fd(), selectors.EVENT_READ)
            return bool(sel.select(timeout))

    def close(self, timeout: Timeout_ = DEFAULT_TIMEOUT) -> None:
        """Frees whatever is still mapped (release first) and says goodbye."""
        if self._h:
            h, self._h = self._h, 0
            _lib.call("cudapool_importer_close", _lib.ImporterH(h), _lib.timeout_ms(timeout))

    def __repr__(self) -> str:
        if not self._h:
            state = "closed"
        else:
            state = "alive" if self.alive else "exporter gone"
        return "<cudapool.Importer %r device=%d %s>" % (self.path, self.device, state)


def _cai_stream(s: int) -> int:
    # __cuda_array_interface__ v3 forbids 0 (ambiguous): the legacy default stream is 1.
    return 1 if s == 0 else s


class Mapping(_Handle):
    """A buffer of another process mapped into this one: ptr, size, name, device, meta
    (the bytes published with it) and the stream it was opened on. Through
    __cuda_array_interface__ it is a 1-D uint8 array whose data is valid on that stream;
    view() gives it another dtype and shape. Once released, or lost (its exporter died
    and it lives on another GPU), every use raises: InvalidHandle or MappingLost; a
    second release too, and only close (the with block's end) does nothing then.
    cudapool.torch.open_tensor sets tensor, its view of the memory as a torch tensor."""

    tensor: Any  # set by cudapool.torch.open_tensor only

    def __init__(self, handle: int, name: str, device: int, stream: int):
        self._h, self.name, self.device, self.stream = handle, name, device, stream
        p, n, meta_len = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_size_t()
        _lib.call("cudapool_mapping_info", self._ch, ctypes.byref(p), ctypes.byref(n), ctypes.byref(meta_len))
        self._ptr, self.size, self.meta = p.value or 0, n.value, b""
        if meta_len.value:
            self.meta = _lib.call_sized("cudapool_mapping_meta", self._ch, cap=meta_len.value)

    @property
    def _ch(self) -> "_lib.MappingH":
        return _lib.MappingH(self._h)

    @property
    def error(self) -> Optional[CudapoolError]:
        """None while the mapping may be used, else why not (MappingLost, InvalidHandle)."""
        if not self._h:
            return InvalidHandle(2, "cudapool: mapping %r was released" % self.name)
        status = _lib.lib().cudapool_mapping_err(self._ch)
        return None if status == 0 else _lib.error(status)

    @property
    def lost(self) -> bool:
        """Whether the mapping must not be read because its exporter is gone and it lives
        on another GPU (release it). It turns True once the kernel says the exporter's
        process exited, which can be a moment after the connection's end that
        Importer.wait_done reports: a consumer on another GPU stops reading at the first
        of the two."""
        return isinstance(self.error, MappingLost)

    def check(self) -> None:
        """Raises the reason the mapping may not be used, if there is one."""
        e = self.error
        if e is not None:
            raise e

    @property
    def ptr(self) -> int:
        """The mapped range's address in this process (raises once released or lost)."""
        self.check()
        return self._ptr

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": _cai_stream(self.stream)}

    def view(self, typestr: str, shape: Sequence[int], strides: Optional[Sequence[int]] = None,
             offset: int = 0) -> "ArrayView":
        """An ArrayView of the mapping's memory from offset: typestr is a
        __cuda_array_interface__ type string ("<f2", "|u1", ...), or "bf16"; strides are
        in bytes (None: C order)."""
        self.check()
        return ArrayView(self, typestr, shape, strides, offset)

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self.view("|u1", (self.size,)).__dlpack__(stream)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (_dlpack.KDL_CUDA, self.device)

    def release(self, stream: StreamLike = None, timeout: Timeout_ = DEFAULT_TIMEOUT) -> None:
        """Gives the mapping back once the work queued on stream (default: the stream it
        was opened on) before the call is done. A lost mapping is released too: that
        frees its import without touching the memory. Releasing a released mapping is a
        bug and raises InvalidHandle, as C's CUDAPOOL_EHANDLE and Go's ErrReleased say
        (close, and the with block's end, are the calls that do nothing the second
        time)."""
        if not self._h:
            raise InvalidHandle(2, "cudapool: mapping %r was released already" % self.name)
        h, self._h = self._h, 0
        s = self.stream if stream is None else stream_handle(stream)
        _lib.call("cudapool_mapping_release", _lib.MappingH(h), ctypes.c_void_p(s or None),
                  _lib.timeout_ms(timeout))

    def close(self) -> None:
        """release() on the stream the mapping was opened on; on a released mapping it
        does nothing (as a file's close)."""
        if self._h:
            self.release()

    def __repr__(self) -> str:
        e = None if not self._h else self.error
        state = "released" if not self._h else ("lost" if isinstance(e, MappingLost) else "mapped")
        return "<cudapool.Mapping %r %#x size=%d device=%d %s>" % (self.name, self._ptr, self.size, self.device,
                                                                  state)


class ArrayView:
    """A typed, shaped window on a Mapping, for __cuda_array_interface__ and DLPack
    consumers. Through DLPack (torch.from_dlpack, cupy.from_dlpack) the array is on the
    importer's device, also where that is not the producer's: a consumer on another GPU
    then reads the producer's memory over NVLink, where __cuda_array_interface__
    consumers would place the array on the producer's GPU. Every element it reaches lies
    in the mapping: shape, strides (bytes, multiples of the item size) and offset are
    checked."""

    def __init__(self, mapping: Mapping, typestr: str, shape: Sequence[int],
                 strides: Optional[Sequence[int]] = None, offset: int = 0):
        itemsize = 2 if typestr == "bf16" else int(typestr[2:])
        shape = tuple(_lib.integer(d, "shape", 0, _lib.U64_MAX) for d in shape)
        offset = _lib.integer(offset, "offset", 0, _lib.U64_MAX)
        if strides is None:
            st, step = [], itemsize
            for d in reversed(shape):
                st.append(step)
                step *= d
            byte_strides = tuple(reversed(st))
        else:
            byte_strides = tuple(_lib.integer(s, "stride", -_lib.U64_MAX, _lib.U64_MAX) for s in strides)
            if len(byte_strides) != len(shape):
                raise ValueError("%d strides for %d dimensions" % (len(byte_strides), len(shape)))
            for s in byte_strides:
                if s % itemsize:
                    raise ValueError("stride %d is not a multiple of the item size %d" % (s, itemsize))
        lo = hi = offset
        empty = any(d == 0 for d in shape)
        if not empty:
            for d, s in zip(shape, byte_strides):
                if s < 0:
                    lo += (d - 1) * s
                else:
                    hi += (d - 1) * s
            hi += itemsize
        if lo < 0 or hi > mapping.size:
            raise ValueError("the view reaches bytes %d to %d, outside the %d-byte mapping" % (lo, hi, mapping.size))
        self.mapping, self.typestr, self.shape = mapping, typestr, shape
        self.strides = None if strides is None else byte_strides
        self.offset, self.itemsize = offset, itemsize

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        if self.typestr == "bf16":
            raise TypeError("__cuda_array_interface__ has no bfloat16: use DLPack")
        cai = dict(self.mapping.__cuda_array_interface__)
        cai.update(shape=self.shape, typestr=self.typestr, strides=self.strides,
                   data=(self.mapping.ptr + self.offset, False))
        return cai

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        """A DLPack capsule; stream (the consumer's; -1: none) is made to wait for the
        stream the mapping was opened on."""
        m = self.mapping
        ptr = m.ptr  # raises once released or lost
        if stream != -1:
            stream_wait(m.device, 0 if stream in (None, 1) else stream, m.stream)
        return _dlpack.capsule(self, ptr + self.offset, m.device, _dlpack.dtype_of(self.typestr),
                               self.shape, self.strides, self.itemsize)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (_dlpack.KDL_CUDA, self.mapping.device)

    def __repr__(self) -> str:
        return "<cudapool.ArrayView %s %s of %r>" % (self.typestr, self.shape, self.mapping.name)


from . import vmm  # noqa: E402 (it builds on the classes above)
