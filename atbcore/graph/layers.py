"""Seed-style layers: ops with their own weights, for ``GraphOp([...])``.

    block = GraphOp([LayerNorm(eps=1e-5), Linear(out_features=4 * H), SiLU(),
                     Linear(out_features=H), ResidualAdd()])

Every layer takes an optional leading name (``Linear("qkv_proj", out_features=...)``);
the name becomes its node name and the id of its output tensor, so
``ResidualAdd("output", "input")`` adds the tensor ``"input"`` (the block input)
and names the result ``"output"``. Unnamed layers get ``linear``, ``linear_1``, ...

Weights are created at the first lowering, when the input descriptor is known
(``Linear(out_features=...)`` infers ``in_features`` there), initialised like
torch's defaults — ``nn.Linear``: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias;
``nn.LayerNorm``: ones and zeros; RMSNorm: ones — from a NumPy RNG seeded by
``seed`` (default: a CRC of the layer's name), kept in float32 and cast to the
input dtype in the graph. ``weights()`` returns them by local name
(``"weight"``, ``"bias"``, ``"q_proj.weight"`` ...) and ``load_weights({...})``
swaps in a framework's parameters (any tensor; shapes checked).

Layers with their own attention logic (``FlashAttention``, ``RoPE``,
``FusedFeedForward``) live in :mod:`atbcore.graph.layers_attention` and are
re-exported here.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import numpy as np

from ..errors import GraphError, ParamsError, ShapeError
from ..tensor import TensorDesc, is_tensor

if TYPE_CHECKING:
    from .sequential import LoweringContext

__all__ = ["Layer", "Linear", "LayerNorm", "RmsNorm", "ResidualAdd", "SiLU", "Gelu", "Relu",
           "QuickGelu", "Activation", "SwiGLU", "host_array", "FlashAttention", "RoPE",
           "FusedFeedForward"]


def host_array(x: Any) -> np.ndarray:
    """A NumPy array of any framework's tensor (device tensors are copied to host)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "device") and getattr(x.device, "type", "cpu") != "cpu":
        x = x.detach().cpu()
    from ..tensor import to_numpy

    return to_numpy(x)


class Layer:
    """Base class: a named piece of a sequential block that lowers to graph nodes.

    Subclasses set ``kind`` (the auto-name stem) and implement :meth:`lower`; those
    with weights implement :meth:`_init_weights` and :meth:`_weight_shapes`."""

    kind: ClassVar[str] = "layer"

    def __init__(self, name: str | None = None, *, seed: int | None = None) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise ParamsError(type(self).__name__, "layer name", "a non-empty string", repr(name))
        self.name = name
        self.seed = seed
        self._weights: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        label = f"{self.name!r}" if self.name else ""
        return f"{type(self).__name__}({label})"

    # ------------------------------------------------------------------ weights
    def weights(self) -> dict[str, np.ndarray]:
        """This layer's weights by local name (empty before the first lowering
        unless loaded); a weight a GraphOp holds packed comes back unpacked (a copy)."""
        from ..tensor import to_numpy

        return {k: to_numpy(v) if type(v).__name__ == "PackedWeight" else v
                for k, v in self._weights.items()}

    def load_weights(self, weights: Mapping[str, Any]) -> "Layer":
        """Replace weights by local name with any framework's tensors; shapes must
        fit what the layer already knows. Returns the layer."""
        who = self.name or type(self).__name__
        allowed = self._weight_names()
        new = dict(self._weights)
        for k, v in weights.items():
            if k not in allowed:
                raise ParamsError(who, f"unknown weight {k!r}", f"one of {sorted(allowed)}", repr(k))
            if not is_tensor(v):
                raise ParamsError(who, f"weight {k!r}", "a tensor or array", type(v).__name__)
            a = host_array(v)
            want = self._weight_shapes().get(k)
            if want is not None and tuple(a.shape) != tuple(want):
                raise ShapeError(who, f"weight {k!r} shape", list(want), list(a.shape))
            new[k] = a
        self._weights = new
        self._after_load()
        return self

    def _weight_names(self) -> set[str]:
        return set()

    def _weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes known so far (from params or an earlier lowering)."""
        return {k: tuple(v.shape) for k, v in self._weights.items()}

    def _after_load(self) -> None:
        """Update inferred sizes after weights were loaded."""

    def _rng(self, name: str) -> np.random.Generator:
        seed = self.seed if self.seed is not None else zlib.crc32(name.encode())
        return np.random.default_rng(seed)

    def _ensure(self, name: str, shapes: Mapping[str, tuple[int, ...]],
                init: Mapping[str, Any]) -> None:
        """Create missing weights (``init[k](rng, shape)``) and check existing ones."""
        rng = self._rng(name)
        for k, shape in shapes.items():
            if k in self._weights:
                if tuple(self._weights[k].shape) != tuple(shape):
                    raise ShapeError(name, f"weight {k!r} shape for this input", list(shape),
                                     list(self._weights[k].shape))
                continue
            self._weights[k] = np.ascontiguousarray(init[k](rng, shape), dtype=np.float32)

    def _add_weight(self, ctx: "LoweringContext", name: str, key: str, desc: TensorDesc) -> str:
        arr = self._weights[key]
        if type(arr).__name__ == "PackedWeight":  # the layout pass's (one copy): as it is
            if arr.desc.dtype == desc.dtype:
                return ctx.builder.add_weight(f"{name}.{key}", arr)
            from ..tensor import to_numpy
            arr = to_numpy(arr)
        if arr.dtype != desc.dtype.numpy:
            arr = arr.astype(desc.dtype.numpy)
        return ctx.builder.add_weight(f"{name}.{key}", arr)

    # ------------------------------------------------------------------ lowering
    def lower(self, ctx: "LoweringContext", x: str) -> str:
        """Add this layer's nodes reading tensor ``x``; return the output id."""
        raise NotImplementedError


