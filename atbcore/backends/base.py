"""A backend provides kernels for ops on some devices and says, per call, why it
cannot run one (``not_supported_reasons``). Dispatch asks each in priority order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..ops.base import OpDef, Params
from ..tensor import TensorDesc

__all__ = ["Kernel", "Backend"]

Check = Callable[[Params, Mapping[str, "TensorDesc | None"]], "list[str]"]


@dataclass(frozen=True)
class Kernel:
    """One kernel: ``fn(params, ins) -> list of outputs`` on native tensors.

    ``check`` returns the reasons it cannot run a call (empty = can run);
    ``impl`` names what runs, for logs and ``explain()``; ``launches`` is how many
    device kernels one call dispatches (a fused op built from several torch calls
    counts as that many); ``writes_out`` kernels accept ``out=[...]`` buffers;
    ``bind(params, ins, outs) -> call(env) | None`` binds the kernel once to its
    buffers for a plan (see :mod:`atbcore.runtime.binding`; a ``writes_out`` kernel
    without one is bound generically); ``workspace(params, shapes) -> bytes`` is the
    scratch a bound call needs (placed in the plan's arena, given as ``ctx.workspace``);
    ``launches_for(params, shapes) -> int``, where given, is ``launches`` for a call
    with these input shapes (a fused op whose kernel count depends on them).
    """

    op: str
    fn: Callable[[Params, Mapping[str, Any]], list]
    check: Check | None = None
    impl: str = ""
    launches: int = 1
    devices: tuple[str, ...] = ("cpu",)
    # True when ``fn(params, ins, out=[...])`` writes into given (planned) buffers
    writes_out: bool = False
    bind: Callable[..., Any] | None = None
    workspace: Callable[[Params, Mapping[str, Any]], int] | None = None
    launches_for: Callable[[Params, Mapping[str, Any]], int] | None = None


@dataclass
class Backend:
    """Base class; subclasses fill ``kernels`` (lazily, in :meth:`load`)."""

    name: str = ""
    priority: int = 100
    native: str = "numpy"  # the framework whose tensors the kernels take
    # True: asked first when the caller's tensors are of ``native`` (framework
    # backends); the reference backend leaves this False so numpy input still
    # runs on the faster torch kernels.
    native_first: bool = False
    kernels: dict[str, Kernel] = field(default_factory=dict)

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        return None

    def load(self) -> None:
        """Import kernel modules (called once before the first dispatch)."""

    def devices(self) -> list[str]:
        return ["cpu"]

    def device_supported(self, device: str) -> bool:
        return device.split(":")[0] in {d.split(":")[0] for d in self.devices()}

    def kernel(self, op: str) -> Kernel | None:
        self.load()
        return self.kernels.get(op)

    def not_supported_reasons(self, opdef: OpDef, p: Params,
                              ins: Mapping[str, TensorDesc | None]) -> list[str]:
        why = self.unavailable_reason()
        if why:
            return [why]
        k = self.kernel(opdef.name)
        if k is None:
            return [f"no {self.name} kernel for {opdef.name}"]
        reasons = []
        for n, d in ins.items():
            if d is not None and d.device.split(":")[0] not in k.devices:
                reasons.append(f"input {n!r} on device {d.device}; {self.name} kernel runs on "
                               f"{'/'.join(k.devices)}")
                break
        if k.check is not None and not reasons:
            reasons.extend(k.check(p, ins))
        return reasons

    def run(self, opdef: OpDef, p: Params, ins: Mapping[str, Any]) -> list:
        k = self.kernel(opdef.name)
        assert k is not None
        return list(k.fn(p, ins))
