"""``atb_mindspore.compile(cell)``: a MindSpore model built from atb GraphOps, for
inference, with ``generate``.

    import atb_mindspore as atb
    fast = atb.compile(accelerated_llama, mode="infer", opt_level=2)
    ids = fast.generate(input_ids, max_new_tokens=64)      # mindspore int64 [B, S + n]
    logits = fast(input_ids)                               # PyNative, or GRAPH_MODE

The model (a ``mindspore.nn.Cell`` holding at least one ``atb_mindspore.GraphOp``: the
seed's ``AcceleratedLLaMA`` written as a Cell) is wrapped, not modified. ``generate``
(PyNative) resets its ``kv_cache``, runs the prompt once and then one token per step
(:func:`atbcore.graph.model_generate.generate_ids`: greedy, or ``do_sample`` with atb's
seeded ``TopkToppSampling``). The compiled Cell's own forward is the model's
``construct``, so under ``GRAPH_MODE`` its GraphOps run as MindSpore custom ops (see
:mod:`.cells.graph_mode`: a single forward without a host-side ``atb.KVCache``, whose
lengths live in Python).
"""

from __future__ import annotations

from typing import Any

from atbcore.errors import CapabilityError
from atbcore.graph.model_generate import check_compile, generate_ids

from ._env import mindspore

ms = mindspore()

__all__ = ["compile", "CompiledCell"]


def _graph_ops(model: Any) -> list[Any]:
    from .cells.graph_op import GraphOp

    return [c for _, c in model.cells_and_names() if isinstance(c, GraphOp)]


class CompiledCell(ms.nn.Cell):
    """See the module docstring; ``.model`` is the wrapped Cell, ``.graph_ops`` its
    GraphOps."""

    def __init__(self, model: Any, options: dict) -> None:
        super().__init__()
        self.model = model
        self.atb_options = dict(options)
        self.graph_ops = _graph_ops(model)

    def construct(self, *args: Any) -> Any:
        return self.model(*args)

    def generate(self, input_ids: Any, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, eos_token_id: int | None = None) -> Any:
        """Prompt ``[B, S]`` -> int64 ``[B, S + n]`` (see the module docstring)."""
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise CapabilityError("generate", "context mode", "PYNATIVE_MODE (the decode loop "
                                  "keeps its KV cache lengths in Python)", "GRAPH_MODE")
        seq = generate_ids(self.model, self.model, input_ids, "mindspore", max_new_tokens,
                           do_sample, temperature, top_k, top_p, seed, eos_token_id)
        return ms.Tensor.from_numpy(seq)


def compile(model: Any, mode: str = "infer", opt_level: int = 2) -> CompiledCell:
    """Wrap a MindSpore model built from atb GraphOps (see the module docstring)."""
    check_compile(mode, opt_level)
    if not isinstance(model, ms.nn.Cell) or not _graph_ops(model):
        raise CapabilityError("compile", "model type", "a mindspore.nn.Cell built from "
                              "atb_mindspore GraphOps", type(model).__name__)
    return CompiledCell(model, {"mode": mode, "opt_level": opt_level})
