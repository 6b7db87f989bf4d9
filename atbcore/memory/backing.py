"""Backings: where a pool's arenas physically live.

A backing allocates flat ``uint8`` buffers, cuts typed views out of them and copies
bytes between them. Two exist: a torch ``uint8`` tensor on the pool's device (cpu,
cuda, npu), used whenever torch is installed and the device is not ``"numpy"``, and a
NumPy buffer (the reference backend's memory). torch is imported only when a torch
backing is made, so importing :mod:`atbcore.memory` imports no framework.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import DeviceError

__all__ = ["Backing", "NumpyBacking", "TorchBacking", "make_backing"]


class Backing:
    """Interface of a backing. ``name`` is the framework of the tensors it hands out."""

    name = "abstract"
    device = "cpu"

    def allocate(self, nbytes: int) -> Any:
        """A new flat uint8 buffer of ``nbytes`` (contents undefined)."""
        raise NotImplementedError

    def address(self, buf: Any) -> int:
        """Address of the buffer's first byte (used to align arena bases)."""
        raise NotImplementedError

    def view(self, buf: Any, start: int, shape: Sequence[int], dtype: Dtype) -> Any:
        """A typed tensor of ``shape`` over ``buf[start:start + nbytes]`` (no copy)."""
        raise NotImplementedError

    def move(self, dst: Any, dst_start: int, src: Any, src_start: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src[src_start:]`` to ``dst[dst_start:]``; ranges may overlap."""
        raise NotImplementedError


class NumpyBacking(Backing):
    """Host memory as NumPy ``uint8`` arrays."""

    name = "numpy"

    def __init__(self) -> None:
        self.device = "cpu"

    def allocate(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def address(self, buf: np.ndarray) -> int:
        return int(buf.ctypes.data)

    def view(self, buf: np.ndarray, start: int, shape: Sequence[int], dtype: Dtype) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return buf[start:start + n].view(dtype.numpy).reshape(tuple(shape))

    def move(self, dst: np.ndarray, dst_start: int, src: np.ndarray, src_start: int,
             nbytes: int) -> None:
        # np.copyto detects overlapping operands and buffers them itself.
        np.copyto(dst[dst_start:dst_start + nbytes], src[src_start:src_start + nbytes])


class TorchBacking(Backing):
    """Device memory as torch ``uint8`` tensors (cpu, cuda, npu)."""

    name = "torch"

    def __init__(self, device: str) -> None:
        import torch

        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise DeviceError("MemoryPool", "device", "cpu, cuda[:i], npu[:i] or numpy",
                              repr(device)) from e
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError("MemoryPool", "device is not available", "an available device",
                              f"{device!r} (torch.cuda.is_available() is False)")
        if dev.type == "npu":
            npu = getattr(torch, "npu", None)
            if npu is None or not npu.is_available():
                raise DeviceError("MemoryPool", "device is not available", "an available device",
                                  f"{device!r} (torch_npu is not installed or sees no NPU)")
        if dev.type in ("cuda", "npu") and dev.index is None:
            # Pin the index so that every arena of one pool lands on the same device.
            mod = getattr(torch, dev.type)
            dev = torch.device(dev.type, mod.current_device())
        self._torch = torch
        self.tdevice = dev
        self.device = str(dev)

    def allocate(self, nbytes: int) -> Any:
        if self.tdevice.type == "cpu":  # arenas (KV caches) on huge pages where the OS allows
            from .hugepages import empty

            return empty((nbytes,), self._torch.uint8)
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.tdevice)

    def address(self, buf: Any) -> int:
        return int(buf.data_ptr())

    def view(self, buf: Any, start: int, shape: Sequence[int], dtype: Dtype) -> Any:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        # A uint8 slice reinterpreted as a wider type needs its offset aligned to the
        # item size; arena offsets are multiples of >= 64, views check item alignment.
        return buf[start:start + n].view(dtype.torch).view(tuple(shape))

    def move(self, dst: Any, dst_start: int, src: Any, src_start: int, nbytes: int) -> None:
        d = dst[dst_start:dst_start + nbytes]
        s = src[src_start:src_start + nbytes]
        same = dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
        if same and abs(dst_start - src_start) < nbytes:
            s = s.clone()  # torch refuses partially overlapping copy_ operands
        d.copy_(s)


def make_backing(device: str) -> Backing:
    """The backing for ``device``: NumPy for ``"numpy"`` (or ``"cpu"`` without torch),
    a torch tensor otherwise."""
    dev = str(device)
    if dev == "numpy":
        return NumpyBacking()
    try:
        import torch  # noqa: F401
    except ImportError:
        if dev.split(":")[0] == "cpu":
            return NumpyBacking()
        raise DeviceError("MemoryPool", "device needs torch", "torch installed",
                          f"{dev!r} without torch") from None
    return TorchBacking(dev)
