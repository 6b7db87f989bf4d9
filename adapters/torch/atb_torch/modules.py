"""atb ops as ``nn.Module`` s: linear, norms, residual add and activations.

Both spellings work::

    atb.Linear(64, 128)                          # torch style: in, out
    atb.Linear("qkv_proj", out_features=3 * H)   # seed style: name, in_features lazy
    atb.LayerNorm(64) / atb.LayerNorm("query", eps=1e-5)
    atb.RmsNorm(64, eps=1e-6)

Standalone calls run ``torch.ops.atb.*`` (so they compile); inside a
``GraphOp([...])`` the same module is lowered into the fused graph and its
parameters are the graph's weights.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from atbcore.errors import ParamsError
from atbcore.graph import layers as core

from . import functional as F
from .graph_layers import OpLayer
from .module_base import AtbModule, new_param, split_name
from .tensors import as_torch

__all__ = ["Linear", "LayerNorm", "RmsNorm", "RMSNorm", "AddLayerNorm", "AddRmsNorm",
           "ResidualAdd", "SiLU", "Swish", "Gelu", "GELU", "QuickGelu", "Relu", "SwiGLU",
           "GeGLU", "Activation"]


def _positive(op: str, what: str, v: Any, optional: bool = True) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ParamsError(op, what, "a positive int", repr(v))
    return int(v)


# ----------------------------------------------------------------------------- Linear


class Linear(AtbModule):
    """``y = x @ weight.T + bias``; ``weight [out_features, in_features]``.

    ``Linear(in, out)``, ``Linear(out_features=...)`` (in_features taken from the
    first input) or ``Linear("name", out_features=...)``. Initialised like
    ``nn.Linear``."""

    op_name, kind, graph_layer = "Linear", "linear", True

    def __init__(self, name_or_in: str | int | None = None, out_features: int | None = None, *,
                 in_features: int | None = None, bias: bool = True, dtype: Any = None,
                 device: Any = None) -> None:
        name, size = split_name("Linear", name_or_in)
        super().__init__(name)
        if size is not None and in_features is not None and size != in_features:
            raise ParamsError("Linear", "in_features given twice", size, in_features)
        self.in_features = _positive("Linear", "in_features", size or in_features)
        self.out_features = _positive("Linear", "out_features", out_features, optional=False)
        self.use_bias = bool(bias)
        shape = None if self.in_features is None else (self.out_features, self.in_features)
        self.weight = new_param(shape, dtype, device)
        self.bias = new_param((self.out_features,), dtype, device) if bias else None
        if self.in_features is not None:
            self.reset_parameters()
        elif bias:
            self.bias = new_param(None, dtype, device)  # its bound needs in_features too

    def reset_parameters(self) -> None:
        """U(-1/sqrt(in), 1/sqrt(in)) for weight and bias, as ``nn.Linear``."""
        with torch.no_grad():
            self._init_param("weight", self.weight)
            if self.bias is not None:
                self._init_param("bias", self.bias)

    def _init_param(self, key: str, p: nn.Parameter) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[1] if key == "bias" else p.shape[1])
        nn.init.uniform_(p, -bound, bound)

    def _after_materialize(self) -> None:
        if not isinstance(self.weight, nn.parameter.UninitializedParameter):
            self.in_features = int(self.weight.shape[1])

    def forward(self, x: Any) -> Tensor:
        x = as_torch(x, "Linear")
        if self.has_lazy():
            shapes = {"weight": (self.out_features, x.shape[-1])}
            if self.use_bias:
                shapes["bias"] = (self.out_features,)
            self.materialize(shapes)
        return F.linear(x, self.weight, self.bias)

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> core.Linear:
        layer = core.Linear(name, out_features=self.out_features, in_features=self.in_features,
                            bias=self.use_bias)
        return layer.load_weights(weights)

    def extra_repr(self) -> str:
        return (f"{self.name!r}, " if self.name else "") + \
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}"


# ----------------------------------------------------------------------------- norms


class _Norm(AtbModule):
    graph_layer = True
    default_eps = 1e-5

    def __init__(self, name_or_size: str | int | None = None, *, eps: float | None = None,
                 hidden_size: int | None = None, normalized_shape: Any = None,
                 elementwise_affine: bool = True, bias: bool = True, dtype: Any = None,
                 device: Any = None) -> None:
        name, size = split_name(self.op_name, name_or_size)
        super().__init__(name)
        if isinstance(normalized_shape, (tuple, list, torch.Size)):
            if len(normalized_shape) != 1:
                raise ParamsError(self.op_name, "normalized_shape", "one dim (the last)",
                                  list(normalized_shape))
            normalized_shape = normalized_shape[0]
        self.hidden_size = _positive(self.op_name, "hidden size",
                                     size or hidden_size or normalized_shape)
        self.eps = float(self.default_eps if eps is None else eps)
        if not self.eps > 0:
            raise ParamsError(self.op_name, "eps", "> 0", self.eps)
        self.elementwise_affine = bool(elementwise_affine)
        shape = None if self.hidden_size is None else (self.hidden_size,)
        self.weight = new_param(shape, dtype, device) if elementwise_affine else None
        has_bias = elementwise_affine and bias and self.has_bias_param
        self.bias = new_param(shape, dtype, device) if has_bias else None
        if shape is not None:
            self.reset_parameters()

    has_bias_param = True

    def reset_parameters(self) -> None:
        """Weight ones, bias zeros (as ``nn.LayerNorm`` / ``nn.RMSNorm``)."""
        with torch.no_grad():
            for k, p in self.core_weights().items():
                self._init_param(k, p)

    def _init_param(self, key: str, p: nn.Parameter) -> None:
        nn.init.ones_(p) if key == "weight" else nn.init.zeros_(p)

    def _after_materialize(self) -> None:
        if self.weight is not None and not isinstance(self.weight,
                                                      nn.parameter.UninitializedParameter):
            self.hidden_size = int(self.weight.shape[0])

    def _prepare(self, x: Tensor) -> None:
        if self.has_lazy():
            self.materialize({k: (x.shape[-1],) for k in self.core_weights()})

    def extra_repr(self) -> str:
        return (f"{self.name!r}, " if self.name else "") + f"{self.hidden_size}, eps={self.eps}"


class LayerNorm(_Norm):
    """LayerNorm over the last dim; ``LayerNorm(64)`` or ``LayerNorm("name", eps=...)``
    (size from the first input)."""

    op_name, kind = "LayerNorm", "layer_norm"

    def forward(self, x: Any) -> Tensor:
        x = as_torch(x, "LayerNorm")
        self._prepare(x)
        return F.layer_norm(x, self.weight, self.bias, self.eps)

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> Any:
        if self.elementwise_affine and self.bias is None:
            return OpLayer(name, op="LayerNorm", kind=self.kind, params={"eps": self.eps},
                           weights=weights)
        layer = core.LayerNorm(name, eps=self.eps, elementwise_affine=self.elementwise_affine)
        return layer.load_weights(weights)


class RmsNorm(_Norm):
    """RMSNorm over the last dim (weight ones), eps 1e-6 by default."""

    op_name, kind, default_eps, has_bias_param = "RmsNorm", "rms_norm", 1e-6, False

    def forward(self, x: Any) -> Tensor:
        x = as_torch(x, "RmsNorm")
        self._prepare(x)
        return F.rms_norm(x, self.weight, self.eps)

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> core.RmsNorm:
        return core.RmsNorm(name, eps=self.eps).load_weights(weights)


RMSNorm = RmsNorm


class AddLayerNorm(LayerNorm):
    """``forward(x, residual) -> (layer_norm(x + residual), x + residual)``."""

    op_name, graph_layer = "AddLayerNorm", False

    def forward(self, x: Any, residual: Any) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        x = as_torch(x, "AddLayerNorm")
        self._prepare(x)
        return F.add_layer_norm(x, residual, self.weight, self.bias, self.eps)

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> Any:
        return AtbModule.core_layer(self, name, weights)


class AddRmsNorm(RmsNorm):
    """``forward(x, residual) -> (rms_norm(x + residual), x + residual)``."""

    op_name, graph_layer = "AddRmsNorm", False

    def forward(self, x: Any, residual: Any) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        x = as_torch(x, "AddRmsNorm")
        self._prepare(x)
        return F.add_rms_norm(x, residual, self.weight, self.eps)

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> Any:
        return AtbModule.core_layer(self, name, weights)


# ----------------------------------------------------------------------------- residual


class ResidualAdd(AtbModule):
    """``x + residual``. Standalone: ``forward(x, residual)``. In a GraphOp the
    residual is the block input (``"input"``, the default) or an earlier layer's
    name: ``ResidualAdd("output", "input")``."""

    op_name, kind, graph_layer = "ResidualAdd", "residual_add", True

    def __init__(self, name: str | None = None, residual: str = "input") -> None:
        super().__init__(split_name("ResidualAdd", name)[0])
        if not isinstance(residual, str) or not residual:
            raise ParamsError("ResidualAdd", "residual", "a tensor name such as 'input'",
                              repr(residual))
        self.residual = residual

    def forward(self, x: Any, residual: Any) -> Tensor:
        return F.residual_add(x, residual)

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> core.ResidualAdd:
        return core.ResidualAdd(name, self.residual)


# ----------------------------------------------------------------------------- activations


class _Act(AtbModule):
    graph_layer = True
    core_cls: Any = None

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(split_name(self.op_name, name)[0])
        self.params = params

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> Any:
        if self.core_cls is None:
            return OpLayer(name, op=self.op_name, kind=self.kind, params=self.params)
        return self.core_cls(name, **self.params)

    def extra_repr(self) -> str:
        return ", ".join([repr(self.name)] * bool(self.name) +
                         [f"{k}={v!r}" for k, v in self.params.items()])


class SiLU(_Act):
    """``x * sigmoid(x)`` (alias ``Swish``)."""

    op_name, kind, core_cls = "SiLU", "silu", core.SiLU

    def forward(self, x: Any) -> Tensor:
        return F.silu(x)


Swish = SiLU


class Gelu(_Act):
    """GELU; ``approximate="tanh"`` for the tanh form."""

    op_name, kind, core_cls = "Gelu", "gelu", core.Gelu

    def __init__(self, name: str | None = None, *, approximate: str = "none") -> None:
        super().__init__(name, approximate=approximate)

    def forward(self, x: Any) -> Tensor:
        return F.gelu(x, self.params["approximate"])


GELU = Gelu


class QuickGelu(_Act):
    """``x * sigmoid(1.702 x)``."""

    op_name, kind, core_cls = "QuickGelu", "quick_gelu", core.QuickGelu

    def forward(self, x: Any) -> Tensor:
        return F.quick_gelu(x)


class Relu(_Act):
    """``max(x, 0)``."""

    op_name, kind, core_cls = "Relu", "relu", core.Relu

    def forward(self, x: Any) -> Tensor:
        return F.relu(x)


class SwiGLU(_Act):
    """``silu(a) * b`` of the halves of the last dim, or ``forward(gate, up)``."""

    op_name, kind, core_cls = "SwiGLU", "swiglu", core.SwiGLU

    def forward(self, x: Any, up: Any = None) -> Tensor:
        return F.swiglu(x, up)


class GeGLU(_Act):
    """``gelu(a) * b`` of the halves of the last dim, or ``forward(gate, up)``."""

    op_name, kind = "GeGLU", "geglu"

    def __init__(self, name: str | None = None, *, approximate: str = "none") -> None:
        super().__init__(name, approximate=approximate)

    def forward(self, x: Any, up: Any = None) -> Tensor:
        return F.geglu(x, up, self.params["approximate"])


class Activation(_Act):
    """Any registered activation by ``activation_type`` (plugins add names)."""

    op_name, kind, core_cls = "Activation", "activation", core.Activation

    def __init__(self, name: str | None = None, *, activation_type: str) -> None:
        super().__init__(name, activation_type=activation_type)

    def forward(self, x: Any, up: Any = None) -> Tensor:
        return F.activation(x, self.params["activation_type"], up)
