"""``atb_paddle.compile(layer)``: a Paddle model built from atb GraphOps, for inference,
with ``generate``.

    import atb_paddle as atb
    fast = atb.compile(accelerated_llama, mode="infer", opt_level=2)
    ids = fast.generate(input_ids, max_new_tokens=64)      # paddle int64 [B, S + n]

The model (a ``paddle.nn.Layer`` holding at least one ``atb_paddle.GraphOp``: the
seed's ``AcceleratedLLaMA`` written as a Paddle Layer) is wrapped, not modified: the
compiled layer runs it without autograd, and ``generate`` resets its ``kv_cache``,
runs the prompt once and then one token per step
(:func:`atbcore.graph.model_generate.generate_ids`: greedy, or ``do_sample`` with
atb's seeded ``TopkToppSampling``). Its GraphOps fuse, plan and cache their own plans
(``explain()`` each).
"""

from __future__ import annotations

from typing import Any

from atbcore.errors import CapabilityError
from atbcore.graph.model_generate import check_compile, generate_ids

import paddle

__all__ = ["compile", "CompiledLayer"]


def _graph_ops(model: Any) -> list[Any]:
    from .layers.graph_op import GraphOp

    return [m for m in model.sublayers(include_self=True) if isinstance(m, GraphOp)]


class CompiledLayer(paddle.nn.Layer):
    """See the module docstring; ``.model`` is the wrapped layer, ``.graph_ops`` its
    GraphOps."""

    def __init__(self, model: Any, options: dict) -> None:
        super().__init__()
        self.model = model
        self.atb_options = dict(options)
        self.graph_ops = _graph_ops(model)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with paddle.no_grad():
            return self.model(*args, **kwargs)

    def generate(self, input_ids: Any, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, eos_token_id: int | None = None) -> Any:
        """Prompt ``[B, S]`` -> int64 ``[B, S + n]`` (see the module docstring)."""
        with paddle.no_grad():
            seq = generate_ids(self.model, self.model, input_ids, "paddle", max_new_tokens,
                               do_sample, temperature, top_k, top_p, seed, eos_token_id)
        return paddle.to_tensor(seq)


def compile(model: Any, mode: str = "infer", opt_level: int = 2) -> CompiledLayer:
    """Wrap a Paddle model built from atb GraphOps (see the module docstring)."""
    check_compile(mode, opt_level)
    if not isinstance(model, paddle.nn.Layer) or not _graph_ops(model):
        raise CapabilityError("compile", "model type", "a paddle.nn.Layer built from "
                              "atb_paddle GraphOps", type(model).__name__)
    return CompiledLayer(model, {"mode": mode, "opt_level": opt_level})
