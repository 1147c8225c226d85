"""Loading libcudapool and calling it: the ctypes signatures, status codes and errors.

Everything else in the package goes through call(), which turns a non-zero status into
the matching CudapoolError subclass carrying the library's message.
"""

import ctypes
import os

u64 = ctypes.c_uint64
i64 = ctypes.c_int64
c_int = ctypes.c_int
size_t = ctypes.c_size_t
vp = ctypes.c_void_p
cstr = ctypes.c_char_p

LIB_ENV = "CUDAPOOL_LIB"


def library_path():
    """Where libcudapool.so is: $CUDAPOOL_LIB, else beside this package, else the
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


class PoolOptions(ctypes.Structure):
    _fields_ = [
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


class PoolStats(ctypes.Structure):
    _fields_ = [("device", c_int), ("handle_type", c_int)] + [
        (name, u64) for name in (
            "max_size", "granularity", "reserved_current", "reserved_high",
            "used_current", "used_high", "live_buffers", "bytes_requested",
            "bytes_reserved", "shared_buffers", "active_leases", "deferred_frees",
            "failed_frees", "cached_buffers", "cached_bytes")
    ]


# name: (argument types), every one returning an int status.
_SIGNATURES = {
    "cudapool_protocol_version": (ctypes.POINTER(c_int),),
    "cudapool_init": (cstr, ctypes.c_char_p, size_t),
    "cudapool_runtime_info": (ctypes.POINTER(c_int), ctypes.POINTER(c_int), ctypes.c_char_p, size_t),
    "cudapool_stream_create": (c_int, ctypes.POINTER(vp)),
    "cudapool_stream_destroy": (c_int, vp),
    "cudapool_stream_synchronize": (c_int, vp),
    "cudapool_stream_wait": (c_int, vp, vp),
    "cudapool_copy_to_device": (c_int, vp, vp, size_t, vp),
    "cudapool_copy_from_device": (c_int, vp, vp, size_t, vp),
    "cudapool_pool_create": (c_int, ctypes.POINTER(PoolOptions), ctypes.POINTER(u64)),
    "cudapool_pool_stats_get": (u64, ctypes.POINTER(PoolStats)),
    "cudapool_pool_close": (u64, c_int, i64),
    "cudapool_alloc": (u64, u64, vp, ctypes.POINTER(vp)),
    "cudapool_free": (vp, vp),
    "cudapool_exporter_listen": (cstr, cstr, c_int, ctypes.POINTER(u64)),
    "cudapool_exporter_publish": (u64, cstr, vp, u64, vp, ctypes.c_char_p, size_t),
    "cudapool_exporter_unpublish": (u64, cstr),
    "cudapool_exporter_push": (u64, c_int, cstr, i64),
    "cudapool_exporter_state": (u64, ctypes.c_char_p, size_t, ctypes.POINTER(size_t)),
    "cudapool_exporter_close": (u64, i64),
    "cudapool_query_state": (cstr, i64, ctypes.c_char_p, size_t, ctypes.POINTER(size_t)),
    "cudapool_importer_dial": (cstr, c_int, i64, ctypes.POINTER(u64)),
    "cudapool_importer_open": (u64, cstr, vp, i64, ctypes.POINTER(u64)),
    "cudapool_importer_close": (u64, i64),
    "cudapool_mapping_info": (u64, ctypes.POINTER(vp), ctypes.POINTER(u64), ctypes.POINTER(size_t)),
    "cudapool_mapping_meta": (u64, ctypes.c_char_p, size_t, ctypes.POINTER(size_t)),
    "cudapool_mapping_release": (u64, vp, i64),
    "cudapool_torch_configure": (ctypes.POINTER(PoolOptions),),
    "cudapool_torch_pool": (c_int, ctypes.POINTER(u64)),
}

_lib = None
_path = None


def lib():
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


def loaded_path():
    lib()
    return _path


class CudapoolError(Exception):
    """A libcudapool call failed. status is its CUDAPOOL_E* code, status_name its name;
    the message is the library's."""

    status = None

    def __init__(self, status, message):
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
    """The pool or the device is out of memory."""


class NotFound(CudapoolError, LookupError):
    """No buffer is published under that name (or no such peer)."""


class NameInUse(CudapoolError):
    """The name is published already (or the socket has a live exporter)."""


class Busy(CudapoolError):
    """The pool still has live buffers."""


class Gone(CudapoolError):
    """The exporter or the buffer is gone."""


class Refused(CudapoolError, PermissionError):
    """The exporter did not admit this process."""


class VersionMismatch(CudapoolError):
    """The peer speaks another protocol version."""


class ProtocolError(CudapoolError):
    """The peer broke the protocol."""


class Timeout(CudapoolError, TimeoutError):
    """The call ran out of time and holds nothing."""


class NoRuntime(CudapoolError):
    """No CUDA runtime: none loads, or another was chosen already."""


class CudaError(CudapoolError):
    """The CUDA runtime failed."""


class ForkedProcess(CudapoolError):
    """This process was forked after the library was loaded: use spawn."""


class NotSupported(CudapoolError):
    """A valid request that this library or host does not support."""


class InternalError(CudapoolError):
    """A bug in cudapool."""


class SystemFailure(CudapoolError, OSError):
    """The system failed: a socket, a file, a process."""


class NoSpace(CudapoolError):
    """The KV page pool has not enough free or evictable pages: nothing was leased."""


class StaleLease(CudapoolError):
    """The KV owner holds no such lease for this replica: released or sealed already,
    another replica's, or never issued."""


_ERRORS = {
    1: InvalidArgument, 2: InvalidHandle, 3: ForeignPointer, 4: Closed, 5: OutOfMemory,
    6: NotFound, 7: NameInUse, 8: Busy, 9: Gone, 10: Refused, 11: VersionMismatch,
    12: ProtocolError, 13: Timeout, 14: InvalidArgument, 15: NoRuntime, 16: CudaError,
    17: ForkedProcess, 18: NotSupported, 19: InternalError, 20: SystemFailure,
    21: NoSpace, 22: StaleLease,
}

ERANGE = 14


def error(status):
    """The exception for status, with this thread's last message."""
    msg = lib().cudapool_last_error().decode(errors="replace")
    return _ERRORS.get(status, CudapoolError)(status, msg or "status %d" % status)


def call(name, *args):
    """Calls the library function name and raises on a non-zero status."""
    status = getattr(lib(), name)(*args)
    if status != 0:
        raise error(status)


def call_sized(name, *args, cap=4096):
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


def timeout_ms(timeout):
    """timeout in seconds (None: no bound) as the library's milliseconds (0: no bound)."""
    if timeout is None:
        return 0
    if timeout <= 0:
        raise ValueError("timeout must be positive seconds, or None for no bound")
    return max(1, int(timeout * 1000))


def encode_name(name, what="name"):
    if not isinstance(name, str):
        raise TypeError("%s must be a str, not %s" % (what, type(name).__name__))
    return name.encode()
