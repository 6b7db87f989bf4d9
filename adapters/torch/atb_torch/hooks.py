"""Plugins from plain callables, and registering a plugin on every GraphOp of a model.

    atb.register_plugin(model, "pre_attention", MyCustomPlugin())   # every GraphOp
    block.register_plugin("post_mlp", atb.HookPlugin(post=lambda ts: [t * 0.5 for t in ts]))

``nn.Module`` forward hooks work on GraphOp modules and standalone layers as on
any module (``register_forward_hook`` / ``register_forward_pre_hook``); plugins
reach inside a GraphOp at its attention and MLP points.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

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
        return inputs if self._pre is None else self._pre(inputs)

    def postprocess(self, outputs: list) -> Any:
        return outputs if self._post is None else self._post(outputs)


def register_plugin(model: nn.Module, point: str, plugin: Any) -> int:
    """Register ``plugin`` at ``point`` on every atb_torch GraphOp inside ``model``
    (itself included); returns how many GraphOps got it."""
    from .graph import GraphOp

    ops = [m for m in model.modules() if isinstance(m, GraphOp)]
    if not ops:
        raise ParamsError(type(model).__name__, "register_plugin target",
                          "a model containing atb GraphOps", "no GraphOp")
    for g in ops:
        g.register_plugin(point, plugin)
    return len(ops)
