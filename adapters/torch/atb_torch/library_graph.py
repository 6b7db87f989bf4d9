"""``torch.ops.atb.graph_op``: a whole GraphOp as one custom op.

    outs = torch.ops.atb.graph_op(handle, [x, past_k, past_v], [w0, w1, ...])

``handle`` names a registered runner (an ``atb_torch.GraphOp`` registers itself at
construction); ``inputs`` are the graph inputs in graph order; ``weights`` are the
module's parameters in a fixed order, passed as arguments so that under
``torch.compile`` they are graph inputs (the op reads the current values, never a
constant folded at trace time). The real kernel runs the fused, planned core graph
(one custom-op call in the traced graph = one GraphOp); the fake kernel asks the
core for the output descriptors.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Protocol

import torch
from torch import Tensor

from atbcore.errors import AtbError

from .library import OPS, refusing_autograd

__all__ = ["GraphRunner", "register_runner", "get_runner", "graph_op", "no_alias"]


class GraphRunner(Protocol):
    """What ``graph_op`` calls: run on real tensors, or describe outputs for fakes."""

    name: str

    def run(self, inputs: list[Tensor], weights: list[Tensor]) -> list[Tensor]: ...

    def fake(self, inputs: list[Tensor], weights: list[Tensor]) -> list[Tensor]: ...


_RUNNERS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def register_runner(runner: Any) -> str:
    """Register ``runner`` (held weakly) and return its handle (a string, so that
    ``torch.compile`` keeps it a constant instead of a symbolic int)."""
    h = f"{getattr(runner, 'name', 'graph_op')}#{next(_NEXT)}"
    _RUNNERS[h] = runner
    return h


def get_runner(handle: str) -> Any:
    r = _RUNNERS.get(handle)
    if r is None:
        raise AtbError("graph_op", "unknown or destroyed GraphOp handle", "a live GraphOp",
                       handle)
    return r


def no_alias(outs: list[Tensor], inputs: list[Tensor], weights: list[Tensor]) -> list[Tensor]:
    """``outs`` with any output sharing an input's or weight's storage cloned (a
    custom op must not return its inputs or views of them; eager calls keep the
    same contract)."""
    ptrs = {t.untyped_storage().data_ptr() for t in (*inputs, *weights) if t.numel()}
    return [o.clone() if o.numel() and o.untyped_storage().data_ptr() in ptrs else o
            for o in outs]


def _graph_op(handle: str, inputs: list[Tensor], weights: list[Tensor]) -> list[Tensor]:
    runner = get_runner(handle)
    return no_alias(runner.run(list(inputs), list(weights)), inputs, weights)


graph_op = torch.library.custom_op("atb::graph_op", _graph_op, mutates_args=())
OPS["graph_op"] = "GraphOp"


@graph_op.register_fake
def _(handle, inputs, weights):
    return get_runner(handle).fake(list(inputs), list(weights))


refusing_autograd(graph_op, lambda inputs: f"GraphOp {inputs[0].split('#')[0]}")
