"""Loading libcudapool and calling it: the ctypes signatures, status codes and errors.

Everything else in the package goes through call(), which turns a non-zero status into
the matching CudapoolError subclass carrying the library's message. The checks here
(names, sizes, streams, pids) run before ctypes sees a value, which would otherwise
truncate a string at a NUL or wrap an integer silently.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional, Type, TypeVar, Union

u64 = ctypes.c_uint64
u32 = ctypes.c_uint32
i64 = ctypes.c_int64
c_int = ctypes.c_int
size_t = ctypes.c_size_t
vp = ctypes.c_void_p
cstr = ctypes.c_char_p

LIB_ENV = "CUDAPOOL_LIB"

U64_MAX = (1 << 64) - 1
PTR_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_void_p))) - 1
INT_MAX = (1 << 31) - 1
INT_MIN = -(1 << 31)


def library_path() -> str:
    """Where libcudapool.so is, first found: $CUDAPOOL_LIB (an explicit choice wins),
    else beside this package (where `pip install ./python` copies it from bin/), else the
    repository's bin/ (where `go build -buildmode=c-shared -o bin/libcudapool.so ./capi`
    puts it)."""
    env = os.environ.get(LIB_ENV)
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "libcudapool.so"),
                 os.path.join(here, "..", "..", "bin", "libcudapool.so")):
        if os.path.exists(cand):
            return os.path.normpath(cand)
    raise OSError(
        "libcudapool.so not found: set $%s, or build it with "
        "`go build -buildmode=c-shared -o bin/libcudapool.so ./capi`" % LIB_ENV)


# The handles of cudapool.h: a struct of one uint64 each, so that ctypes refuses one
# kind where another is wanted, as a C compiler does.
class PoolH(ctypes.Structure):
    _fields_ = [("h", u64)]


class ExporterH(ctypes.Structure):
    _fields_ = [("h", u64)]


class ImporterH(ctypes.Structure):
    _fields_ = [("h", u64)]


class MappingH(ctypes.Structure):
    _fields_ = [("h", u64)]


class ChunkH(ctypes.Structure):
    _fields_ = [("h", u64)]


class ReservationH(ctypes.Structure):
    _fields_ = [("h", u64)]


class PoolOptions(ctypes.Structure):
    _fields_ = [
        ("size", size_t),
        ("name", cstr),
        ("handle_type", c_int),
        ("max_size", u64),
        ("release_threshold", u64),
        ("has_release_threshold", c_int),
        ("wait_for_memory", c_int),
        ("peer_devices", ctypes.POINTER(c_int)),
        ("peer_count", c_int),
        ("cache_bytes", u64),
    ]


class ListenOptions(ctypes.Structure):
    _fields_ = [
        ("size", size_t),
        ("name", cstr),
        ("flags", c_int),
        ("allow_uids", ctypes.POINTER(u32)),
        ("uid_count", size_t),
        ("allow_gids", ctypes.POINTER(u32)),
        ("gid_count", size_t),
        ("max_grants", c_int),
    ]


class DialOptions(ctypes.Structure):
    _fields_ = [("size", size_t), ("flags", c_int)]


class OpenOptions(ctypes.Structure):
    _fields_ = [("size", size_t), ("flags", c_int), ("replica_pool", PoolH)]


class PublishEntry(ctypes.Structure):
    _fields_ = [("name", cstr), ("ptr", vp), ("size", u64), ("meta", ctypes.c_char_p), ("meta_len", size_t)]


class ChunkEntry(ctypes.Structure):
    _fields_ = [("name", cstr), ("offset", u64), ("size", u64), ("meta", ctypes.c_char_p), ("meta_len", size_t)]


_Options = TypeVar("_Options", bound=ctypes.Structure)


def options(cls: Type[_Options]) -> _Options:
    """A new options struct of cls with its size set, as the header's _default does."""
    o = cls()
    o.size = ctypes.sizeof(cls)
    return o


class PoolStats(ctypes.Structure):
    _fields_ = [("device", c_int), ("handle_type", c_int)] + [
        (name, u64) for name in (
            "max_size", "granularity", "reserved_current", "reserved_high",
            "used_current", "used_high", "live_buffers", "bytes_requested",
            "bytes_reserved", "shared_buffers", "active_leases", "deferred_frees",
            "failed_frees", "cached_buffers", "cached_bytes")
    ]


