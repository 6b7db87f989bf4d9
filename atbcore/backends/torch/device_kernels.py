"""Per-device kernels of the torch backend (Triton on CUDA, torch_npu on NPU).

The torch backend has one :class:`~atbcore.backends.base.Kernel` per op; its ``fn``
picks the CPU C kernel or the torch composite. A *device kernel* registered here
for ``(op, device type)`` takes the calls whose tensors live on that device when its
``why_not(params, ins)`` finds nothing against them; otherwise the op's own kernel
runs and the fallback is logged with the reason, once per (op, reason) at INFO:
``RmsNorm: triton kernel skipped (triton is not installed) -> torch kernel``.

:func:`apply_device_kernels` wraps the op kernels once the backend has imported its
kernel modules (plans call ``Kernel.fn``, so the choice is made per call there too).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..base import Kernel
from ..npu import kernel_device

__all__ = ["DeviceKernel", "DEVICE_KERNELS", "device_kernel", "apply_device_kernels",
           "input_device", "device_kernel_takes"]


@dataclass(frozen=True)
class DeviceKernel:
    """``fn(params, ins, out=None) -> list`` for tensors on ``device`` (a device type);
    ``why_not(params, ins) -> str | None`` says why it cannot take a call; ``impl``
    names it for logs and ``explain()``."""

    op: str
    device: str
    fn: Callable[..., list]
    why_not: Callable[[Any, Mapping[str, Any]], "str | None"]
    impl: str
    provider: str
    # why the provider is missing in this process (None = present); a device only these
    # kernels serve (npu) is refused at dispatch while it is missing
    available: Callable[[], "str | None"] | None = None


DEVICE_KERNELS: dict[tuple[str, str], DeviceKernel] = {}
_LOGGED: set[tuple[str, str, str]] = set()


def device_kernel(op: str, device: str, *, why_not: Callable[[Any, Mapping[str, Any]], Any],
                  impl: str, provider: str, available: Callable[[], Any] | None = None
                  ) -> Callable[[Callable], Callable]:
    """Register ``fn`` as ``op``'s kernel for tensors on ``device`` ("cuda", "npu")."""

    def deco(fn: Callable) -> Callable:
        DEVICE_KERNELS[(op, device)] = DeviceKernel(op, device, fn, why_not, impl, provider,
                                                    available)
        return fn

    return deco


def input_device(ins: Mapping[str, Any]) -> str | None:
    """The device type of the first tensor (or planned slot) among ``ins`` -- "npu"
    for tensors of the stand-in device while a torch_npu double is installed
    (:func:`atbcore.backends.npu.use_npu_module`)."""
    for t in ins.values():
        desc = getattr(t, "desc", None)  # a plan's Slot
        dev = getattr(desc if desc is not None else t, "device", None)
        if dev is not None:
            kind = dev.type if hasattr(dev, "type") else str(dev).split(":")[0]
            return kernel_device(kind)
    return None


def device_kernel_takes(op: str, p: Any, ins: Mapping[str, Any]) -> bool:
    """Whether a device kernel of ``op`` serves these inputs (their device has one
    and it finds no reason against them): callers choosing between two ways of
    running a step (a paged read in place or a kept copy) ask this."""
    dk = DEVICE_KERNELS.get((op, input_device(ins) or ""))
    return dk is not None and dk.why_not(p, ins) is None


def _log_fallback(dk: DeviceKernel, why: str) -> None:
    from ...log import logger

    key = (dk.op, dk.provider, why)
    level = logging.DEBUG if key in _LOGGED else logging.INFO
    _LOGGED.add(key)
    logger.log(level, "%s: %s kernel skipped (%s) -> torch kernel", dk.op, dk.provider, why)


def _wrap(k: Kernel, by_device: dict[str, DeviceKernel]) -> Kernel:
    base, base_bind = k.fn, k.bind

    def fn(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
        dk = by_device.get(input_device(ins) or "")
        if dk is not None:
            why = dk.why_not(p, ins)
            if why is None:
                return dk.fn(p, ins, out=out)
            _log_fallback(dk, why)
        return base(p, ins) if out is None else base(p, ins, out=out)

    def bind(p: Any, ins: Mapping[str, Any], outs: list, ctx: Any) -> Any:
        if input_device(ins) in by_device:  # the generic bound call, through ``fn``
            return None
        return base_bind(p, ins, outs, ctx) if base_bind is not None else None

    base_check = k.check
    only_here = {d: dk for d, dk in by_device.items() if d not in k.devices}

    def check(p: Any, descs: Mapping[str, Any]) -> list[str]:
        dev = input_device(descs)
        dk = only_here.get(dev or "")
        why = dk.available() if dk is not None and dk.available is not None else None
        if why:
            return [why]
        return list(base_check(p, descs)) if base_check is not None else []

    if base_bind is not None and getattr(base_bind, "fills_slots", False):
        bind.fills_slots = True  # type: ignore[attr-defined]
    # layout-pass weights (CPU only) reach the base kernel as they are
    bind.takes_packed = getattr(base_bind, "takes_packed", False)  # type: ignore[attr-defined]
    fn.takes_packed = getattr(base, "takes_packed", False)  # type: ignore[attr-defined]
    fn.__qualname__ = getattr(base, "__qualname__", k.op)
    impl = "; ".join([k.impl] + [f"{d.device}: {d.impl}" for d in by_device.values()])
    devices = tuple(dict.fromkeys((*k.devices, *by_device)))
    return dataclasses.replace(k, fn=fn, bind=bind if base_bind is not None else None,
                               impl=impl, devices=devices,
                               check=check if only_here else base_check)


def apply_device_kernels(kernels: dict[str, Kernel]) -> None:
    """Route each op with device kernels through them (idempotent per op kernel)."""
    ops: dict[str, dict[str, DeviceKernel]] = {}
    for (op, device), dk in DEVICE_KERNELS.items():
        ops.setdefault(op, {})[device] = dk
    for op, by_device in ops.items():
        k = kernels.get(op)
        if k is not None and not getattr(k.fn, "_device_routed", False):
            kernels[op] = _wrap(k, by_device)
            kernels[op].fn._device_routed = True  # type: ignore[attr-defined]
