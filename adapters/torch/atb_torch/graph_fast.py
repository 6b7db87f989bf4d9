"""The guarded fast call of an ``atb_torch.GraphOp``: its last plain eager call again.

A GraphOp call through the general path checks the devices, builds descriptors, looks
up the plan, binds the weights and converts nothing, but still costs tens of µs of
Python before the first kernel. After such a call the module keeps a
:class:`FastCall`: the exact things that decided what ran, and the core's bound
program. A later call with

* inputs of the same type, shape, dtype and device (what picks the plan),
* the very same parameter objects in the same places, each with the version counter
  and address it had (``copy_``, ``load_state_dict``, in-place ops bump the version;
  ``.data =`` and ``.to()`` change the address; a replaced parameter or layer is not
  the same object),
* no autograd to serve (grad mode off, or nothing requiring grad), not tracing,
* and a core that still has that program, with no plugin or profiler to run,

runs that program directly. Anything else returns None and the call takes the general
path, which checks everything and raises the usual :class:`~atbcore.errors.AtbError`
for a user error; that call then leaves a new FastCall behind. Nothing is re-checked
that these guards keep true, and nothing is skipped that could change the result.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from atbcore.graph.graph_op_hot import RememberedCall

__all__ = ["FastCall"]

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


class FastCall:
    """What decided a call's plan, and the core program it ran; ``fast(inputs)`` is
    the outputs, or None when a guard fails (see the module doc)."""

    __slots__ = ("program", "sig", "layers", "layer_objs", "checks", "weight_storages")

    def __init__(self, program: RememberedCall, inputs: Sequence[Tensor],
                 weights: Sequence[Tensor], places: Sequence[tuple[dict, str]],
                 layers: dict | None) -> None:
        self.program = program
        self.sig = tuple((type(x), x.shape, x.dtype, x.device) for x in inputs)
        # the module's layer dict (None for a GraphOp of a core graph) and its members
        self.layers = layers
        self.layer_objs = tuple(layers.values()) if layers is not None else ()
        # per weight: (the dict that holds it, its key, the tensor, version, address)
        self.checks = tuple((d, k, w, w._version, w.data_ptr())
                            for (d, k), w in zip(places, weights))
        self.weight_storages = frozenset(w.untyped_storage().data_ptr() for w in weights
                                         if w.numel())

    @classmethod
    def after(cls, module: Any, inputs: Sequence[Tensor],
              weights: Sequence[Tensor]) -> "FastCall | None":
        """The fast call of the plain eager call just made (None: that call cannot be
        repeated this way: the core did not keep its program as the hot one)."""
        program = RememberedCall.of(module._runner.core, list(inputs))
        if program is None or program.plan.entry_native != "torch":
            return None
        layers = module.layers._modules if module._graph_src is None else None
        return cls(program, inputs, weights, module.weight_places(), layers)

    def __call__(self, inputs: Sequence[Any]) -> list[Tensor] | None:
        if _is_compiling() or len(inputs) != len(self.sig):
            return None
        grad = _grad_enabled()
        for x, (kind, shape, dtype, device) in zip(inputs, self.sig):
            if (type(x) is not kind or x.shape != shape or x.dtype != dtype
                    or x.device != device or (grad and x.requires_grad)):
                return None
        if self.layers is not None and tuple(self.layers.values()) != self.layer_objs:
            return None
        for d, k, w, version, address in self.checks:
            if (d.get(k) is not w or w._version != version or w.data_ptr() != address
                    or (grad and w.requires_grad)):
                return None
        outs = self.program.run(inputs)
        return None if outs is None else self._no_alias(outs, inputs)

    def _no_alias(self, outs: list[Tensor], inputs: Sequence[Tensor]) -> list[Tensor]:
        """``outs`` with any output sharing an input's or a weight's storage cloned
        (as :func:`atb_torch.library_graph.no_alias`, the weights' storages known)."""
        taken = self.weight_storages
        j = 0
        for o in outs:
            if o.numel():
                p = o.untyped_storage().data_ptr()
                if p in taken:
                    outs[j] = o.clone()
                else:
                    for x in inputs:
                        if x.untyped_storage().data_ptr() == p and x.numel():
                            outs[j] = o.clone()
                            break
            j += 1
        return outs
