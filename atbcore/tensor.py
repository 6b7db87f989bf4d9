"""Tensor descriptors and DLPack exchange between NumPy, torch, MindSpore and Paddle.

The core never owns a tensor type of its own: a kernel runs on its backend's
native tensors (``np.ndarray`` for the reference backend, ``torch.Tensor`` for
the torch backend), and framework tensors cross into them through DLPack, without
a copy wherever the producer allows it. No framework is imported here until a
tensor of that framework is actually seen.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import numpy as np

from .dtypes import Dtype
from .errors import InputError
from .log import logger
from .tensor_desc import TensorDesc

__all__ = [
    "TensorDesc",
    "framework_of",
    "describe",
    "to_numpy",
    "to_torch",
    "from_torch",
    "reshape",
    "from_numpy",
    "convert",
    "copy_into",
    "is_tensor",
    "raw_signature",
]


# --------------------------------------------------------------------------- frameworks


class _Bridge:
    """How one framework's tensors are described and converted."""

    name = ""

    def matches(self, x: Any) -> bool:
        raise NotImplementedError

    def describe(self, x: Any) -> TensorDesc:
        raise NotImplementedError

    def to_torch(self, x: Any) -> Any:
        import torch

        return torch.from_dlpack(x)

    def to_numpy(self, x: Any) -> np.ndarray:
        return _torch_to_numpy(self.to_torch(x))

    def from_torch(self, t: Any) -> Any:
        raise NotImplementedError

    def from_numpy(self, a: np.ndarray) -> Any:
        return self.from_torch(_numpy_to_torch(a))

    def reshape(self, x: Any, shape: Sequence[int]) -> Any:
        """``x`` seen as ``shape`` (a view where the framework makes one)."""
        return x.reshape(list(shape))


def _module_root(x: Any) -> str:
    return type(x).__module__.split(".", 1)[0]


def _numpy_to_torch(a: np.ndarray) -> Any:
    import torch

    if a.dtype == Dtype.BF16.numpy:
        return _numpy_to_torch(a.view(np.int16)).view(torch.bfloat16)
    try:
        if not a.flags.writeable:
            raise ValueError("read-only array")
        return torch.from_numpy(a)
    except (ValueError, TypeError) as e:
        # negative strides or a read-only buffer: torch cannot alias it.
        logger.debug("numpy -> torch needs a copy (%s)", e)
        return torch.from_numpy(np.ascontiguousarray(a).copy())


def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        raise InputError("tensor", "NumPy view of a device tensor", "a cpu tensor", f"device {t.device}")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(Dtype.BF16.numpy)
    return t.numpy()


class _NumpyBridge(_Bridge):
    name = "numpy"

    def matches(self, x: Any) -> bool:
        return isinstance(x, (np.ndarray, np.generic))

    def describe(self, x: Any) -> TensorDesc:
        x = np.asarray(x)
        return TensorDesc(x.shape, Dtype.of(x.dtype))

    def to_torch(self, x: Any) -> Any:
        return _numpy_to_torch(np.asarray(x))

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def from_torch(self, t: Any) -> Any:
        return _torch_to_numpy(t)

    def from_numpy(self, a: np.ndarray) -> Any:
        return a


class _TorchBridge(_Bridge):
    name = "torch"

    def matches(self, x: Any) -> bool:
        if "torch" not in sys.modules:
            return False
        import torch

        return isinstance(x, torch.Tensor)

    def describe(self, x: Any) -> TensorDesc:
        dev = x.device.type if x.device.index is None else f"{x.device.type}:{x.device.index}"
        return TensorDesc(tuple(x.shape), Dtype.of(x.dtype), device=dev)

    def to_torch(self, x: Any) -> Any:
        return x

    def to_numpy(self, x: Any) -> np.ndarray:
        return _torch_to_numpy(x)

    def from_torch(self, t: Any) -> Any:
        return t

    def from_numpy(self, a: np.ndarray) -> Any:
        return _numpy_to_torch(a)


class _PaddleBridge(_Bridge):
    name = "paddle"

    def matches(self, x: Any) -> bool:
        return "paddle" in sys.modules and _module_root(x) == "paddle" and hasattr(x, "place")

    def describe(self, x: Any) -> TensorDesc:
        place = str(x.place)
        dev = "cpu" if "cpu" in place.lower() else place
        return TensorDesc(tuple(x.shape), Dtype.of(str(x.dtype)), device=dev)

    def from_torch(self, t: Any) -> Any:
        import paddle

        return paddle.from_dlpack(t.detach())


class _MindSporeBridge(_Bridge):
    name = "mindspore"

    def matches(self, x: Any) -> bool:
        # isinstance, not the module name: a Parameter's class lives in module "abc"
        ms = sys.modules.get("mindspore")
        return ms is not None and isinstance(x, ms.Tensor)

    def describe(self, x: Any) -> TensorDesc:
        return TensorDesc(tuple(x.shape), Dtype.of(str(x.dtype)))

    def to_torch(self, x: Any) -> Any:
        import mindspore
        import torch

        # MindSpore speaks DLPack through capsules, not the __dlpack__ protocol.
        return torch.utils.dlpack.from_dlpack(mindspore.to_dlpack(x))

    def from_torch(self, t: Any) -> Any:
        import mindspore
        import torch

        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return mindspore.from_dlpack(torch.utils.dlpack.to_dlpack(t))

    def from_numpy(self, a: np.ndarray) -> Any:
        import mindspore

        if a.dtype == Dtype.BF16.numpy:
            return self.from_torch(_numpy_to_torch(a))
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        return mindspore.Tensor.from_numpy(a)

    def to_numpy(self, x: Any) -> np.ndarray:
        if str(x.dtype) == "BFloat16":
            return _torch_to_numpy(self.to_torch(x))
        return x.asnumpy()


