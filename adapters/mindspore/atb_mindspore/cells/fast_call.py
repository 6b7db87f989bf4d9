"""The guarded fast call of an ``atb_mindspore.GraphOp`` in PyNative: its last plain
call again.

The general path describes every input, walks the layers for their parameter slots,
builds the weight signature (twice: in ``prepare`` and in ``forward``) and goes
through the Cell machinery before the core looks the plan up. After such a call the
GraphOp keeps a :class:`FastCall`: the inputs' type, shape and dtype, the Block's core
and signature object (a rebuild or ``refresh_weights()`` replaces them), and per
Parameter where it is held, the object, its address and version counter
(``set_data`` gives new memory; writes MindSpore does not version need
``refresh_weights()``, which replaces the Block's signature). A call that matches them all,
in PyNative with no Cell hook to run, runs the core's remembered program
(:class:`~atbcore.graph.graph_op_hot.RememberedCall`); anything else returns None and
takes the general path, which checks everything (and raises the usual AtbError).
"""

from __future__ import annotations

from typing import Any, Sequence

from atbcore.graph.graph_op_hot import RememberedCall

from .base import in_pynative
from .block import _version

__all__ = ["FastCall"]

# Cell attributes that make MindSpore's Cell.__call__ do more than construct()
_CELL_EXTRAS = ("requires_grad", "_dynamic_shape_inputs", "mixed_precision_type",
                "_forward_pre_hook", "_forward_hook", "_backward_pre_hook", "_backward_hook",
                "_shard_fn", "_recompute_cell")


class FastCall:
    """See the module doc; ``fast(cell, inputs)`` is the outputs or None."""

    __slots__ = ("program", "sig", "block", "block_sig", "cells", "cell_objs", "checks")

    def __init__(self, program: RememberedCall, inputs: Sequence[Any], cell: Any) -> None:
        self.program = program
        self.sig = tuple((type(x), x.shape, x.dtype) for x in inputs)
        block = self.block = cell._block
        self.block_sig = block._sig
        self.cells = cell.layers._cells
        self.cell_objs = tuple(self.cells.values())
        checks = []
        for s in block._slots():
            p = s.get()
            if p is not None:
                # read where the Parameter is held (a mapping), else through its slot
                get, key = ((s.where[0].get, s.where[1]) if s.where is not None
                            else (lambda _key, slot_get=s.get: slot_get(), ""))
                checks.append((get, key, p, p.data_ptr(), _version(p)))
        self.checks = tuple(checks)

    @classmethod
    def after(cls, cell: Any, inputs: Sequence[Any]) -> "FastCall | None":
        """The fast call of the plain call just made (None: not repeatable this way)."""
        block = cell._block
        core = block.core
        if core is None or block._sig is None or (core._kv is not None and core._kv.slots):
            return None
        program = RememberedCall.of(core, list(inputs))
        return None if program is None else cls(program, inputs, cell)

    def __call__(self, cell: Any, inputs: Sequence[Any]) -> Any:
        if len(inputs) != len(self.sig) or not in_pynative():
            return None
        for x, (kind, shape, dtype) in zip(inputs, self.sig):
            if type(x) is not kind or x.shape != shape or x.dtype != dtype:
                return None
        block = self.block
        if block._sig is not self.block_sig or block.core is not self.program.core:
            return None
        if tuple(self.cells.values()) != self.cell_objs:
            return None
        for get, key, p, address, version in self.checks:
            if get(key) is not p or p.data_ptr() != address or _version(p) != version:
                return None
        for a in _CELL_EXTRAS:
            if getattr(cell, a, None):
                return None
        return self.program.run(list(inputs))
