"""atb ops as ``nn.Module`` s: FFN, MoE, embedding, softmax, elementwise, shape,
sampling and parallel ops.

Modules with one running input (Softmax, unary Elewise, Transpose, Reshape,
Embedding, MoE, Argmax, TopkToppSampling, AllReduce, FusedFeedForward) can also sit
in a ``GraphOp([...])``; the others are standalone only.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from atbcore.errors import ParamsError
from atbcore.graph import layers as core
from atbcore.ops.activation import get_activation

from . import functional as F
from .graph_layers import OpLayer
from .module_base import AtbModule, ParamHolder, new_param, split_name
from .tensors import as_torch

__all__ = ["FusedFeedForward", "MoE", "Embedding", "MatMul", "Softmax", "ScaledMaskedSoftmax",
           "Elewise", "Transpose", "Reshape", "Split", "Concat", "Gather", "Argmax",
           "TopkToppSampling", "AllReduce", "LinearParallel"]


def _pos(op: str, what: str, v: Any, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ParamsError(op, what, "a positive int", repr(v))
    return int(v)


def _uniform_fan_in(p: nn.Parameter, fan_in: int) -> None:
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        nn.init.uniform_(p, -bound, bound)


class _OpModule(AtbModule):
    """A weightless op with fixed params; graph layer through :class:`OpLayer`."""

    graph_layer = True
    x_index = 0

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(split_name(self.op_name, name)[0])
        self.params = params

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> Any:
        return OpLayer(name, op=self.op_name, kind=self.kind, params=self.params,
                       weights=weights, x_index=self.x_index)

    def extra_repr(self) -> str:
        return ", ".join([repr(self.name)] * bool(self.name) +
                         [f"{k}={v!r}" for k, v in self.params.items()])


# ----------------------------------------------------------------------------- FFN, MoE


class FusedFeedForward(AtbModule):
    """``down(act(gate(x)) * up(x)) [+ residual]`` (gated) or ``down(act(up(x)))``
    with ``gate_proj``/``up_proj``/``down_proj`` weights in nn.Linear layout, as
    Hugging Face's ``LlamaMLP``; ``hidden_size`` is taken from the first input when
    not given."""

    op_name, kind, graph_layer = "FusedFeedForward", "ffn", True

    def __init__(self, name: str | None = None, *, intermediate_size: int,
                 activation_type: str = "swiglu", bias: bool = False,
                 hidden_size: int | None = None, dtype: Any = None, device: Any = None) -> None:
        super().__init__(split_name("FusedFeedForward", name)[0])
        self.intermediate_size = _pos("FusedFeedForward", "intermediate_size", intermediate_size)
        act = get_activation(activation_type, "FusedFeedForward")
        self.activation_type, self.gated, self.use_bias = act.name, act.gated, bool(bias)
        self.hidden_size = _pos("FusedFeedForward", "hidden_size", hidden_size, optional=True)
        h, i = self.hidden_size, self.intermediate_size
        for proj in self._projs():
            shape = None if h is None else ((h, i) if proj == "down_proj" else (i, h))
            ps = {"weight": new_param(shape, dtype, device)}
            if bias:
                ps["bias"] = new_param(None if shape is None else shape[:1], dtype, device)
            setattr(self, proj, ParamHolder(**ps))
        if h is not None:
            for k, p in self.core_weights().items():
                self._init_param(k, p)

    def _projs(self) -> tuple[str, ...]:
        return ("gate_proj", "up_proj", "down_proj") if self.gated else ("up_proj", "down_proj")

    def _init_param(self, key: str, p: nn.Parameter) -> None:
        h = int(self.up_proj.weight.shape[1])
        _uniform_fan_in(p, self.intermediate_size if key.startswith("down") else h)

    def _after_materialize(self) -> None:
        if not isinstance(self.up_proj.weight, nn.parameter.UninitializedParameter):
            self.hidden_size = int(self.up_proj.weight.shape[1])

    def forward(self, x: Any, residual: Any = None) -> Tensor:
        x = as_torch(x, "FusedFeedForward")
        if self.has_lazy():
            h, i = x.shape[-1], self.intermediate_size
            shapes = {}
            for proj in self._projs():
                shapes[f"{proj}.weight"] = (h, i) if proj == "down_proj" else (i, h)
                shapes[f"{proj}.bias"] = (h,) if proj == "down_proj" else (i,)
            self.materialize(shapes)
        b = (lambda p: getattr(getattr(self, p), "bias", None)) if self.use_bias else \
            (lambda p: None)
        gate = self.gate_proj.weight if self.gated else None
        return F.fused_feed_forward(x, gate, self.up_proj.weight, self.down_proj.weight,
                                    activation_type=self.activation_type,
                                    gate_b=b("gate_proj") if self.gated else None,
                                    up_b=b("up_proj"), down_b=b("down_proj"), residual=residual)

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> core.FusedFeedForward:
        layer = core.FusedFeedForward(name, intermediate_size=self.intermediate_size,
                                      activation_type=self.activation_type, bias=self.use_bias)
        return layer.load_weights(weights)


class MoE(AtbModule):
    """Top-k mixture of experts: ``router_weight [E, H]``, ``w_gate_up [E, 2I, H]``
    (gate rows first), ``w_down [E, H, I]``. ``forward(x)`` for x ``[..., H]``."""

    op_name, kind, graph_layer = "MoE", "moe", True

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *,
                 top_k: int = 2, norm_topk_prob: bool = True, activation_type: str = "swiglu",
                 name: str | None = None, dtype: Any = None, device: Any = None) -> None:
        super().__init__(name)
        h, i, e = (_pos("MoE", n, v) for n, v in (("hidden_size", hidden_size),
                                                   ("intermediate_size", intermediate_size),
                                                   ("num_experts", num_experts)))
        self.hidden_size, self.intermediate_size, self.num_experts = h, i, e
        self.top_k, self.norm_topk_prob = int(top_k), bool(norm_topk_prob)
        self.activation_type = get_activation(activation_type, "MoE").name
        self.router_weight = new_param((e, h), dtype, device)
        self.w_gate_up = new_param((e, 2 * i, h), dtype, device)
        self.w_down = new_param((e, h, i), dtype, device)
        for k, p in self.core_weights().items():
            self._init_param(k, p)

    def _init_param(self, key: str, p: nn.Parameter) -> None:
        _uniform_fan_in(p, self.intermediate_size if key == "w_down" else self.hidden_size)

    def _params(self) -> dict[str, Any]:
        return {"top_k": self.top_k, "norm_topk_prob": self.norm_topk_prob,
                "activation_type": self.activation_type, "num_experts": self.num_experts}

    def forward(self, x: Any) -> Tensor:
        x = as_torch(x, "MoE")
        flat = x.reshape(-1, x.shape[-1])  # [T, H]: the op routes tokens
        y = F.moe(flat, self.router_weight, self.w_gate_up, self.w_down, **self._params())
        return y.reshape(x.shape)

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> OpLayer:
        return OpLayer(name, op="MoE", kind=self.kind, params=self._params(),
                       weights={k: weights[k] for k in ("router_weight", "w_gate_up", "w_down")})


class Embedding(AtbModule):
    """``weight[ids]`` with ``weight [num_embeddings, embedding_dim]`` ~ N(0, 1), as
    ``nn.Embedding``; ids out of range raise InputError."""

    op_name, kind, graph_layer = "Embedding", "embedding", True

    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str | None = None,
                 dtype: Any = None, device: Any = None) -> None:
        super().__init__(name)
        self.num_embeddings = _pos("Embedding", "num_embeddings", num_embeddings)
        self.embedding_dim = _pos("Embedding", "embedding_dim", embedding_dim)
        self.weight = new_param((self.num_embeddings, self.embedding_dim), dtype, device)
        with torch.no_grad():
            nn.init.normal_(self.weight)

    def forward(self, ids: Any) -> Tensor:
        return F.embedding(ids, self.weight)

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> OpLayer:
        return OpLayer(name, op="Embedding", kind=self.kind, weights=weights, x_index=1,
                       cast=False)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


# ----------------------------------------------------------------------------- weightless ops


class MatMul(_OpModule):
    """``forward(a, b)``: batched ``a @ b`` (``transpose_a`` / ``transpose_b``)."""

    op_name, kind, graph_layer = "MatMul", "matmul", False

    def __init__(self, name: str | None = None, *, transpose_a: bool = False,
                 transpose_b: bool = False) -> None:
        super().__init__(name, transpose_a=transpose_a, transpose_b=transpose_b)

    def forward(self, a: Any, b: Any) -> Tensor:
        return F.matmul(a, b, **self.params)


class Softmax(_OpModule):
    """Softmax over ``dim`` (an axis or several)."""

    op_name, kind = "Softmax", "softmax"

    def __init__(self, name: str | None = None, *, dim: int | Sequence[int] = -1) -> None:
        super().__init__(name, dim=dim if isinstance(dim, int) else tuple(dim))

    def forward(self, x: Any) -> Tensor:
        return F.softmax(x, self.params["dim"])


class ScaledMaskedSoftmax(_OpModule):
    """``forward(x, mask=None)``: ``softmax(x * scale + mask)``."""

    op_name, kind = "ScaledMaskedSoftmax", "scaled_masked_softmax"

    def __init__(self, name: str | None = None, *, scale: float = 1.0, causal: bool = False,
                 dim: int = -1) -> None:
        super().__init__(name, scale=scale, causal=causal, dim=dim)

    def forward(self, x: Any, mask: Any = None) -> Tensor:
        return F.scaled_masked_softmax(x, mask, **self.params)


class Elewise(_OpModule):
    """``forward(x, y=None)``: one elementwise op by ``elewise_type``."""

    op_name, kind = "Elewise", "elewise"

    def __init__(self, name: str | None = None, *, elewise_type: str, scalar: float = 1.0,
                 out_dtype: Any = None) -> None:
        params: dict[str, Any] = {"elewise_type": elewise_type}
        if scalar != 1.0:
            params["scalar"] = scalar
        if out_dtype is not None:
            params["out_dtype"] = out_dtype
        super().__init__(name, **params)

    def forward(self, x: Any, y: Any = None) -> Tensor:
        return F.elewise(x, y, **self.params)


class Transpose(_OpModule):
    op_name, kind = "Transpose", "transpose"

    def __init__(self, name: str | None = None, *, perm: Sequence[int]) -> None:
        super().__init__(name, perm=tuple(perm))

    def forward(self, x: Any) -> Tensor:
        return F.transpose(x, self.params["perm"])


class Reshape(_OpModule):
    """A view with ``shape`` (one -1 allowed)."""

    op_name, kind = "Reshape", "reshape"

    def __init__(self, name: str | None = None, *, shape: Sequence[int]) -> None:
        super().__init__(name, shape=tuple(shape))

    def forward(self, x: Any) -> Tensor:
        return F.reshape(x, self.params["shape"])


class Split(_OpModule):
    """``forward(x) -> list``: pieces of ``sizes`` (or ``num`` equal ones) along ``dim``."""

    op_name, kind, graph_layer = "Split", "split", False

    def __init__(self, name: str | None = None, *, sizes: Sequence[int] | None = None,
                 num: int | None = None, dim: int = -1) -> None:
        super().__init__(name, sizes=None if sizes is None else tuple(sizes), num=num, dim=dim)

    def forward(self, x: Any) -> list[Tensor]:
        return F.split(x, self.params["sizes"], self.params["dim"], num=self.params["num"])


class Concat(_OpModule):
    """``forward(*xs)`` (or one list) joined along ``dim``."""

    op_name, kind, graph_layer = "Concat", "concat", False

    def __init__(self, name: str | None = None, *, dim: int = -1) -> None:
        super().__init__(name, dim=dim)

    def forward(self, *xs: Any) -> Tensor:
        items = list(xs[0]) if len(xs) == 1 and isinstance(xs[0], (list, tuple)) else list(xs)
        return F.concat(items, self.params["dim"])


class Gather(_OpModule):
    """``forward(x, indices)``: ``take(x, indices, axis)``."""

    op_name, kind, graph_layer = "Gather", "gather", False

    def __init__(self, name: str | None = None, *, axis: int = 0) -> None:
        super().__init__(name, axis=axis)

    def forward(self, x: Any, indices: Any) -> Tensor:
        return F.gather(x, indices, self.params["axis"])


class Argmax(_OpModule):
    op_name, kind = "Argmax", "argmax"

    def __init__(self, name: str | None = None, *, dim: int = -1, keepdim: bool = False) -> None:
        super().__init__(name, dim=dim, keepdim=keepdim)

    def forward(self, x: Any) -> Tensor:
        return F.argmax(x, **self.params)


class TopkToppSampling(_OpModule):
    """Seeded top-k / top-p sampling: logits ``[B, V]`` -> ids int64 ``[B]``."""

    op_name, kind = "TopkToppSampling", "sampling"

    def __init__(self, name: str | None = None, *, top_k: int = 0, top_p: float = 1.0,
                 temperature: float = 1.0, seed: int = 0) -> None:
        super().__init__(name, top_k=top_k, top_p=top_p, temperature=temperature, seed=seed)

    def forward(self, logits: Any) -> Tensor:
        return F.topk_topp_sampling(logits, **self.params)


class AllReduce(_OpModule):
    """Reduce across the default process group (identity in one process)."""

    op_name, kind = "AllReduce", "all_reduce"

    def __init__(self, name: str | None = None, *, op: str = "sum") -> None:
        super().__init__(name, op=op)

    def forward(self, x: Any) -> Tensor:
        return F.all_reduce(x, self.params["op"])


class LinearParallel(AtbModule):
    """Row-parallel linear: each rank holds ``weight [out, in/ranks]`` of its input
    slice; partial products are all-reduced, then the bias is added once. In one
    process it equals ``nn.Linear``."""

    op_name, kind = "LinearParallel", "linear_parallel"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 name: str | None = None, dtype: Any = None, device: Any = None) -> None:
        super().__init__(name)
        self.in_features = _pos("LinearParallel", "in_features", in_features)
        self.out_features = _pos("LinearParallel", "out_features", out_features)
        self.weight = new_param((self.out_features, self.in_features), dtype, device)
        self.bias = new_param((self.out_features,), dtype, device) if bias else None
        for p in self.parameters():
            _uniform_fan_in(p, self.in_features)

    def forward(self, x: Any) -> Tensor:
        y = F.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else F.elewise(y, self.bias, elewise_type="add")