_BRIDGES: dict[str, _Bridge] = {
    b.name: b for b in (_NumpyBridge(), _TorchBridge(), _PaddleBridge(), _MindSporeBridge())
}


def register_bridge(bridge: _Bridge) -> None:
    """Teach the core a new framework's tensors (used by adapter plugins)."""
    _BRIDGES[bridge.name] = bridge


def _bridge_of(x: Any) -> _Bridge | None:
    for b in _BRIDGES.values():
        if b.matches(x):
            return b
    return None


def is_tensor(x: Any) -> bool:
    """True for a tensor of any framework atb knows."""
    return _bridge_of(x) is not None


def framework_of(x: Any) -> str:
    """"numpy", "torch", "mindspore" or "paddle"; raises InputError for anything else."""
    b = _bridge_of(x)
    if b is None:
        raise InputError("tensor", "unsupported tensor type", "a numpy/torch/mindspore/paddle tensor",
                         type(x).__name__)
    return b.name


def describe(x: Any) -> TensorDesc:
    """The :class:`TensorDesc` of any supported tensor."""
    b = _bridge_of(x)
    if b is None:
        raise InputError("tensor", "unsupported tensor type", "a numpy/torch/mindspore/paddle tensor",
                         type(x).__name__)
    return b.describe(x)


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy view of ``x`` (zero-copy for cpu tensors that allow it)."""
    return _BRIDGES[framework_of(x)].to_numpy(x)


def to_torch(x: Any) -> Any:
    """A torch view of ``x`` through DLPack (zero-copy where the producer allows)."""
    return _BRIDGES[framework_of(x)].to_torch(x)


def from_torch(t: Any, framework: str) -> Any:
    """Hand a torch tensor to ``framework`` through DLPack."""
    return _BRIDGES[framework].from_torch(t)


def from_numpy(a: np.ndarray, framework: str) -> Any:
    """Hand a NumPy array to ``framework`` (zero-copy where it allows)."""
    return _BRIDGES[framework].from_numpy(a)


_TO: dict[str, Callable[[Any], Any]] = {"numpy": to_numpy, "torch": to_torch}
_FROM: dict[str, Callable[[Any, str], Any]] = {"numpy": from_numpy, "torch": from_torch}


def convert(x: Any, framework: str) -> Any:
    """Convert a tensor of any framework into ``framework``'s tensor type."""
    src = framework_of(x)
    if src == framework:
        return x
    if framework in _TO:
        return _TO[framework](x)
    if src in _FROM:
        return _FROM[src](x, framework)
    return from_torch(to_torch(x), framework)


def reshape(x: Any, shape: Sequence[int]) -> Any:
    """``x`` (any framework's tensor) as ``shape``, through its framework's bridge (a
    MindSpore tensor atb made over a host array is reshaped through the array: no
    MindSpore op, nothing for the next host read to wait for)."""
    return _BRIDGES[framework_of(x)].reshape(x, shape)


def raw_signature(xs: Sequence[Any]) -> tuple | None:
    """A hashable signature of tensors read straight off them (type, shape, dtype,
    device) without building descriptors: the plan cache's key for a call it has seen.
    None when some input is not a NumPy, torch, Paddle or MindSpore tensor."""
    key = []
    for x in xs:
        t = type(x)
        mod = t.__module__
        if t is np.ndarray:
            key.append((t, x.shape, x.dtype))
        elif mod.startswith("torch") and hasattr(x, "data_ptr"):
            key.append((t, tuple(x.shape), x.dtype, x.device))
        elif mod.startswith("paddle") and hasattr(x, "place"):
            key.append((t, tuple(x.shape), str(x.dtype), str(x.place)))
        elif "mindspore" in sys.modules and isinstance(x, sys.modules["mindspore"].Tensor):
            key.append((t, tuple(x.shape), str(x.dtype)))
        else:
            return None
    return tuple(key)


def copy_into(dst: Any, src: Any, native: str | None = None) -> None:
    """Copy ``src`` (any framework) into the existing tensor ``dst`` in place, both
    seen as ``native`` tensors (default: NumPy for a NumPy ``dst``, else torch; the
    views share ``dst``'s memory, so the caller's tensor receives the values)."""
    if native is None:
        fw = framework_of(dst)
        if fw not in ("numpy", "torch") and _copy_by_address(dst, convert(src, fw)):
            return  # MindSpore / Paddle CPU tensors: no detour through torch
        native = "numpy" if fw == "numpy" else "torch"
    view, value = convert(dst, native), convert(src, native)
    if native == "numpy":
        import numpy as np

        np.copyto(view, value)
    else:
        view.copy_(value)


def _copy_by_address(dst: Any, src: Any) -> bool:
    """Copy ``src`` into ``dst`` byte for byte when both are contiguous CPU tensors of
    one dtype and shape (True), else leave them (False)."""
    import ctypes

    from .backends.cpu_kernels.native import view_of
    from .errors import AtbError

    try:
        d, v = view_of(dst), view_of(src)
    except AtbError:
        return False
    if d.shape != v.shape or d.dtype != v.dtype or not (d.contiguous and v.contiguous):
        return False
    if d.address != v.address and d.numel:
        ctypes.memmove(d.address, v.address, d.numel * d.dtype.itemsize)
    return True