LOG_FN = ctypes.CFUNCTYPE(None, c_int, ctypes.c_char_p, vp)
LOG_NONE = LOG_FN(0)  # the NULL callback (address 0), which turns the library's log off

P = ctypes.POINTER
# name: (argument types), every one returning an int status.
_SIGNATURES = {
    "cudapool_version": (P(c_int), P(c_int)),
    "cudapool_protocol_version": (P(c_int),),
    "cudapool_set_log": (c_int, LOG_FN, vp),
    "cudapool_init": (cstr, ctypes.c_char_p, size_t),
    "cudapool_runtime_info": (P(c_int), P(c_int), ctypes.c_char_p, size_t),
    "cudapool_stream_create": (c_int, P(vp)),
    "cudapool_stream_destroy": (c_int, vp),
    "cudapool_stream_synchronize": (c_int, vp),
    "cudapool_stream_wait": (c_int, vp, vp),
    "cudapool_copy_to_device": (c_int, vp, vp, size_t, vp),
    "cudapool_copy_from_device": (c_int, vp, vp, size_t, vp),
    "cudapool_pool_options_init": (P(PoolOptions), size_t),
    "cudapool_pool_create": (c_int, P(PoolOptions), P(PoolH)),
    "cudapool_pool_stats_get": (PoolH, P(PoolStats)),
    "cudapool_pool_close": (PoolH, c_int, i64),
    "cudapool_alloc": (PoolH, u64, vp, i64, P(vp)),
    "cudapool_free": (vp, vp),
    "cudapool_exporter_listen": (cstr, P(ListenOptions), P(ExporterH)),
    "cudapool_exporter_publish": (ExporterH, cstr, vp, u64, vp, ctypes.c_char_p, size_t),
    "cudapool_exporter_publish_all": (ExporterH, P(PublishEntry), size_t, vp),
    "cudapool_exporter_unpublish": (ExporterH, cstr),
    "cudapool_exporter_push": (ExporterH, c_int, cstr, i64),
    "cudapool_exporter_state": (ExporterH, ctypes.c_char_p, size_t, P(size_t)),
    "cudapool_exporter_close": (ExporterH, i64),
    "cudapool_query_state": (cstr, i64, ctypes.c_char_p, size_t, P(size_t)),
    "cudapool_importer_dial": (cstr, c_int, P(DialOptions), i64, P(ImporterH)),
    "cudapool_importer_open": (ImporterH, cstr, vp, P(OpenOptions), i64, P(MappingH)),
    "cudapool_importer_open_all": (ImporterH, P(cstr), size_t, vp, i64, P(MappingH)),
    "cudapool_importer_release_all": (ImporterH, P(MappingH), size_t, vp, i64),
    "cudapool_importer_done_fd": (ImporterH, P(c_int)),
    "cudapool_importer_err": (ImporterH,),
    "cudapool_importer_close": (ImporterH, i64),
    "cudapool_mapping_info": (MappingH, P(vp), P(u64), P(size_t)),
    "cudapool_mapping_meta": (MappingH, ctypes.c_char_p, size_t, P(size_t)),
    "cudapool_mapping_err": (MappingH,),
    "cudapool_mapping_release": (MappingH, vp, i64),
    "cudapool_vmm_granularity": (c_int, c_int, P(u64)),
    "cudapool_chunk_create": (c_int, u64, c_int, P(ChunkH)),
    "cudapool_chunk_info": (ChunkH, P(c_int), P(u64), P(c_int)),
    "cudapool_chunk_close": (ChunkH,),
    "cudapool_reservation_create": (c_int, u64, P(ReservationH)),
    "cudapool_reservation_grow": (ReservationH, P(ChunkH), size_t),
    "cudapool_reservation_shrink": (ReservationH, size_t),
    "cudapool_reservation_info": (ReservationH, P(vp), P(u64), P(u64), P(size_t)),
    "cudapool_reservation_close": (ReservationH,),
    "cudapool_exporter_publish_chunks": (ExporterH, cstr, P(ChunkH), size_t, u64, u64, vp, ctypes.c_char_p, size_t),
    "cudapool_exporter_publish_chunks_all": (ExporterH, P(ChunkH), size_t, P(ChunkEntry), size_t, vp),
    "cudapool_torch_configure": (P(PoolOptions),),
    "cudapool_torch_pool": (c_int, P(PoolH)),
}

