"""The MindSpore backend: kernels built from MindSpore's own operators.

A MindSpore user's tensors stay in MindSpore (``native_first``): dispatch asks this
backend first for MindSpore inputs, so nothing crosses into torch and a machine
without torch runs at MindSpore's speed. Each kernel is ``fn(params, ins: dict[str,
mindspore.Tensor | None]) -> list[mindspore.Tensor]``.

Half types are computed in fp32 and rounded once, as everywhere in atb. On the CPU
that is also the only way MindSpore 2.10 runs them: it has no bf16 CPU kernel for
matmul, reductions, exp or the activations (only casts, adds, concat and views).

Where MindSpore has a fused kernel for the device (Ascend: ``ops.rms_norm``,
``ops.add_rms_norm``, ``ops.rotary_position_embedding``,
``ops.flash_attention_score``) the kernel uses it; elsewhere (the CPU, where those
kernels are not registered) it runs a composition of portable ops. The choice and
its reason are logged at DEBUG and kept in :data:`common.PATHS`.

MindSpore is imported only when the backend is first used (:meth:`load`).

    from atb_mindspore.backend import register
    register()                    # ``import atb_mindspore`` and the entry point do it
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pkgutil
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from atbcore.backends.base import Backend, Check, Kernel

__all__ = ["MindSporeBackend", "kernel", "MS_KERNELS", "register", "DEVICES", "blocked",
           "blocked_reason"]

MS_KERNELS: dict[str, Kernel] = {}
_BLOCK = threading.local()


def blocked_reason() -> str | None:
    """Why this thread must not issue MindSpore ops right now (None: it may)."""
    return getattr(_BLOCK, "reason", None)


@contextlib.contextmanager
def blocked(reason: str) -> Iterator[None]:
    """Keep dispatch away from this backend (in this thread) while ``reason`` holds:
    MindSpore ops called from a pyfunc custom op inside ``mindspore.jit`` under
    PyNative wait for the graph that is calling them, forever."""
    prev = getattr(_BLOCK, "reason", None)
    _BLOCK.reason = reason
    try:
        yield
    finally:
        _BLOCK.reason = prev

# Plain MindSpore ops exist for every device MindSpore runs on.
DEVICES = ("cpu", "npu", "cuda")


def kernel(op: str, *, check: Check | None = None, impl: str = "", launches: int = 1,
           devices: tuple[str, ...] = DEVICES, bind: Callable | None = None
           ) -> Callable[[Callable], Callable]:
    """Register ``fn(params, ins) -> list`` as the MindSpore kernel of ``op`` (``bind``:
    see :class:`~atbcore.backends.base.Kernel`)."""

    def deco(fn: Callable) -> Callable:
        MS_KERNELS[op] = Kernel(op=op, fn=fn, check=check, impl=impl or fn.__qualname__,
                                launches=launches, devices=devices, bind=bind)
        return fn

    return deco


@dataclass
class MindSporeBackend(Backend):
    """Kernels from ``mindspore.ops`` / ``mindspore.mint``; see the module doc."""

    name: str = "mindspore"
    priority: int = 20
    native: str = "mindspore"
    native_first: bool = True
    _loaded: bool = False

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("mindspore") is None:
            return "mindspore is not installed"
        return getattr(_BLOCK, "reason", None)

    def load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        from .._env import mindspore
        from ..bridge import install_bridge

        mindspore()
        install_bridge()
        for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if not mod.name.startswith("_"):
                importlib.import_module(f"{__name__}.{mod.name}")
        self.kernels = MS_KERNELS

    def not_supported_reasons(self, opdef, p, ins) -> list[str]:
        reasons = super().not_supported_reasons(opdef, p, ins)
        if reasons:
            return reasons
        here = self.devices()
        for n, d in ins.items():
            if d is not None and d.device != "cpu" and not self.device_supported(d.device):
                # the kernel would run on this process's device_target, not on the tensor's
                return [f"input {n!r} on {d.device}; MindSpore runs on {'/'.join(here)} here"]
        return []

    def devices(self) -> list[str]:
        from .._env import mindspore

        ms = mindspore()
        target = str(ms.get_context("device_target") or "CPU").lower()
        devs = ["cpu"]
        if target == "ascend":
            devs.append("npu:0")
        elif target == "gpu":
            devs.append("cuda:0")
        return devs


_BACKEND: MindSporeBackend | None = None


def register() -> MindSporeBackend:
    """Add the ``mindspore`` backend to the core's registry (idempotent)."""
    global _BACKEND
    from atbcore.backends import register_backend

    if _BACKEND is None:
        _BACKEND = MindSporeBackend()
    register_backend(_BACKEND)
    return _BACKEND
