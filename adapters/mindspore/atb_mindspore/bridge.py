"""How the core sees MindSpore tensors, and how they cross without copies.

The core's built-in MindSpore bridge recognises tensors by their module name, which
misses ``mindspore.Parameter`` (its class lives in module ``abc``), and routes
NumPy through torch. This bridge replaces it (:func:`install_bridge`, called by
``import atb_mindspore``, the MindSpore backend and the ``atb_register_adapters``
hook):

* any ``mindspore.Tensor`` (Parameters included) is a MindSpore tensor; its device
  reads ``cpu``, ``npu:i`` (Ascend) or ``cuda:i`` (GPU);
* NumPy -> MindSpore: ``Tensor.from_numpy`` shares the array's memory (bf16 too,
  through ``ml_dtypes``); a read-only or non-contiguous array is copied first;
* MindSpore -> NumPy: ``asnumpy()`` shares a contiguous CPU tensor's memory; a
  non-contiguous view (a transpose) comes back as a contiguous copy; bf16 crosses as
  an int16 view reinterpreted as ``ml_dtypes.bfloat16`` (NumPy has no bf16 of its
  own) through NumPy's DLPack import, without a copy but read-only;
* MindSpore <-> torch: DLPack capsules (``mindspore.to_dlpack`` / ``from_dlpack``),
  no copy in either direction, strides kept;
* a tensor on an NPU/GPU never crosses into another framework: DLPack has no device
  code for Ascend, so it is refused with :class:`DeviceError` instead of copied.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from atbcore.dtypes import Dtype
from atbcore.errors import DeviceError
from atbcore.log import logger
from atbcore.tensor import TensorDesc, _MindSporeBridge, register_bridge

from ._env import device_name, mindspore

__all__ = ["MindSporeBridge", "install_bridge", "ms_dtype"]


def ms_dtype(d: Any) -> Any:
    """The MindSpore dtype of a :class:`Dtype` (or anything ``Dtype.of`` accepts)."""
    ms = mindspore()
    d = Dtype.of(d)
    return {Dtype.BOOL: ms.bool_}.get(d) or getattr(ms, d.value)


def _refuse_device(x: Any, where: str) -> None:
    dev = device_name(x)
    if dev != "cpu":
        raise DeviceError("mindspore", f"{where} of a tensor on {dev}",
                          "a CPU tensor (DLPack cannot carry Ascend tensors; keep them in "
                          "MindSpore kernels)", dev)


class MindSporeBridge(_MindSporeBridge):
    """Descriptors and zero-copy exchange for MindSpore tensors (see the module doc)."""

    name = "mindspore"

    def matches(self, x: Any) -> bool:
        ms = sys.modules.get("mindspore")
        return ms is not None and isinstance(x, ms.Tensor)

    def describe(self, x: Any) -> TensorDesc:
        return TensorDesc(tuple(x.shape), Dtype.of(str(x.dtype)), device=device_name(x))

    def reshape(self, x: Any, shape: Any) -> Any:
        a = getattr(x, "_atb_array", None)
        if a is not None:  # through the array atb made it over: no MindSpore op
            from .backend.native import host_tensor

            return host_tensor(a.reshape(tuple(shape)))
        return x.reshape(tuple(shape))

    def to_numpy(self, x: Any) -> np.ndarray:
        a = getattr(x, "_atb_array", None)
        if a is not None:  # a tensor atb made over this very array (backend/native.py)
            return a
        _refuse_device(x, "NumPy view")
        ms = mindspore()
        if x.dtype == ms.bfloat16:
            if not x.is_contiguous():
                x = x.contiguous()
            # asnumpy() of an int16 view copies; NumPy's own DLPack import does not
            # (it marks the array read-only, as DLPack carries no write permission).
            return np.from_dlpack(_Capsule(x.view(ms.int16))).view(Dtype.BF16.numpy)
        return x.asnumpy()

    def from_numpy(self, a: np.ndarray) -> Any:
        ms = mindspore()
        a = np.asarray(a)
        if not a.flags.c_contiguous or not a.flags.writeable:
            logger.debug("numpy -> mindspore needs a copy (non-contiguous or read-only array)")
            a = np.array(a, order="C", copy=True)
        return ms.Tensor.from_numpy(a)

    def to_torch(self, x: Any) -> Any:
        _refuse_device(x, "torch view")
        import torch

        ms = mindspore()
        return torch.utils.dlpack.from_dlpack(ms.to_dlpack(x))

    def from_torch(self, t: Any) -> Any:
        import torch

        if t.device.type != "cpu":
            raise DeviceError("mindspore", f"a torch tensor on {t.device} into MindSpore",
                              "a CPU tensor", str(t.device))
        ms = mindspore()
        return ms.from_dlpack(torch.utils.dlpack.to_dlpack(t.detach()))


class _Capsule:
    """A CPU MindSpore tensor seen through NumPy's ``__dlpack__`` protocol."""

    def __init__(self, t: Any) -> None:
        self.t = t

    def __dlpack__(self, stream: Any = None, **kw: Any) -> Any:
        return mindspore().to_dlpack(self.t)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


_INSTALLED = False


def install_bridge() -> None:
    """Register :class:`MindSporeBridge` with the core (idempotent)."""
    global _INSTALLED
    if not _INSTALLED:
        register_bridge(MindSporeBridge())
        _INSTALLED = True
