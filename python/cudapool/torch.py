"""PyTorch helpers: cudapool as torch's allocator, publishing tensors and opening
published names as tensors. Importing this module imports torch.

    import cudapool, cudapool.torch as cpt
    cpt.use_as_current()                  # before the first CUDA allocation: every tensor
                                          # comes from an exportable cudapool pool
    kv = torch.randn(..., device="cuda")  # real torch ops
    ex = cudapool.Exporter(path)
    cpt.publish(ex, "kv", kv)             # ready after torch's current stream's work

    # in another process (spawn), on any GPU:
    imp = cudapool.Importer(path, device=1)
    m = cpt.open_tensor(imp, "kv")        # m.tensor: the producer's dtype and shape, no copy
    ... use m.tensor on torch's current stream ...
    m.release()                           # after the work queued so far on the stream it
                                          # was opened on: torch's current stream then

Or keep torch's caching for everything else and put a chosen set of tensors in cudapool
with a MemPool: `with torch.cuda.use_mem_pool(cpt.mem_pool()): kv = torch.empty(...)`.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any, Dict, Optional, Sequence

import torch

import cudapool
from . import _lib

# The dtypes a shared tensor can have, with their DLPack type strings.
_TYPESTRS = {
    torch.float16: "<f2", torch.bfloat16: "bf16", torch.float32: "<f4", torch.float64: "<f8",
    torch.int8: "|i1", torch.uint8: "|u1", torch.int16: "<i2", torch.int32: "<i4",
    torch.int64: "<i8", torch.bool: "|b1",
}
_BY_NAME = {str(d).removeprefix("torch."): d for d in _TYPESTRS}

_allocator: Any = None


def configure(**pool_options: Any) -> None:
    """Sets the options of the allocator's pools not yet made (cudapool.Pool's keyword
    arguments: name, handle_type, max_size, ...). Call it before the first allocation."""
    o = cudapool._pool_options(**pool_options)
    _lib.call("cudapool_torch_configure", o)


def allocator() -> Any:
    """The torch.cuda.memory.CUDAPluggableAllocator over libcudapool (one per process)."""
    global _allocator
    if _allocator is None:
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _lib.loaded_path(), "cudapool_torch_malloc", "cudapool_torch_free")
    return _allocator


def use_as_current() -> None:
    """Makes cudapool torch's allocator for every CUDA tensor of this process. Must come
    before the process's first CUDA allocation (torch refuses otherwise)."""
    torch.cuda.memory.change_current_allocator(allocator())


def mem_pool() -> Any:
    """A torch.cuda.MemPool whose segments come from cudapool: tensors allocated under
    torch.cuda.use_mem_pool(pool) live in exportable memory."""
    return torch.cuda.MemPool(allocator().allocator())


def pool_handle(device: int = 0) -> int:
    """The cudapool pool the allocator uses on device, as a handle for stats."""
    h = _lib.PoolH()
    _lib.call("cudapool_torch_pool", _lib.device(device), ctypes.byref(h))
    return int(h.h)


def stats(device: int = 0) -> cudapool.PoolStats:
    """The statistics of the allocator's pool on device (cudapool.Pool.stats's)."""
    return cudapool.pool_stats(_lib.PoolH(pool_handle(device)))


def _current_stream(device: Any) -> Any:
    return torch.cuda.current_stream(device)


def describe(t: Any) -> bytes:
    """The metadata publish sends with a tensor: dtype, shape and strides, as JSON."""
    return json.dumps({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "strides": list(t.stride())}).encode()


def publish(exporter: cudapool.Exporter, name: str, tensor: Any, stream: Any = None) -> None:
    """Publishes tensor's memory under name, ready once the work queued on stream
    (default: torch's current stream on the tensor's device) is done. The tensor must be
    contiguous and allocated by cudapool (use_as_current or mem_pool); it may lie inside a
    larger cudapool buffer (a MemPool's segment). Consumers receive its dtype, shape and
    strides. The exporter keeps the tensor until unpublish or close: in a MemPool, torch
    would reuse its memory as soon as it is gone, consumers or not, so unpublish only
    once they have released it. With use_as_current cudapool itself defers the free."""
    if not tensor.is_cuda:
        raise ValueError("publish wants a CUDA tensor")
    if not tensor.is_contiguous():
        raise ValueError("publish wants a contiguous tensor (call .contiguous())")
    if stream is None:
        stream = _current_stream(tensor.device)
    exporter.publish(name, _Kept(tensor), stream=stream, meta=describe(tensor))


class _Kept:
    """A tensor as Exporter.publish takes it: its bytes, and the tensor to keep alive."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.__cuda_array_interface__: Dict[str, Any] = {
            "shape": (tensor.numel() * tensor.element_size(),), "typestr": "|u1",
            "data": (tensor.data_ptr(), False), "version": 3, "strides": None}


def open_tensor(importer: cudapool.Importer, name: str, dtype: Any = None, shape: Optional[Sequence[int]] = None,
                stream: Any = None, timeout: Optional[float] = cudapool.DEFAULT_TIMEOUT, *,
                wait_for_name: bool = False, local_copy: Any = False, replica: Any = None,
                wait: Optional[bool] = None) -> cudapool.Mapping:
    """Opens name as a tensor on the importer's device: returns the Mapping with
    .tensor set, a view of the mapped memory (no copy) of the producer's dtype and shape
    (from the metadata; dtype and shape given here win, and are needed where the
    protocol carries none). The tensor is usable on stream (default: torch's current
    stream); release the Mapping when done with it (its release, by default, is ordered
    after that stream). wait_for_name (wait, its former name, still works with a
    DeprecationWarning), local_copy and replica (local_copy's former name) are
    Importer.open's."""
    wait_for_name = cudapool._renamed("wait_for_name", wait_for_name, "wait", wait)
    dev = torch.device("cuda", importer.device)
    if stream is None:
        stream = _current_stream(dev)
    m = importer.open(name, stream=stream, timeout=timeout, wait_for_name=wait_for_name, local_copy=local_copy,
                      replica=replica)
    try:
        m.tensor = _as_tensor(m, dtype, shape, dev)
    except BaseException:
        m.release()
        raise
    return m


def _as_tensor(m: cudapool.Mapping, dtype: Any, shape: Any, dev: Any) -> Any:
    strides = None
    if m.meta:
        d = json.loads(m.meta)
        if shape is None or tuple(shape) == tuple(d["shape"]):
            strides = d.get("strides")  # the producer's, for the producer's shape only
        dtype = dtype or _BY_NAME[d["dtype"]]
        shape = shape or tuple(d["shape"])
    if dtype is None or shape is None:
        raise ValueError("%r carries no metadata: give dtype and shape" % m.name)
    if dtype not in _TYPESTRS:
        raise ValueError("cannot share %s tensors" % dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    byte_strides = None if strides is None else [s * itemsize for s in strides]
    # DLPack, not __cuda_array_interface__: it names the importer's device, so that a
    # consumer on another GPU gets a tensor there (reading over NVLink).
    return torch.from_dlpack(m.view(_TYPESTRS[dtype], tuple(shape), byte_strides))