_lib: Any = None
_path: Optional[str] = None


def lib() -> Any:
    """The loaded library, loaded at the first call."""
    global _lib, _path
    if _lib is None:
        path = library_path()
        l = ctypes.CDLL(path)
        for name, args in _SIGNATURES.items():
            f = getattr(l, name)
            f.argtypes = args
            f.restype = c_int
        l.cudapool_last_error.argtypes = ()
        l.cudapool_last_error.restype = ctypes.c_char_p
        l.cudapool_status_name.argtypes = (c_int,)
        l.cudapool_status_name.restype = ctypes.c_char_p
        _lib, _path = l, path
    return _lib


def loaded_path() -> str:
    lib()
    assert _path is not None
    return _path


class CudapoolError(Exception):
    """A libcudapool call failed. status is its CUDAPOOL_E* code, status_name its name;
    the message is the library's."""

    status: int = 0

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.status_name = lib().cudapool_status_name(status).decode()


class InvalidArgument(CudapoolError, ValueError):
    """A bad argument: a NULL pointer, a size of 0, a bad name, ..."""


class InvalidHandle(CudapoolError, ValueError):
    """An object that was closed or released, or a handle the library never gave."""


class ForeignPointer(CudapoolError, ValueError):
    """A device pointer that no cudapool pool of this process gave (or that was freed)."""


class Closed(CudapoolError):
    """The object is closed or closing."""


class OutOfMemory(CudapoolError, MemoryError):
    """The pool or the device is out of memory (or a request can never fit the pool)."""


class NotFound(CudapoolError, LookupError):
    """No buffer is published under that name (never, or no more: its buffer was
    freed), or no such peer."""


class NameInUse(CudapoolError):
    """The name is published already (or the socket has a live exporter)."""


class Busy(CudapoolError):
    """The pool still has live buffers."""


class Gone(CudapoolError):
    """The exporter (or the KV owner) is gone."""


class Refused(CudapoolError, PermissionError):
    """The exporter (or the KV owner) did not admit this process."""


class VersionMismatch(CudapoolError):
    """The peer speaks another protocol version."""


class ProtocolError(CudapoolError):
    """The peer broke the protocol, or found a request malformed."""


class Timeout(CudapoolError, TimeoutError):
    """The call ran out of time and holds nothing."""


class NoRuntime(CudapoolError):
    """No CUDA runtime: none loads, or another was chosen already."""


class CudaError(CudapoolError):
    """The CUDA runtime failed."""


class ForkedProcess(CudapoolError):
    """This process was forked after the library was loaded: use spawn."""


class NotSupported(CudapoolError):
    """A valid request that this library or host does not support (such as importing
    this process's own export)."""


class InternalError(CudapoolError):
    """A bug in cudapool."""


class SystemFailure(CudapoolError, OSError):
    """The system failed: a socket, a file, a process."""


class StreamDevice(CudapoolError, ValueError):
    """A stream of another device than the importer's."""


class DuplicateImporter(CudapoolError):
    """This process has an Importer for that exporter already: share it."""


class TooManyGrants(CudapoolError):
    """The connection holds as many grants as the exporter allows, or a KV owner's cap
    (connections, leases, leased pages, notifiers) is full: the message names it.
    Release some."""


class MappingLost(Gone):
    """The mapping's exporter is gone and the mapping lives on another GPU: reading it
    would lose this process's CUDA context. Stop the work that reads it and release it
    (or open with local_copy=True)."""


class ExporterFailed(CudapoolError):
    """The exporter failed to serve the request for a reason of its own (its message)."""


class Abandoned(CudapoolError, TimeoutError):
    """Exporter.close ran out of time with buffers still held: the exporter is closed all
    the same, and each buffer goes back to its pool once its consumer releases it or
    exits. Unlike Timeout, the call did its work."""


class StaleLease(CudapoolError):
    """The exporter or KV owner holds no such lease: released (or sealed) already,
    another's, or never issued. Nothing changed."""


class BadDirectory(CudapoolError, PermissionError):
    """The announce directory is not private to this user."""


class NoSpace(CudapoolError):
    """The KV page pool has not enough free or evictable pages: nothing was leased."""




