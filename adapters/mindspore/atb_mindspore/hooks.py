"""Plugins from plain callables, and registering a plugin on every GraphOp of a model.

    atb.register_plugin(net, "pre_attention", MyCustomPlugin())    # every GraphOp in net
    block.register_plugin("post_mlp", atb.HookPlugin(post=lambda ts: [t * 0.5 for t in ts]))

MindSpore's own Cell hooks (``register_forward_pre_hook`` / ``register_forward_hook``)
work on GraphOp Cells and layers as on any Cell in PyNative mode; plugins reach
inside a GraphOp at its attention and MLP points and see MindSpore tensors there.
"""

from __future__ import annotations

from typing import Any, Callable

from atbcore.errors import ParamsError
from atbcore.plugin import Plugin

__all__ = ["HookPlugin", "register_plugin"]

TensorsFn = Callable[[list], Any]


class HookPlugin(Plugin):
    """A :class:`Plugin` made of callables ``fn(tensors) -> tensors | None``
    (``None`` keeps the tensors, e.g. for hooks that only observe)."""

    def __init__(self, pre: TensorsFn | None = None, post: TensorsFn | None = None,
                 name: str | None = None) -> None:
        if pre is None and post is None:
            raise ParamsError("HookPlugin", "callables", "pre= and/or post=", "neither")
        self._pre, self._post = pre, post
        self.name = name or getattr(pre or post, "__name__", "HookPlugin")

    def preprocess(self, inputs: list) -> Any:
        if self._pre is None:
            return inputs
        out = self._pre(inputs)
        return inputs if out is None else out

    def postprocess(self, outputs: list) -> Any:
        if self._post is None:
            return outputs
        out = self._post(outputs)
        return outputs if out is None else out


def register_plugin(cell: Any, point: str, plugin: Any) -> int:
    """Register ``plugin`` at ``point`` on every atb GraphOp Cell inside ``cell``
    (itself included); returns how many GraphOps got it."""
    from .cells.graph_op import GraphOp

    ops = [c for _, c in cell.cells_and_names() if isinstance(c, GraphOp)]
    if not ops:
        raise ParamsError(type(cell).__name__, "register_plugin target",
                          "a Cell containing atb GraphOps", "none found")
    for op in ops:
        op.register_plugin(point, plugin)
    return len(ops)
