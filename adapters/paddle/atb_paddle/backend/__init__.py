"""The Paddle backend: kernels built from Paddle's operators.

A Paddle user's tensors stay in Paddle (``native_first``): dispatch asks this backend
first for Paddle inputs, so nothing crosses into torch, and a machine without torch
runs at Paddle's own speed. Each kernel is ``fn(params, ins: dict[str, paddle.Tensor
| None]) -> list[paddle.Tensor]``; half types are computed in fp32 and rounded once
(Paddle 3.3 has no fp16/bf16 CPU kernels for matmul, norms or activations anyway).

Kernels use Paddle's fused ops where Paddle registers them for the call's device and
dtype (``fused_rms_norm``, ``fused_layer_norm``, ``swiglu`` on CPU fp32;
``fused_rotary_position_embedding``, flash attention on GPU) and a composition of
plain Paddle ops otherwise; :mod:`.common` records which path ran and why.

The backend never imports Paddle itself: it is available once the process has
imported ``paddle`` (as any process holding Paddle tensors has), and loads its kernels
at its first dispatch (:meth:`PaddleBackend.load`).

    from atb_paddle.backend import register
    register()                           # or the ``atb`` entry point does it
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from dataclasses import dataclass
from typing import Any, Callable

from atbcore.backends.base import Backend, Check, Kernel

__all__ = ["PaddleBackend", "kernel", "PADDLE_KERNELS", "register", "DEVICES"]

PADDLE_KERNELS: dict[str, Kernel] = {}

# Device kinds the kernels run on: plain Paddle ops exist on every Paddle device;
# cuda = Paddle's GPU places, npu = the custom-device plugin (paddle-custom-npu).
DEVICES = ("cpu", "cuda", "npu")


def kernel(op: str, *, check: Check | None = None, impl: str = "", launches: int = 1,
           devices: tuple[str, ...] = DEVICES, bind: Callable | None = None
           ) -> Callable[[Callable], Callable]:
    """Register ``fn(params, ins) -> list`` as the Paddle kernel of ``op`` (``bind``:
    its binder, :mod:`atbcore.runtime.binding`)."""

    def deco(fn: Callable) -> Callable:
        PADDLE_KERNELS[op] = Kernel(op=op, fn=fn, check=check, impl=impl or fn.__qualname__,
                                    launches=launches, devices=devices, bind=bind)
        return fn

    return deco


@dataclass
class PaddleBackend(Backend):
    """Kernels from ``paddle`` / ``paddle.incubate.nn.functional``; see the module doc."""

    name: str = "paddle"
    priority: int = 30
    native: str = "paddle"
    native_first: bool = True
    _loaded: bool = False
    _devices: tuple[str, ...] | None = None

    def unavailable_reason(self) -> str | None:
        if "paddle" in sys.modules:
            return None
        if importlib.util.find_spec("paddle") is None:
            return "paddlepaddle is not installed"
        # Paddle tensors exist only once paddle is imported; importing it here, for a
        # NumPy or MindSpore caller, would load Paddle's oneDNN first, which breaks
        # MindSpore's CPU kernels if MindSpore is imported afterwards.
        return "paddle is not imported in this process (the backend never imports it itself)"

    def load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        from ..bridge import install_bridge

        install_bridge()
        for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if not mod.name.startswith("_"):
                importlib.import_module(f"{__name__}.{mod.name}")
        self.kernels = PADDLE_KERNELS

    def devices(self) -> list[str]:
        if self._devices is not None:
            return list(self._devices)
        import paddle

        devs = ["cpu"]
        if paddle.is_compiled_with_cuda():
            devs += [f"cuda:{i}" for i in range(paddle.device.cuda.device_count())]
        get_custom = getattr(paddle.device, "get_all_custom_device_type", None)
        if get_custom is not None and "npu" in (get_custom() or []):
            devs += [f"npu:{i}" for i in range(paddle.device.get_device_count("npu"))]
        self._devices = tuple(devs)
        return devs

    def not_supported_reasons(self, opdef: Any, p: Any, ins: Any) -> list[str]:
        reasons = super().not_supported_reasons(opdef, p, ins)
        if reasons:
            return reasons
        # the kernels run on cuda/npu kinds, but only where this Paddle build has them
        for n, d in ins.items():
            if d is not None and d.device != "cpu" and d.device not in (have := set(self.devices())):
                return [f"input {n!r} on {d.device}, which this Paddle build does not have "
                        f"(devices: {', '.join(sorted(have))})"]
        return []

    def run(self, opdef: Any, p: Any, ins: Any) -> list:
        import paddle

        with paddle.no_grad():
            return super().run(opdef, p, ins)


_BACKEND: PaddleBackend | None = None


def register() -> PaddleBackend:
    """Register the Paddle backend (and the Paddle tensor bridge) with the core;
    returns the backend. Idempotent; imports no Paddle."""
    global _BACKEND
    from atbcore.backends import register_backend

    from ..bridge import install_bridge

    install_bridge()
    if _BACKEND is None:
        _BACKEND = PaddleBackend()
    register_backend(_BACKEND)
    return _BACKEND
