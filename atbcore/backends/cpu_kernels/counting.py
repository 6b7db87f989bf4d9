"""Count the device kernels a piece of torch code really dispatches.

:class:`LaunchCounter` is a ``TorchDispatchMode`` that records every aten op that
reaches the dispatcher below autograd, minus those that launch no kernel: views
(``OpOverload.is_view`` and ``_unsafe_view``), allocations without a fill
(``empty*``), metadata queries and host-side scalar reads/wraps. The C kernels of this package never reach the
dispatcher, so each of their calls appends its name to the active counter's
list (:data:`.bindings.SINKS`). One C call = one launch, one counted aten op = one launch::

    with LaunchCounter() as c:
        TORCH_KERNELS["RmsNorm"].fn(p, ins)
    c.launches, c.ops        # 1, ['rms_norm']

torch is imported when a counter is created, not when this module is imported.
"""

from __future__ import annotations

from typing import Any

from . import bindings

__all__ = ["LaunchCounter", "NOT_LAUNCHES"]

# aten ops that allocate, alias or ask for metadata only: no kernel runs.
NOT_LAUNCHES = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
    "alias", "detach", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "is_contiguous", "is_same_size", "is_nonzero", "set_", "resize_", "_reshape_alias",
    # host-side: reading a scalar back (``.item()``) and wrapping a Python scalar
    "_local_scalar_dense", "scalar_tensor",
})


def _make_mode_class() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Mode(TorchDispatchMode):
        def __init__(self, sink: list[str]) -> None:
            super().__init__()
            self.sink = sink

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            name = func.overloadpacket.__name__
            if not (func.is_view or name in NOT_LAUNCHES):
                self.sink.append(f"aten.{name}")
            return func(*args, **(kwargs or {}))

    return _Mode


_MODE: type | None = None


class LaunchCounter:
    """Context manager: ``ops`` (the launches, in dispatch order) and ``launches``."""

    def __init__(self) -> None:
        global _MODE
        if _MODE is None:
            _MODE = _make_mode_class()
        self.ops: list[str] = []
        self._mode = _MODE(self.ops)

    def __enter__(self) -> "LaunchCounter":
        self.ops.clear()
        bindings.SINKS.append(self.ops)  # C kernel calls land in the same list, in order
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        bindings.SINKS.remove(self.ops)

    @property
    def launches(self) -> int:
        """How many kernels ran: counted aten ops plus C kernel calls."""
        return len(self.ops)