def uniform(bound: float):
    """An initialiser drawing U(-bound, bound)."""
    return lambda rng, shape: rng.uniform(-bound, bound, size=shape)


def _ones(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return np.ones(shape)


def _zeros(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape)


def _positive(who: str, what: str, v: Any, optional: bool = False) -> None:
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ParamsError(who, what, "a positive int", repr(v))


# ----------------------------------------------------------------------------- Linear
class Linear(Layer):
    """``y = x @ W.T + b`` with ``W [out_features, in_features]`` (in_features
    inferred from the input at the first lowering), ``bias=True`` as nn.Linear."""

    kind = "linear"

    def __init__(self, name: str | None = None, *, out_features: int, in_features: int | None = None,
                 bias: bool = True, seed: int | None = None) -> None:
        super().__init__(name, seed=seed)
        _positive("Linear", "out_features", out_features)
        _positive("Linear", "in_features", in_features, optional=True)
        self.out_features, self.in_features, self.bias = int(out_features), in_features, bool(bias)

    def _weight_names(self) -> set[str]:
        return {"weight", "bias"} if self.bias else {"weight"}

    def _weight_shapes(self) -> dict[str, tuple[int, ...]]:
        out = super()._weight_shapes()
        if self.in_features is not None:
            out["weight"] = (self.out_features, self.in_features)
        if self.bias:
            out["bias"] = (self.out_features,)
        return out

    def _after_load(self) -> None:
        if "weight" in self._weights:
            self.in_features = int(self._weights["weight"].shape[1])

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name = ctx.name_of(self)
        d = ctx.builder.desc(x)
        if self.in_features is not None and d.shape[-1] != self.in_features:
            raise ShapeError(name, "input last dim (in_features)", self.in_features,
                             f"shape {list(d.shape)}")
        fan_in = d.shape[-1]
        shapes = {"weight": (self.out_features, fan_in)}
        if self.bias:
            shapes["bias"] = (self.out_features,)
        b = 1.0 / np.sqrt(fan_in)
        self._ensure(name, shapes, {"weight": uniform(b), "bias": uniform(b)})
        self.in_features = fan_in
        ins = [x, self._add_weight(ctx, name, "weight", d)]
        if self.bias:
            ins.append(self._add_weight(ctx, name, "bias", d))
        return ctx.builder.add_node("Linear", ins, {"bias": self.bias}, name=name)[0]


# ----------------------------------------------------------------------------- norms
class LayerNorm(Layer):
    """LayerNorm over the last dim (weight ones, bias zeros, as nn.LayerNorm)."""

    kind = "layer_norm"

    def __init__(self, name: str | None = None, *, eps: float = 1e-5,
                 elementwise_affine: bool = True, seed: int | None = None) -> None:
        super().__init__(name, seed=seed)
        if not eps > 0:
            raise ParamsError("LayerNorm", "eps", "> 0", repr(eps))
        self.eps, self.affine = float(eps), bool(elementwise_affine)

    def _weight_names(self) -> set[str]:
        return {"weight", "bias"} if self.affine else set()

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name = ctx.name_of(self)
        d = ctx.builder.desc(x)
        ins = [x]
        if self.affine:
            self._ensure(name, {"weight": d.shape[-1:], "bias": d.shape[-1:]},
                         {"weight": _ones, "bias": _zeros})
            ins += [self._add_weight(ctx, name, "weight", d), self._add_weight(ctx, name, "bias", d)]
        return ctx.builder.add_node("LayerNorm", ins, {"eps": self.eps}, name=name)[0]


class RmsNorm(Layer):
    """RMSNorm over the last dim (weight ones)."""

    kind = "rms_norm"

    def __init__(self, name: str | None = None, *, eps: float = 1e-6, seed: int | None = None) -> None:
        super().__init__(name, seed=seed)
        if not eps > 0:
            raise ParamsError("RmsNorm", "eps", "> 0", repr(eps))
        self.eps = float(eps)

    def _weight_names(self) -> set[str]:
        return {"weight"}

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name = ctx.name_of(self)
        d = ctx.builder.desc(x)
        self._ensure(name, {"weight": d.shape[-1:]}, {"weight": _ones})
        w = self._add_weight(ctx, name, "weight", d)
        return ctx.builder.add_node("RmsNorm", [x, w], {"eps": self.eps}, name=name)[0]


# ----------------------------------------------------------------------------- residual
class ResidualAdd(Layer):
    """``x + residual``: by default the block input (``"input"``); any earlier
    layer's name adds that layer's output instead."""

    kind = "residual_add"

    def __init__(self, name: str | None = None, residual: str = "input") -> None:
        super().__init__(name)
        if not isinstance(residual, str) or not residual:
            raise ParamsError("ResidualAdd", "residual", "a tensor name such as 'input'",
                              repr(residual))
        self.residual = residual

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name = ctx.name_of(self)
        r = ctx.input if self.residual == "input" else self.residual
        if r not in ctx.outputs_so_far():
            raise GraphError(f"{ctx.builder.name}/{name}", f"residual {self.residual!r} is not "
                             "the block input or an earlier layer", "'input' or one of "
                             f"{sorted(ctx.outputs_so_far())}", repr(self.residual))
        return ctx.builder.add_node("ResidualAdd", [x, r], name=name)[0]


# ----------------------------------------------------------------------------- activations
class _Act(Layer):
    op: ClassVar[str] = ""

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(name)
        self.params = params

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        return ctx.builder.add_node(self.op, [x], self.params, name=ctx.name_of(self))[0]


class SiLU(_Act):
    """``x * sigmoid(x)``."""

    kind, op = "silu", "SiLU"


class Gelu(_Act):
    """GELU; ``approximate="tanh"`` for the tanh form."""

    kind, op = "gelu", "Gelu"

    def __init__(self, name: str | None = None, *, approximate: str = "none") -> None:
        super().__init__(name, approximate=approximate)


class Relu(_Act):
    """``max(x, 0)``."""

    kind, op = "relu", "Relu"


class QuickGelu(_Act):
    """``x * sigmoid(1.702 x)``."""

    kind, op = "quick_gelu", "QuickGelu"


class SwiGLU(_Act):
    """``silu(a) * b`` of the two halves of the last dim."""

    kind, op = "swiglu", "SwiGLU"


class Activation(_Act):
    """Any registered activation by ``activation_type``."""

    kind, op = "activation", "Activation"

    def __init__(self, name: str | None = None, *, activation_type: str) -> None:
        super().__init__(name, activation_type=activation_type)


from .layers_attention import FlashAttention, FusedFeedForward, RoPE  # noqa: E402
