"""The NumPy backends: ``numpy``, every op's NumPy reference (the test oracle, always
available, cpu only), and ``numpy_c``, atb's C kernels on NumPy arrays."""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.registry import all_ops
from .base import Backend, Kernel

__all__ = ["NumpyBackend", "NumpyNativeBackend"]


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


@dataclass
class NumpyNativeBackend(Backend):
    """The C kernels (:mod:`.cpu_kernels.native_kernels`) on NumPy arrays, in place:
    norms, Linear and RmsNormLinear (few rows), RoPE, ReshapeAndCache, activations,
    Softmax and FusedFeedForward, each falling back to its NumPy reference for a call
    the C kernel does not take (logged at DEBUG); every other op is its reference.
    Asked after the framework backends and before the reference, so NumPy input runs
    compiled code without torch; ``numpy`` stays the pure oracle."""

    name: str = "numpy_c"
    priority: int = 500
    native: str = "numpy"

    def unavailable_reason(self) -> str | None:
        from .cpu_kernels import unavailable_reason

        return unavailable_reason()

    def load(self) -> None:
        if self.kernels:
            return
        from .cpu_kernels.native_kernels import NumpyIO, native_kernels

        reference = {name: Kernel(op=name, fn=opdef.reference, impl=f"numpy reference {name}")
                     for name, opdef in all_ops().items()}
        # every op (a complete backend: a graph runs on it alone), the C ones wrapped
        self.kernels = {**reference, **native_kernels(NumpyIO(), reference)}