_ERRORS = {
    1: InvalidArgument, 2: InvalidHandle, 3: ForeignPointer, 4: Closed, 5: OutOfMemory,
    6: NotFound, 7: NameInUse, 8: Busy, 9: Gone, 10: Refused, 11: VersionMismatch,
    12: ProtocolError, 13: Timeout, 14: InvalidArgument, 15: NoRuntime, 16: CudaError,
    17: ForkedProcess, 18: NotSupported, 19: InternalError, 20: SystemFailure,
    21: StreamDevice, 22: DuplicateImporter, 23: TooManyGrants, 24: MappingLost,
    25: ExporterFailed, 26: Abandoned, 27: StaleLease, 28: BadDirectory, 29: NoSpace,
}

ERANGE = 14
NO_WAIT = -1  # CUDAPOOL_NO_WAIT
CLOSED = 4
LOST = 24


def error(status: int) -> CudapoolError:
    """The exception for status, with this thread's last message."""
    msg = lib().cudapool_last_error().decode(errors="replace")
    return _ERRORS.get(status, CudapoolError)(status, msg or "status %d" % status)


def call(name: str, *args: Any) -> None:
    """Calls the library function name and raises on a non-zero status."""
    status = getattr(lib(), name)(*args)
    if status != 0:
        raise error(status)


def call_sized(name: str, *args: Any, cap: int = 4096) -> bytes:
    """Calls a function that writes into (buf, cap, &len), growing the buffer until it
    fits, and returns the bytes."""
    n = size_t()
    while True:
        buf = ctypes.create_string_buffer(cap)
        status = getattr(lib(), name)(*args, buf, cap, ctypes.byref(n))
        if status == 0:
            return buf.raw[:n.value]
        if status != ERANGE:
            raise error(status)
        cap = n.value + 1


def timeout_ms(timeout: Optional[float]) -> int:
    """timeout in seconds as the library's timeout_ms, by Python's convention: None is
    no bound (the C ABI's 0), 0 is do not wait (CUDAPOOL_NO_WAIT, -1: the wait flags
    are off and an answer is waited for at most a second); a negative timeout is
    refused."""
    if timeout is None:
        return 0
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError("timeout must be seconds (a number) or None, not %s" % type(timeout).__name__)
    if timeout < 0 or timeout != timeout:
        raise ValueError("timeout %r: want seconds >= 0 (0: do not wait; None: no bound)" % timeout)
    if timeout == 0:
        return NO_WAIT
    return min(max(1, int(timeout * 1000)), (1 << 63) - 1)


def encode_name(name: Any, what: str = "name") -> bytes:
    """name as the C string the library takes: a str without NUL (ctypes would cut it
    there), or os.PathLike for a path."""
    if isinstance(name, os.PathLike) and what in ("path", "socket"):
        name = os.fspath(name)
    if not isinstance(name, str):
        raise TypeError("%s must be a str, not %s" % (what, type(name).__name__))
    if "\0" in name:
        raise ValueError("%s %r holds a NUL character" % (what, name))
    return name.encode()


def integer(v: Any, what: str, lo: int, hi: int) -> int:
    """v as an int in [lo, hi]: TypeError for a non-integer (bool included), ValueError
    below lo, OverflowError above hi."""
    n: int
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            n = v.__index__()
        except AttributeError:
            raise TypeError("%s must be an int, not %s" % (what, type(v).__name__)) from None
    else:
        n = v
    if n < lo:
        raise ValueError("%s %d is below %d" % (what, n, lo))
    if n > hi:
        raise OverflowError("%s %d is above %d" % (what, n, hi))
    return n


def device(d: Any) -> int:
    return integer(d, "device", 0, INT_MAX)


def size(n: Any, what: str = "size", lo: int = 0) -> int:
    return integer(n, what, lo, U64_MAX)


def address(p: Any, what: str = "address") -> int:
    return integer(p, what, 0, PTR_MAX)


def meta_bytes(meta: Union[bytes, bytearray, memoryview, str, None]) -> bytes:
    """meta as bytes: str is UTF-8; anything else must be bytes-like (an int is not:
    bytes(5) would be five zero bytes)."""
    if meta is None:
        return b""
    if isinstance(meta, str):
        return meta.encode()
    try:
        return memoryview(meta).tobytes()
    except TypeError:
        raise TypeError("meta must be bytes-like or str, not %s" % type(meta).__name__) from None
