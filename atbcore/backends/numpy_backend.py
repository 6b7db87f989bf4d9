"""The reference backend: every op's NumPy reference, always available, cpu only."""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.registry import all_ops
from .base import Backend, Kernel

__all__ = ["NumpyBackend"]


@dataclass
class NumpyBackend(Backend):
    name: str = "numpy"
    priority: int = 1000
    native: str = "numpy"

    def load(self) -> None:
        if self.kernels:
            return
        for name, opdef in all_ops().items():
            self.kernels[name] = Kernel(op=name, fn=opdef.reference, impl=f"numpy reference {name}")
