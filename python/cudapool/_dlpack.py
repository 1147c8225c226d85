"""A DLPack capsule for a mapping, made with ctypes.

__cuda_array_interface__ has no device field: its consumers ask the driver which
device a pointer lives on, and for a mapping of another GPU's pool that is the producer's
GPU, so torch.as_tensor on GPU 1 labels the tensor cuda:0 and computes there. DLPack
names the device, so a consumer on GPU 1 gets a cuda:1 tensor that reads the producer's
memory over NVLink (the importer gave its device access to the pool).
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Optional, Sequence, Tuple

KDL_CUDA = 2

# DLDataTypeCode by __cuda_array_interface__ kind letter.
_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}
KDL_BFLOAT = 4


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]



def _deleter() -> Tuple[Dict[int, Any], Any]:
    """The capsules' deleter and what it keeps: each capsule's memory and owner, by the
    address of its DLManagedTensor, until its consumer calls the deleter.

    A consumer may call it at the interpreter's exit, after this module's globals are
    gone (torch frees its tensors late): so it reads only its closure, never a global,
    and the C function itself is never freed (one reference is leaked on purpose), as a
    consumer holds its address where Python cannot see it."""
    alive: Dict[int, Any] = {}
    addressof = ctypes.addressof

    def delete(managed: Any) -> None:
        try:
            alive.pop(addressof(managed.contents), None)
        except Exception:  # pragma: no cover (nothing to report to at exit)
            pass

    fn = _Deleter(delete)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(fn))
    return alive, fn


_alive, _delete = _deleter()


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)


def dtype_of(typestr: str) -> DLDataType:
    """The DLDataType for a __cuda_array_interface__ typestr, or for "bf16"."""
    if typestr == "bf16":
        return DLDataType(KDL_BFLOAT, 16, 1)
    kind, size = typestr[1], int(typestr[2:])
    if kind not in _CODES:
        raise ValueError("no DLPack type for %r" % typestr)
    return DLDataType(_CODES[kind], 8 * size, 1)


def capsule(owner: object, ptr: int, device: int, dtype: DLDataType, shape: Sequence[int],
            strides_bytes: Optional[Sequence[int]], itemsize: int) -> Any:
    """A "dltensor" capsule for shape elements of dtype at ptr on device; owner is kept
    alive until the consumer is done with the capsule."""
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * ndim)(*shape)
    if strides_bytes is None:  # C order, spelled out: not every consumer takes NULL
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        strides.reverse()
    else:
        strides = [s // itemsize for s in strides_bytes]
    strides_arr = (ctypes.c_int64 * ndim)(*strides)
    m = DLManagedTensor()
    m.dl_tensor.data = ptr
    m.dl_tensor.device = DLDevice(KDL_CUDA, device)
    m.dl_tensor.ndim = ndim
    m.dl_tensor.dtype = dtype
    m.dl_tensor.shape = shape_arr
    m.dl_tensor.strides = strides_arr
    m.dl_tensor.byte_offset = 0
    m.deleter = _delete
    _alive[ctypes.addressof(m)] = (m, shape_arr, strides_arr, owner)
    return _new_capsule(ctypes.addressof(m), b"dltensor", None)
