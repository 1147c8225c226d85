"""cudapool for Python: share GPU memory between processes through CUDA's IPC-capable
memory pools, with cudapool's leases and stream ordering (ctypes over libcudapool).

A producer publishes device memory of a cudapool pool under a name; consumers open it
as a Mapping, which any CUDA array library takes without a copy through
__cuda_array_interface__ (torch.as_tensor, cupy.asarray, cuda.core's
StridedMemoryView):

    ex = cudapool.Exporter("/tmp/kv.sock")
    ex.publish("kv", ptr, size, stream=s)          # ready once s's work so far is done

    imp = cudapool.Importer("/tmp/kv.sock", device=0)
    with imp.open("kv", stream=s) as m:            # s waits for the producer's writes
        t = torch.as_tensor(m, device="cuda:0")    # uint8 view, no copy

Every call that takes a stream takes the caller's: an int (cudaStream_t), a torch,
CuPy or cuda.core stream, or anything with __cuda_stream__; None is the legacy default
stream. Only the standard library is needed; cudapool.torch holds the PyTorch helpers.

The library runs a Go runtime, which does not survive fork(): a process forked after
it was loaded gets ForkedProcess from every call. Use multiprocessing's "spawn" start
method.
"""

import ctypes
import json

from . import _dlpack, _lib
from ._lib import (  # noqa: F401 (re-exported)
    Busy, Closed, CudaError, CudapoolError, ForeignPointer, ForkedProcess, Gone,
    InternalError, InvalidArgument, InvalidHandle, NameInUse, NoRuntime, NotFound,
    NotSupported, OutOfMemory, ProtocolError, Refused, SystemFailure, Timeout,
    VersionMismatch, library_path)

__all__ = [
    "init", "runtime_info", "protocol_version", "stream_handle", "stream_wait", "Stream", "Pool",
    "Exporter", "Importer", "Mapping", "ArrayView", "query_state", "copy_to_device",
    "copy_from_device", "library_path", "MAX_META", "DEFAULT_TIMEOUT",
    "CudapoolError", "InvalidArgument", "InvalidHandle", "ForeignPointer", "Closed", "OutOfMemory",
    "NotFound", "NameInUse", "Busy", "Gone", "Refused", "VersionMismatch", "ProtocolError", "Timeout",
    "NoRuntime", "CudaError", "ForkedProcess", "NotSupported", "InternalError", "SystemFailure",
]

MAX_META = 4096
DEFAULT_TIMEOUT = 30.0
HANDLE_TYPES = {"none": 0, "posix-fd": 1, "fabric": 8}


def init(prefer=None):
    """Chooses the runtime once per process: "auto" (None; a GPU when one is usable, else
    the software device), "gpu" or "test" (the software device). Returns the sentence
    saying which and why."""
    why = ctypes.create_string_buffer(512)
    _lib.call("cudapool_init", None if prefer is None else prefer.encode(), why, len(why))
    return why.value.decode()


def runtime_info():
    """(on_gpu, device_count, name) of the runtime in use, choosing it if none is."""
    on_gpu, n = ctypes.c_int(), ctypes.c_int()
    name = ctypes.create_string_buffer(256)
    _lib.call("cudapool_runtime_info", ctypes.byref(on_gpu), ctypes.byref(n), name, len(name))
    return bool(on_gpu.value), n.value, name.value.decode()


def protocol_version():
    """The sharing protocol's version; metadata travels with a publish from 2 on."""
    v = ctypes.c_int()
    _lib.call("cudapool_protocol_version", ctypes.byref(v))
    return v.value


