"""How the core sees Paddle tensors: descriptors and DLPack exchange without torch.

The core's own Paddle bridge routes NumPy <-> Paddle through torch; a Paddle user
without torch would have no way in. This bridge speaks DLPack to NumPy directly
(zero-copy both ways on the CPU; bf16 crosses as an int16 bit view, since NumPy's
DLPack has no bfloat16) and names Paddle places the way the rest of atb names
devices (``gpu:0`` -> ``cuda:0``, a custom ``npu:0`` stays ``npu:0``), so a CUDA
tensor reads the same whether it came from torch or Paddle.

:func:`install_bridge` registers it with ``atbcore.tensor.register_bridge``; the
``atb_register_adapters`` hook and ``import atb_paddle`` both call it. Paddle is
imported only when a Paddle tensor is actually converted.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from atbcore.dtypes import Dtype
from atbcore.errors import InputError
from atbcore.log import logger
from atbcore.tensor import TensorDesc, _PaddleBridge, register_bridge

__all__ = ["PaddleBridge", "install_bridge", "device_of_place"]

_PLACE = re.compile(r"(gpu|cuda|xpu|npu|custom_place|[a-z_]+):?(\d+)?", re.IGNORECASE)


def device_of_place(place: Any) -> str:
    """atb's device name for a Paddle place: ``cpu``, ``cuda:0``, ``npu:1`` ..."""
    if hasattr(place, "is_cpu_place") and place.is_cpu_place():
        return "cpu"
    if hasattr(place, "is_gpu_place") and place.is_gpu_place():
        return f"cuda:{place.gpu_device_id()}"
    s = str(place).lower()
    s = s[len("place("):-1] if s.startswith("place(") else s
    if s == "cpu":
        return "cpu"
    m = _PLACE.match(s)
    if not m:
        return s
    kind, idx = m.group(1), m.group(2)
    kind = "cuda" if kind == "gpu" else kind
    return f"{kind}:{idx}" if idx is not None else kind


class PaddleBridge(_PaddleBridge):
    """Paddle tensors for the core; see the module docstring."""

    name = "paddle"

    def describe(self, x: Any) -> TensorDesc:
        return TensorDesc(tuple(x.shape), Dtype.of(str(x.dtype)), device=device_of_place(x.place))

    def to_numpy(self, x: Any) -> np.ndarray:
        import paddle

        if not x.place.is_cpu_place():
            raise InputError("tensor", "NumPy view of a device tensor", "a cpu tensor",
                             f"device {device_of_place(x.place)}")
        x = x.detach()
        if x.dtype == paddle.bfloat16:
            # NumPy's DLPack has no bfloat16: share the bits as int16
            return np.from_dlpack(x.view(paddle.int16)).view(Dtype.BF16.numpy)
        return np.from_dlpack(x)

    def from_numpy(self, a: np.ndarray) -> Any:
        import paddle

        a = np.asarray(a)
        if not a.flags.writeable or any(s < 0 for s in a.strides):
            # Paddle would write through a read-only buffer, and negative strides
            # crash its DLPack import: hand it a private copy.
            logger.debug("numpy -> paddle needs a copy (read-only or negative strides)")
            a = np.array(a, copy=True, order="C")
        if a.ndim == 0:
            return paddle.to_tensor(a)
        if a.dtype == Dtype.BF16.numpy:
            return paddle.from_dlpack(a.view(np.int16)).view(paddle.bfloat16)
        return paddle.from_dlpack(a)

    def from_torch(self, t: Any) -> Any:
        import paddle

        return paddle.from_dlpack(t.detach())


def install_bridge() -> None:
    """Register :class:`PaddleBridge` with the core (idempotent: it replaces the
    core's Paddle bridge, or an earlier copy of itself)."""
    register_bridge(PaddleBridge())
