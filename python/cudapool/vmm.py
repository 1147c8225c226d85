"""cudapool.vmm: the VMM route, device memory made as chunks and mapped as one range.

A pool (cudapool.Pool) shares what one IPC import can take, which the driver bounds
(about 4.5 GiB). The VMM route has no such bound: an Allocation is chunks of device
memory (cuMemCreate), mapped one behind the other into one range of this process's
addresses, that Exporter.publish_chunks publishes under a name. A consumer opens the
name with Importer.open as any other, and its Mapping is the whole allocation, one
range, whatever the number of chunks:

    with cudapool.vmm.Allocation(0, 8 << 30, chunk_size=2 << 30) as a:
        t = torch.as_tensor(a, device="cuda:0")     # uint8, no copy; write it on s
        ex.publish_chunks("slab", a, stream=s)      # ready once s's work so far is done
        s.synchronize()
    # closed: this process's mapping is gone, the memory lives while published

Who holds the memory: the exporter keeps a descriptor of every chunk from
publish_chunks until the name is unpublished (or the exporter closed), and a
consumer's Mapping holds it until released. Closing the Allocation (the with block's
end) unmaps this process's range only: the work queued on it must have run first.

Sizes are positive multiples of granularity(device) (2 MiB on an H200): other sizes
raise InvalidArgument. A runtime without the VMM route raises NotSupported, as does
fabric=True on a host without an IMEX channel. A second close does nothing.
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _dlpack, _Handle, _lib
from ._lib import Closed

__all__ = ["granularity", "Chunk", "Allocation"]

_CHUNK_FABRIC = 1  # CUDAPOOL_CHUNK_FABRIC


def granularity(device: int = 0, fabric: bool = False) -> int:
    """The size in bytes every chunk (and Allocation) of device is a multiple of; with
    fabric, that of chunks that can travel as FABRIC handles too."""
    g = ctypes.c_uint64()
    _lib.call("cudapool_vmm_granularity", _lib.device(device), _CHUNK_FABRIC if fabric else 0, ctypes.byref(g))
    return g.value


class Chunk(_Handle):
    """One chunk of size bytes of device memory on device, unmapped (an Allocation maps
    its chunks). With fabric it can travel as a FABRIC handle too. Closing it gives up
    this handle only: the memory lives on while a mapping or a publication holds it.
    As a context manager it is closed at the end; a second close does nothing."""

    def __init__(self, device: int, size: int, *, fabric: bool = False):
        h = _lib.ChunkH()
        self.device, self.size, self.fabric = _lib.device(device), _lib.size(size, lo=1), bool(fabric)
        _lib.call("cudapool_chunk_create", self.device, self.size, _CHUNK_FABRIC if fabric else 0, ctypes.byref(h))
        self._h = h.h

    def close(self) -> None:
        if self._h:
            h, self._h = self._h, 0
            _lib.call("cudapool_chunk_close", _lib.ChunkH(h))

    def __repr__(self) -> str:
        return "<cudapool.vmm.Chunk size=%d device=%d%s%s>" % (self.size, self.device, " fabric" if self.fabric else "",
                                                               "" if self._h else " closed")


def _chunk_sizes(size: int, chunk_size: int) -> Tuple[int, ...]:
    """size in chunks of chunk_size bytes, the last one what is left."""
    whole, rest = divmod(size, chunk_size)
    return (chunk_size,) * whole + ((rest,) if rest else ())


class Allocation(_Handle):
    """size bytes of device memory on device, made as chunks of chunk_size bytes (the
    last one what is left; None: one chunk) and mapped one behind the other from ptr:
    one contiguous range, which Exporter.publish_chunks publishes. size and chunk_size
    are multiples of granularity(device, fabric). Through __cuda_array_interface__ and
    DLPack it is a 1-D uint8 array (no stream: order the work that writes it yourself,
    and queue it before publish_chunks on the stream given there).

    close (the with block's end) unmaps the range and gives up the chunks' handles; the
    work queued on the range must have run. The memory lives on while it is published
    or a consumer maps it. A second close does nothing; ptr, the array interfaces and
    publish_chunks then raise Closed. On failure the constructor holds nothing."""

    def __init__(self, device: int, size: int, chunk_size: Optional[int] = None, *, fabric: bool = False):
        self.device, self.size = _lib.device(device), _lib.size(size, lo=1)
        self.chunk_size = self.size if chunk_size is None else _lib.size(chunk_size, "chunk_size", lo=1)
        self.fabric = bool(fabric)
        sizes = _chunk_sizes(self.size, self.chunk_size)
        if len(sizes) > MAX_CHUNKS:
            raise ValueError("%d chunks of %d bytes: at most %d" % (len(sizes), self.chunk_size, MAX_CHUNKS))
        self.chunks: Tuple[Chunk, ...] = ()
        self._ptr = 0
        r = _lib.ReservationH()
        _lib.call("cudapool_reservation_create", self.device, self.size, ctypes.byref(r))
        self._h = r.h
        made: List[Chunk] = []
        try:
            for n in sizes:
                made.append(Chunk(self.device, n, fabric=fabric))
            arr = (_lib.ChunkH * len(made))(*(_lib.ChunkH(c.handle) for c in made))
            _lib.call("cudapool_reservation_grow", _lib.ReservationH(self._h), arr, len(made))
            p = ctypes.c_void_p()
            _lib.call("cudapool_reservation_info", _lib.ReservationH(self._h), ctypes.byref(p), None, None, None)
        except BaseException:
            try:
                self._close_all(made)
            except _lib.CudapoolError:
                pass  # the cause is the exception to see
            raise
        self.chunks, self._ptr = tuple(made), p.value or 0

    def _close_all(self, chunks: Sequence[Chunk]) -> None:
        """Unmaps the range and closes chunks; the first failure is raised, after all."""
        first: Optional[BaseException] = None
        r, self._h = self._h, 0
        try:
            if r:
                _lib.call("cudapool_reservation_close", _lib.ReservationH(r))
        except _lib.CudapoolError as e:
            first = e
        for c in chunks:
            try:
                c.close()
            except _lib.CudapoolError as e:
                first = first or e
        if first is not None:
            raise first

    @property
    def closed(self) -> bool:
        return not self._h

    def check(self) -> None:
        """Raises Closed once the allocation is closed."""
        if not self._h:
            raise Closed(_lib.CLOSED, "cudapool: the allocation of %d bytes on device %d is closed"
                         % (self.size, self.device))

    @property
    def ptr(self) -> int:
        """The range's device address in this process (raises Closed once closed)."""
        self.check()
        return self._ptr

    def _chunk_array(self) -> "ctypes.Array[_lib.ChunkH]":
        """The chunks' handles, in order, as the library takes them (raises Closed)."""
        self.check()
        return (_lib.ChunkH * len(self.chunks))(*(_lib.ChunkH(c.handle) for c in self.chunks))

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": None}

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        """A DLPack capsule of the range as 1-D uint8; stream is not waited on (the
        allocation has none)."""
        return _dlpack.capsule(self, self.ptr, self.device, _dlpack.dtype_of("|u1"), (self.size,), None, 1)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (_dlpack.KDL_CUDA, self.device)

    def close(self) -> None:
        """Unmaps the range (its queued work must have run) and gives up the chunks'
        handles. Does nothing the second time."""
        if self._h:
            self._close_all(self.chunks)

    def __repr__(self) -> str:
        state = "closed" if not self._h else "%#x" % self._ptr
        return "<cudapool.vmm.Allocation %s size=%d chunks=%d device=%d%s>" % (
            state, self.size, len(self.chunks), self.device, " fabric" if self.fabric else "")


MAX_CHUNKS = 4096  # CUDAPOOL_MAX_CHUNKS: the chunks of one published allocation
