"""The torch backend: CPU and CUDA kernels built from torch's fused ops (CUDA calls
go to Triton kernels where they apply: :mod:`.device_kernels`).

torch is imported only when this backend is first used. Kernel modules in this
package register with :func:`kernel`; they are imported by :meth:`TorchBackend.load`.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

from ..base import Backend, Check, Kernel

__all__ = ["TorchBackend", "kernel", "TORCH_KERNELS"]

TORCH_KERNELS: dict[str, Kernel] = {}


def kernel(op: str, *, check: Check | None = None, impl: str = "", launches: int = 1,
           devices: tuple[str, ...] = ("cpu", "cuda"), writes_out: bool = False,
           bind: Callable | None = None, workspace: Callable | None = None,
           launches_for: Callable | None = None) -> Callable[[Callable], Callable]:
    """Register ``fn(params, ins) -> list`` as the torch kernel of ``op`` (``bind``,
    ``workspace`` and ``launches_for``: see :class:`~atbcore.backends.base.Kernel`)."""

    def deco(fn: Callable) -> Callable:
        TORCH_KERNELS[op] = Kernel(op=op, fn=fn, check=check, impl=impl or fn.__qualname__,
                                   launches=launches, devices=devices, writes_out=writes_out,
                                   bind=bind, workspace=workspace,
                                   launches_for=launches_for)
        return fn

    return deco


@dataclass
class TorchBackend(Backend):
    name: str = "torch"
    priority: int = 10
    native: str = "torch"
    _loaded: bool = False

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        return None

    def load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            importlib.import_module(f"{__name__}.{mod.name}")
        from .device_kernels import apply_device_kernels

        apply_device_kernels(TORCH_KERNELS)  # Triton on CUDA, torch_npu on NPU
        self.kernels = TORCH_KERNELS

    def devices(self) -> list[str]:
        import torch

        devs = ["cpu"]
        if torch.cuda.is_available():
            devs += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if hasattr(torch, "npu") and getattr(torch.npu, "is_available", lambda: False)():
            devs += [f"npu:{i}" for i in range(torch.npu.device_count())]
        return devs

    def run(self, opdef: Any, p: Any, ins: Any) -> list:
        import torch

        with torch.inference_mode(False), torch.no_grad():
            return super().run(opdef, p, ins)
