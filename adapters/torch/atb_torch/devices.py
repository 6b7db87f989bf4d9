"""Devices for atb_torch: CPU and CUDA run the torch backend's kernels; Ascend NPU
(``torch_npu``) runs the ops whose kernels declare ``npu`` (the torch_npu fused ops:
norms, RoPE, SwiGLU, attention, the paged cache, Linear/w8, the collectives) and is
refused clearly for every other op and for hand-built GraphOps.

    check_devices("RmsNorm", [x, w], kernel.devices)   # npu allowed: it has an NPU kernel
    check_devices("Concat", [x, y])                    # CapabilityError on npu
    resolve_device("npu:0")                            # DeviceError when torch_npu is missing

Why refuse instead of running the torch composites on NPU tensors: they are written
against CUDA/CPU semantics (SDPA, int8 matmuls) and have never been checked on
Ascend; a :class:`CapabilityError` naming the missing capability is honest where a
silent wrong result or an opaque vendor crash would not be.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Iterable

import torch

from atbcore.errors import CapabilityError, DeviceError

__all__ = ["check_to_args", "KERNEL_DEVICES", "npu_available", "torch_npu_importable", "device_type",
           "check_devices", "resolve_device", "accelerator_devices"]

# Device types whose kernels exist in the torch backend.
KERNEL_DEVICES: tuple[str, ...] = ("cpu", "cuda")


def torch_npu_importable() -> bool:
    """Whether ``torch_npu`` is installed (without importing it)."""
    return importlib.util.find_spec("torch_npu") is not None


def npu_available() -> bool:
    """Whether an Ascend NPU is usable through ``torch_npu``."""
    if not torch_npu_importable():
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and getattr(npu, "is_available", lambda: False)())


def device_type(t: Any) -> str:
    """The device type of a torch tensor (``"cpu"``, ``"cuda"``, ``"npu"`` ...)."""
    return t.device.type


def _npu_error(op: str, where: str) -> CapabilityError:
    return CapabilityError(op, f"an NPU kernel for {op} (torch_npu backend): this op has none "
                           "yet", "a cpu or cuda tensor (move it with .cpu() / .cuda())", where)


def check_devices(op: str, tensors: Iterable[Any], allowed: Iterable[str] = KERNEL_DEVICES,
                  device_of=device_type) -> None:
    """Raise unless every tensor lives on one device the kernels support.

    NPU tensors where ``allowed`` has no ``npu`` raise :class:`CapabilityError` (the
    capability is missing, not the device); other unsupported devices and mixed
    devices raise :class:`DeviceError`.
    ``device_of`` is a seam for tests that fake a device.
    """
    allowed = tuple(allowed)
    seen: dict[str, str] = {}
    for i, t in enumerate(tensors):
        if t is None:
            continue
        kind = device_of(t)
        if kind == "npu" and kind not in allowed:
            raise _npu_error(op, f"input {i} on npu")
        if kind not in allowed:
            raise DeviceError(op, f"input {i} device", "/".join(allowed), kind)
        index = t.device.index if kind in ("cuda", "npu") else None
        seen.setdefault(kind if index is None else f"{kind}:{index}", f"input {i}")
    if len(seen) > 1:
        raise DeviceError(op, "inputs on one device", "the same device for every input",
                          ", ".join(f"{v} on {k}" for k, v in seen.items()))


def resolve_device(device: Any, op: str = "atb_torch") -> torch.device:
    """A ``torch.device`` for ``device`` (str, int or torch.device), refusing what
    atb cannot use: NPU without ``torch_npu`` is a :class:`DeviceError`; CUDA
    without a GPU too."""
    if isinstance(device, torch.device):
        text = str(device)
    elif isinstance(device, int):
        text = f"cuda:{device}"
    else:
        text = str(device)
    kind = text.split(":")[0]
    if kind == "npu":
        if not torch_npu_importable():
            raise DeviceError(op, "device 'npu' needs torch_npu", "torch_npu installed (import "
                              "torch_npu) or a cpu/cuda device", text)
        import torch_npu  # noqa: F401  (registers the npu device with torch)
    elif kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError(op, "CUDA device",
                          "a machine with a CUDA GPU (torch.cuda.is_available())", text)
    try:
        return torch.device(text)
    except RuntimeError as e:
        raise DeviceError(op, "device string", "cpu, cuda[:i] or npu[:i]", text) from e


def accelerator_devices() -> list[str]:
    """Devices visible to torch: ``cpu``, ``cuda:i`` and (with torch_npu) ``npu:i``."""
    devs = ["cpu"]
    if torch.cuda.is_available():
        devs += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if npu_available():
        devs += [f"npu:{i}" for i in range(torch.npu.device_count())]  # type: ignore[attr-defined]
    return devs


def check_to_args(args: tuple, kwargs: dict, op: str) -> None:
    """Refuse an unusable device given to ``nn.Module.to(...)`` with an AtbError
    (instead of torch's RuntimeError for an unknown device string)."""
    dev = kwargs.get("device", args[0] if args else None)
    if isinstance(dev, (str, torch.device)) or (isinstance(dev, int) and not isinstance(dev, bool)):
        resolve_device(dev, op)