def stream_handle(stream):
    """The cudaStream_t of stream as an int: None is 0 (the legacy default stream); an
    int is taken as is; otherwise __cuda_stream__ (cuda.core, CuPy), .cuda_stream
    (torch) or .ptr (CuPy)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError("stream %d is negative" % stream)
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        _, handle = proto() if callable(proto) else proto
        return int(handle)
    for attr in ("cuda_stream", "ptr"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    raise TypeError("not a stream: %r (want an int cudaStream_t, a torch, CuPy or cuda.core "
                    "stream, or an object with __cuda_stream__)" % (stream,))


def _vp(stream):
    return ctypes.c_void_p(stream_handle(stream) or None)


class Stream:
    """A stream of cudapool's runtime, for programs with no other CUDA library (and for
    the software device, which only cudapool's calls reach)."""

    def __init__(self, device=0):
        self.device = device
        h = ctypes.c_void_p()
        _lib.call("cudapool_stream_create", device, ctypes.byref(h))
        self.handle = h.value or 0

    def __cuda_stream__(self):
        return (0, self.handle)

    def synchronize(self):
        _lib.call("cudapool_stream_synchronize", self.device, ctypes.c_void_p(self.handle or None))

    def close(self):
        if self.handle:
            h, self.handle = self.handle, 0
            _lib.call("cudapool_stream_destroy", self.device, ctypes.c_void_p(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def stream_wait(device, waiter, waited):
    """Makes the work queued on waiter from now on wait for the work queued on waited so
    far (both on device); the host does not wait."""
    w, d = stream_handle(waiter), stream_handle(waited)
    if w != d:
        _lib.call("cudapool_stream_wait", device, ctypes.c_void_p(w or None), ctypes.c_void_p(d or None))


def copy_to_device(device, dst, data, stream=None):
    """Copies the bytes data to the device address dst, ordered on stream."""
    data = bytes(data)
    buf = ctypes.create_string_buffer(data, len(data))
    _lib.call("cudapool_copy_to_device", device, ctypes.c_void_p(dst), buf, len(data), _vp(stream))


def copy_from_device(device, src, n, stream=None):
    """Returns n bytes read from the device address src after stream's work so far."""
    buf = ctypes.create_string_buffer(n)
    _lib.call("cudapool_copy_from_device", device, buf, ctypes.c_void_p(src), n, _vp(stream))
    return buf.raw


def _pool_options(name=None, handle_type="posix-fd", max_size=0, release_threshold=None,
                  wait_for_memory=False, peer_devices=(), cache_bytes=0):
    if handle_type not in HANDLE_TYPES:
        raise ValueError("handle_type %r: want one of %s" % (handle_type, ", ".join(HANDLE_TYPES)))
    o = _lib.PoolOptions()
    o.name = None if name is None else name.encode()
    o.handle_type = HANDLE_TYPES[handle_type]
    o.max_size = max_size
    if release_threshold is not None:
        o.release_threshold, o.has_release_threshold = release_threshold, 1
    o.wait_for_memory = 1 if wait_for_memory else 0
    o.cache_bytes = cache_bytes
    peers = list(peer_devices)
    if peers:
        o.peer_devices = (ctypes.c_int * len(peers))(*peers)
        o.peer_count = len(peers)
    return o


class _Handle:
    """An object of the library, known by its handle; 0 once closed."""

    _h = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def handle(self):
        return self._h


class Pool(_Handle):
    """A cudapool pool on device: pool.New's options, stream-ordered alloc and free."""

    def __init__(self, device=0, *, name=None, handle_type="posix-fd", max_size=0,
                 release_threshold=None, wait_for_memory=False, peer_devices=(), cache_bytes=0):
        o = _pool_options(name, handle_type, max_size, release_threshold, wait_for_memory, peer_devices,
                          cache_bytes)
        h = ctypes.c_uint64()
        _lib.call("cudapool_pool_create", device, ctypes.byref(o), ctypes.byref(h))
        self._h, self.device = h.value, device

    def alloc(self, size, stream=None):
        """Returns the device address of at least size bytes, ready for work queued on
        stream after the call."""
        p = ctypes.c_void_p()
        _lib.call("cudapool_alloc", self._h, size, _vp(stream), ctypes.byref(p))
        return p.value

    @staticmethod
    def free(ptr, stream=None):
        """Frees ptr once stream's work so far is done (later, if other processes hold it)."""
        _lib.call("cudapool_free", ctypes.c_void_p(ptr), _vp(stream))

    def stats(self):
        s = _lib.PoolStats()
        _lib.call("cudapool_pool_stats_get", self._h, ctypes.byref(s))
        return {name: getattr(s, name) for name, _ in s._fields_}

    def close(self, force=False, timeout=DEFAULT_TIMEOUT):
        if self._h:
            _lib.call("cudapool_pool_close", self._h, 1 if force else 0, _lib.timeout_ms(timeout))
            self._h = 0


def _pointer_and_size(obj, size):
    """A publishable (address, size) from an int address or a __cuda_array_interface__."""
    if isinstance(obj, int):
        return obj, size
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError("publish wants a device address (int) or an object with "
                        "__cuda_array_interface__, not %s" % type(obj).__name__)
    if cai.get("strides") is not None:
        raise ValueError("publish wants contiguous memory (strides must be None)")
    n = int(cai["typestr"][2:])
    for d in cai["shape"]:
        n *= d
    return cai["data"][0], size or n


class Exporter(_Handle):
    """The producer's side: publishes memory of cudapool pools under names, on a Unix
    socket at path (created 0600). name is the process name poolstat shows; with
    retain_imports consumers keep a buffer's import after releasing it, so that leasing
    memory recycled through a pool's cache (cache_bytes) again costs no import; with
    announce=False poolstat does not list the exporter."""

    def __init__(self, path, name=None, retain_imports=False, announce=True):
        h = ctypes.c_uint64()
        flags = (1 if retain_imports else 0) | (0 if announce else 2)
        _lib.call("cudapool_exporter_listen", _lib.encode_name(path, "path"),
                  None if name is None else name.encode(), flags, ctypes.byref(h))
        self._h, self.path = h.value, path
        self._kept = {}  # name -> the array published under it, kept alive

    def publish(self, name, obj, size=0, stream=None, meta=b""):
        """Makes the memory at obj (an address in a cudapool pool, or an object with
        __cuda_array_interface__) available under name, ready once the work queued on
        stream before the call is done. size 0 is to the end of obj's buffer (or obj's
        own size). meta (bytes or str, at most MAX_META bytes) goes to every consumer.
        An array obj is kept alive until unpublish or close: an allocator that caches
        (torch's, in a MemPool) would otherwise give its memory to another array while
        consumers still read it. Unpublish only once they have released it."""
        ptr, size = _pointer_and_size(obj, size)
        if isinstance(meta, str):
            meta = meta.encode()
        meta = bytes(meta)
        _lib.call("cudapool_exporter_publish", self._h, _lib.encode_name(name), ctypes.c_void_p(ptr),
                  size, _vp(stream), meta or None, len(meta))
        if not isinstance(obj, int):
            self._kept[name] = obj

    def unpublish(self, name):
        _lib.call("cudapool_exporter_unpublish", self._h, _lib.encode_name(name))
        self._kept.pop(name, None)

    def push(self, pid, name, timeout=DEFAULT_TIMEOUT):
        _lib.call("cudapool_exporter_push", self._h, pid, _lib.encode_name(name), _lib.timeout_ms(timeout))

    def state(self):
        """The exporter's state, as poolstat -json shows it."""
        return json.loads(_lib.call_sized("cudapool_exporter_state", self._h))

    def close(self, timeout=DEFAULT_TIMEOUT):
        """Stops sharing; waits (up to timeout) for consumers to release."""
        if self._h:
            h, self._h = self._h, 0
            try:
                _lib.call("cudapool_exporter_close", h, _lib.timeout_ms(timeout))
            finally:
                self._kept.clear()


def query_state(socket, timeout=DEFAULT_TIMEOUT):
    """Asks the exporter at socket for its state, as poolstat does."""
    return json.loads(_lib.call_sized("cudapool_query_state", _lib.encode_name(socket, "socket"),
                                      _lib.timeout_ms(timeout)))


class Importer(_Handle):
    """The consumer's side: a connection to the exporter at path, mapping its buffers on
    device. One per exporter per process."""

    def __init__(self, path, device=0, timeout=DEFAULT_TIMEOUT):
        h = ctypes.c_uint64()
        _lib.call("cudapool_importer_dial", _lib.encode_name(path, "path"), device,
                  _lib.timeout_ms(timeout), ctypes.byref(h))
        self._h, self.path, self.device = h.value, path, device

    def open(self, name, stream=None, timeout=DEFAULT_TIMEOUT):
        """Leases the buffer published under name and maps it. Work queued on stream after
        the call sees the producer's writes. Release the Mapping when done."""
        h = ctypes.c_uint64()
        s = stream_handle(stream)
        _lib.call("cudapool_importer_open", self._h, _lib.encode_name(name), ctypes.c_void_p(s or None),
                  _lib.timeout_ms(timeout), ctypes.byref(h))
        return Mapping(h.value, name, self.device, s)

    def close(self, timeout=DEFAULT_TIMEOUT):
        """Frees whatever is still mapped (release first) and says goodbye."""
        if self._h:
            h, self._h = self._h, 0
            _lib.call("cudapool_importer_close", h, _lib.timeout_ms(timeout))


def _cai_stream(s):
    # __cuda_array_interface__ v3 forbids 0 (ambiguous): the legacy default stream is 1.
    return 1 if s == 0 else s


class Mapping(_Handle):
    """A buffer of another process mapped into this one: ptr, size, name, device, meta
    (the bytes published with it) and the stream it was opened on. Through
    __cuda_array_interface__ it is a 1-D uint8 array whose data is valid on that stream;
    view() gives it another dtype and shape."""

    def __init__(self, handle, name, device, stream):
        self._h, self.name, self.device, self.stream = handle, name, device, stream
        p, n, meta_len = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_size_t()
        _lib.call("cudapool_mapping_info", handle, ctypes.byref(p), ctypes.byref(n), ctypes.byref(meta_len))
        self.ptr, self.size, self.meta = p.value, n.value, b""
        if meta_len.value:
            self.meta = _lib.call_sized("cudapool_mapping_meta", handle, cap=meta_len.value)

    @property
    def __cuda_array_interface__(self):
        if not self._h:
            raise Closed(4, "cudapool: mapping %r was released" % self.name)
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": _cai_stream(self.stream)}

    def view(self, typestr, shape, strides=None, offset=0):
        """An ArrayView of the mapping's memory from offset: typestr is a
        __cuda_array_interface__ type string ("<f2", "|u1", ...), or "bf16"."""
        return ArrayView(self, typestr, shape, strides, offset)

    def __dlpack__(self, stream=None, **_):
        return self.view("|u1", (self.size,)).__dlpack__(stream)

    def __dlpack_device__(self):
        return (_dlpack.KDL_CUDA, self.device)

    def release(self, stream=None, timeout=DEFAULT_TIMEOUT):
        """Gives the mapping back once the work queued on stream (default: the stream it
        was opened on) before the call is done."""
        if self._h:
            h, self._h = self._h, 0
            s = self.stream if stream is None else stream_handle(stream)
            _lib.call("cudapool_mapping_release", h, ctypes.c_void_p(s or None), _lib.timeout_ms(timeout))

    close = release


class ArrayView:
    """A typed, shaped window on a Mapping, for __cuda_array_interface__ and DLPack
    consumers. Through DLPack (torch.from_dlpack, cupy.from_dlpack) the array is on the
    importer's device, also where that is not the producer's: a consumer on another GPU
    then reads the producer's memory over NVLink, where __cuda_array_interface__
    consumers would place the array on the producer's GPU."""

    def __init__(self, mapping, typestr, shape, strides=None, offset=0):
        itemsize = 2 if typestr == "bf16" else int(typestr[2:])
        n = itemsize
        for d in shape:
            n *= d
        if offset < 0 or offset + n > mapping.size:
            raise ValueError("%d bytes at offset %d do not fit the %d-byte mapping" % (n, offset, mapping.size))
        self.mapping, self.typestr, self.shape = mapping, typestr, tuple(shape)
        self.strides = None if strides is None else tuple(strides)
        self.offset, self.itemsize = offset, itemsize

    @property
    def __cuda_array_interface__(self):
        if self.typestr == "bf16":
            raise TypeError("__cuda_array_interface__ has no bfloat16: use DLPack")
        cai = dict(self.mapping.__cuda_array_interface__)
        cai.update(shape=self.shape, typestr=self.typestr, strides=self.strides,
                   data=(self.mapping.ptr + self.offset, False))
        return cai

    def __dlpack__(self, stream=None, **_):
        """A DLPack capsule; stream (the consumer's; -1: none) is made to wait for the
        stream the mapping was opened on."""
        m = self.mapping
        if not m.handle:
            raise Closed(4, "cudapool: mapping %r was released" % m.name)
        if stream != -1:
            stream_wait(m.device, 0 if stream in (None, 1) else stream, m.stream)
        return _dlpack.capsule(self, m.ptr + self.offset, m.device, _dlpack.dtype_of(self.typestr),
                               self.shape, self.strides, self.itemsize)

    def __dlpack_device__(self):
        return (_dlpack.KDL_CUDA, self.mapping.device)
