"""Per op, how the framework-free C kernels run it (used by :mod:`.native_kernels`).

A spec says, from shapes and dtypes alone, why the C kernels cannot run a call
(``why_not``; None = they can), what it outputs, how much fp32 scratch it needs
and which C steps compute it (:mod:`.native_ops`). Views of tensors that change per
run carry a :class:`~.native_ops.Ref` address, so the same steps serve an unbound
call and a plan's bound one.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ...dtypes import Dtype
from ...ops.activation import get_activation
from ...ops.ffn import ffn_layout
from .native import CACHE, DTYPE_CODES, PANEL, NativeView
from .native_ops import (Step, activation_steps, layer_norm_steps, linear_steps,
                         rms_norm_steps, softmax_steps)
from .native_attention import PagedDecodeSpec, RopeKVCacheSpec
from .native_gather import EmbeddingSpec, GatherSpec, SplitSpec
from .native_panels import panel_view
from .native_rope import RopeSpec

__all__ = ["SPECS", "MAX_ROWS", "c_activation"]

# The C matmul packs panels at binding beside the stored [N, K] weight; calls of more
# rows keep the framework's GEMM on the stored weight (a weight the layout pass packed
# has no stored twin: the C matmul reads its panels at every row count).
# ATB_NATIVE_MAX_ROWS moves it.
MAX_ROWS = int(os.environ.get("ATB_NATIVE_MAX_ROWS", "256"))

_BUILTIN = "atbcore.ops.activation_fns"
# registry name -> (C activation, gated)
_C_ACTS = {"gelu": ("gelu", False), "gelu_tanh": ("gelu_tanh", False),
           "quick_gelu": ("quick_gelu", False), "silu": ("silu", False),
           "swish": ("silu", False), "relu": ("relu", False), "swiglu": ("silu", True),
           "geglu": ("gelu", True), "geglu_tanh": ("gelu_tanh", True)}


def c_activation(name: str) -> tuple[str | None, str]:
    """(C activation, '') when the C kernel computes registry entry ``name``, else
    (None, why): only the built-in formulas, never one a plugin registered or replaced."""
    entry = get_activation(name)
    hit = _C_ACTS.get(entry.name)
    if hit is None or getattr(entry.numpy_fn, "__module__", "") != _BUILTIN:
        return None, f"activation {entry.name!r} is not a built-in formula"
    return hit[0], ""


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _floats(views: Mapping[str, NativeView], names: tuple[str, ...]) -> str | None:
    for n in names:
        v = views.get(n)
        if v is None:
            continue
        if v.dtype not in DTYPE_CODES:
            return f"{n} dtype {v.dtype.value} (the C kernels take fp32/bf16/fp16)"
        if not v.contiguous:
            return f"{n} is not contiguous"
    return None


def _rows(x: NativeView) -> int:
    return _numel(x.shape[:-1]) if x.shape else 1


class _Spec:
    entry = ""
    has_workspace = False
    launches = 1  # C calls per op call

    def workspace(self, p: Any, shapes: Mapping[str, tuple]) -> int:
        return 0


class NormSpec(_Spec):
    """LayerNorm / RmsNorm, and their Add forms (outputs y and the rounded sum)."""

    def __init__(self, rms: bool, residual: bool) -> None:
        self.rms, self.residual = rms, residual
        self.entry = "rms_norm" if rms else "layer_norm"

    def _n(self, p: Any, views: Mapping[str, NativeView]) -> int:
        x, w = views["x"], views.get("weight")
        k = len(p.normalized_shape) if p.normalized_shape else (len(w.shape) if w else 1)
        return _numel(x.shape[len(x.shape) - k:]) if len(x.shape) >= k else -1

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        why = _floats(views, ("x", "residual", "weight", "bias"))
        if why:
            return why
        x, n = views["x"], self._n(p, views)
        if n <= 0:
            return f"x shape {list(x.shape)} (no rows to normalise)"
        for name in ("weight", "bias"):
            v = views.get(name)
            if v is not None and v.numel != n:
                return f"{name} of {v.numel} elements for rows of {n}"
        r = views.get("residual")
        if r is not None and (r.shape != x.shape or r.dtype != x.dtype):
            return "residual shape or dtype differs from x's"
        return None

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        x = views["x"]
        return [(x.shape, x.dtype)] * (2 if self.residual else 1)

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list) -> list:
        x, n = views["x"], self._n(p, views)
        res, s = views.get("residual"), (outs[1] if self.residual else None)
        if self.rms:
            return rms_norm_steps(x, views["weight"], res, n, p.eps, p.weight_offset, outs[0], s)
        return layer_norm_steps(x, views.get("weight"), views.get("bias"), res, n, p.eps,
                                outs[0], s)


def _packed(w: NativeView) -> bool:
    """A weight the layout pass packed in panels: the C matmul reads it at any row
    count (the framework's GEMM would need it unpacked)."""
    return type(w.owner).__name__ == "PackedWeight"


def _weight_why(w: NativeView, k: int) -> str | None:
    if len(w.shape) != 2 or w.shape[1] != k:
        return f"weight {list(w.shape)} is not [N, {k}]"
    if w.shape[1] > 1 and w.strides[1] != 1:
        return "weight rows are not unit-stride"
    return None


class LinearSpec(_Spec):
    """Linear, and with ``norm`` RmsNormLinear (the matmul RmsNorms its rows first)."""

    entry = "linear_rows"

    def __init__(self, norm: bool = False) -> None:
        self.norm = norm

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        x, w, s = views["x"], views["weight"], views.get("scale")
        why = _floats(views, ("x", "bias", "norm_weight", "residual"))
        if why:
            return why
        if not p.transpose_weight:
            return "an [in, out] weight (the C matmul reads [out, in] rows)"
        if (w.dtype == Dtype.INT8) != (p.quant == "w8") or p.quant not in (None, "w8"):
            return f"weight {w.dtype.value} with quant {p.quant!r}"
        if w.dtype not in DTYPE_CODES and w.dtype != Dtype.INT8:
            return f"weight dtype {w.dtype.value}"
        if s is not None and (s.dtype != Dtype.FP32 or not s.contiguous):
            return "the C matmul takes a contiguous fp32 w8 scale"
        if not x.shape or (_rows(x) > MAX_ROWS and not _packed(w)):
            return f"{_rows(x)} rows > {MAX_ROWS} (the framework's GEMM)"
        return _weight_why(w, x.shape[-1])

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        x = views["x"]
        return [((*x.shape[:-1], views["weight"].shape[0]), x.dtype)]

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list) -> list:
        return linear_steps(views["x"], views["weight"], views.get("bias"), outs[0],
                            scale=views.get("scale") if p.quant == "w8" else None,
                            norm_weight=views.get("norm_weight"),
                            norm_eps=float(p.eps) if self.norm else None,
                            residual=views.get("residual"),
                            panels=panel_view(views["weight"]))


class ActivationSpec(_Spec):
    entry = "activation"

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        why = _floats(views, ("x", "up")) or c_activation(p.activation_name())[1]
        if why:
            return why
        x, up = views["x"], views.get("up")
        gated = get_activation(p.activation_name()).gated
        if up is not None and (not gated or up.shape != x.shape or up.dtype != x.dtype):
            return "up given to a non-gated activation, or unlike x"
        if not x.shape or (gated and up is None and x.shape[-1] % 2):
            return f"x shape {list(x.shape)}"
        return None

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        x = views["x"]
        split = get_activation(p.activation_name()).gated and views.get("up") is None
        return [((*x.shape[:-1], x.shape[-1] // 2) if split else x.shape, x.dtype)]

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list) -> list:
        name = p.activation_name()
        split = get_activation(name).gated and views.get("up") is None
        return activation_steps(views["x"], c_activation(name)[0], outs[0], up=views.get("up"),
                                split=split)


class SoftmaxSpec(_Spec):
    entry = "softmax"

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        x = views["x"]
        r = len(x.shape)
        dims = tuple(p.dim) if isinstance(p.dim, (tuple, list)) else (p.dim,)
        if r == 0 or len(dims) != 1 or dims[0] % r != r - 1:
            return f"softmax over dims {list(dims)} (the C kernel does the last axis)"
        return _floats(views, ("x",))

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        return [(views["x"].shape, views["x"].dtype)]

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list) -> list:
        return softmax_steps(views["x"], outs[0])


_F32 = 4


class FfnSpec(_Spec):
    """FusedFeedForward: first projections into fp32 scratch, the activation there,
    the down projection accumulating into the output (which first takes the residual)."""

    entry = "linear_rows + activation"
    has_workspace = True
    launches = 4  # gate, up, activation, down (3 with gate|up merged or an ungated activation)

    @staticmethod
    def _first(p: Any) -> tuple[str, ...]:
        if p.gate_up_merged:
            return ("gate_up_w",)
        return ("gate_w", "up_w") if p.activation.gated else ("up_w",)

    def _floats_per_row(self, p: Any, inter: int) -> int:
        return (3 if p.gate_up_merged else 2 if p.activation.gated else 1) * inter

    def workspace(self, p: Any, shapes: Mapping[str, tuple]) -> int:
        try:
            lay = ffn_layout("FusedFeedForward", p, shapes)
        except Exception:  # the op's own checks report bad shapes
            return 0
        return _numel(tuple(shapes["x"][:-1])) * self._floats_per_row(p, lay.inter) * _F32

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        names = tuple(views)
        why = _floats(views, tuple(n for n in names if n != "<workspace>"))
        why = why or c_activation(p.activation_type)[1]
        if why:
            return why
        x, r = views["x"], views.get("residual")
        lay = ffn_layout("FusedFeedForward", p, {n: v.shape for n, v in views.items()})
        if any(lay.transposed.values()):
            return "[in, out] weights (the C matmul reads [out, in] rows)"
        if r is not None and (r.shape != x.shape or r.dtype != x.dtype):
            return "residual shape or dtype differs from x's"
        if _rows(x) > MAX_ROWS and not all(_packed(views[n]) for n in views if n.endswith("_w")):
            return f"{_rows(x)} rows > {MAX_ROWS} (the framework's GEMMs)"
        return None

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        return [(views["x"].shape, views["x"].dtype)]

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list) -> list:
        x, y = views["x"], outs[0]
        lay = ffn_layout("FusedFeedForward", p, {n: v.shape for n, v in views.items()
                                                 if n != "<workspace>"})
        rows, hid, inter = _rows(x), lay.hidden, lay.inter
        ws = views["<workspace>"]
        if ws.numel < rows * self._floats_per_row(p, inter) * _F32:
            from ...errors import ShapeError

            raise ShapeError("FusedFeedForward", "workspace bytes",
                             rows * self._floats_per_row(p, inter) * _F32, ws.numel)

        def buf(i: int, width: int) -> NativeView:  # fp32 [rows, width] at float i*rows
            return NativeView(ws.address + i * rows * _F32, (rows, width), (width, 1),
                              Dtype.FP32)

        x2 = NativeView(x.address, (rows, hid), (hid, 1), x.dtype)               # [T, H]
        act = c_activation(p.activation_type)[0]
        norm = {} if p.norm_eps is None else {"norm_weight": views["norm_weight"],
                                              "norm_eps": float(p.norm_eps)}
        steps: list = []
        gu_panels = panel_view(views["gate_up_w"]) if p.gate_up_merged else None
        if gu_panels is not None and inter % PANEL == 0:  # the activation in its epilogue
            h = buf(0, inter)                                                      # [T, I]
            steps += linear_steps(x2, views["gate_up_w"], views.get("gate_up_b"), h,
                                  panels=gu_panels, gated=act, **norm)
        elif p.gate_up_merged:
            gu, h = buf(0, 2 * inter), buf(2 * inter, inter)                       # [T, 2I], [T, I]
            steps += linear_steps(x2, views["gate_up_w"], views.get("gate_up_b"), gu,
                                  panels=gu_panels, **norm)
            steps += activation_steps(gu, act, h, split=True)
        elif p.activation.gated:
            g, u = buf(0, inter), buf(inter, inter)
            steps += linear_steps(x2, views["gate_w"], views.get("gate_b"), g,
                                  panels=panel_view(views["gate_w"]), **norm)
            steps += linear_steps(x2, views["up_w"], views.get("up_b"), u,
                                  panels=panel_view(views["up_w"]), **norm)
            steps += activation_steps(g, act, g, up=u)                             # h = g, in place
            h = g
        else:
            h = buf(0, inter)
            steps += linear_steps(x2, views["up_w"], views.get("up_b"), h,
                                  panels=panel_view(views["up_w"]), **norm)
            steps += activation_steps(h, act, h)                                   # in place
        y2 = NativeView(y.address, (rows, hid), (hid, 1), y.dtype)                 # [T, H]
        r = views.get("residual")
        steps += linear_steps(h, views["down_w"], views.get("down_b"), y2, residual=None
                              if r is None else NativeView(r.address, (rows, hid), (hid, 1),
                                                           r.dtype),
                              panels=panel_view(views["down_w"]))
        return steps


class ReshapeAndCacheSpec(_Spec):
    """ReshapeAndCache: each token's key/value rows copied into the paged caches at its
    slot (-1: skipped), in place; the outputs are the caches themselves. The slots are
    read per call (the op's ``check_values`` and the C kernel both bound them)."""

    entry = "reshape_and_cache"
    inplace = ("key_cache", "value_cache")

    def why_not(self, p: Any, views: Mapping[str, NativeView]) -> str | None:
        k, v, kc, vc = (views[n] for n in ("key", "value", "key_cache", "value_cache"))
        if not (k.dtype == v.dtype == kc.dtype == vc.dtype) or k.dtype.itemsize not in (1, 2, 4):
            return "key, value and caches of one 1/2/4-byte dtype"
        if any(not t.contiguous for t in views.values()):
            return "a tensor is not contiguous"
        if views["slot_mapping"].dtype not in (Dtype.INT32, Dtype.INT64):
            return f"slot_mapping dtype {views['slot_mapping'].dtype.value}"
        if kc.shape != vc.shape or k.shape != v.shape or _numel(kc.shape[:2]) == 0:
            return "caches or key/value of different shapes"
        return None

    def outputs(self, p: Any, views: Mapping[str, NativeView]) -> list[tuple]:
        return []

    def steps(self, p: Any, views: Mapping[str, NativeView], outs: list) -> list:
        k, v, kc, vc, sl = (views[n] for n in ("key", "value", "key_cache", "value_cache",
                                               "slot_mapping"))
        t, row = k.shape[0], _numel(k.shape[1:])
        nb, bs = kc.shape[0], kc.shape[1]
        if row != _numel(kc.shape[2:]) or sl.shape != (t,):
            from ...errors import ShapeError

            raise ShapeError("ReshapeAndCache", "key rows against the cache rows",
                             f"[{t}, {list(kc.shape[2:])}]", list(k.shape))
        if t == 0:
            return []
        return [Step("reshape_and_cache", CACHE, (
            k.address, v.address, kc.address, vc.address, sl.address,
            int(sl.dtype == Dtype.INT32), k.dtype.itemsize, t, row, row, row, bs, nb,
            bs * row, row, bs * row, row))]


_ACTS = ("Gelu", "QuickGelu", "SiLU", "Relu", "SwiGLU", "GeGLU", "Activation")

SPECS: dict[str, Any] = {
    "RmsNorm": NormSpec(True, False), "AddRmsNorm": NormSpec(True, True),
    "LayerNorm": NormSpec(False, False), "AddLayerNorm": NormSpec(False, True),
    "Linear": LinearSpec(), "RmsNormLinear": LinearSpec(norm=True), "Softmax": SoftmaxSpec(),
    "FusedFeedForward": FfnSpec(), "ReshapeAndCache": ReshapeAndCacheSpec(),
    **{op: ActivationSpec() for op in _ACTS}, "RoPE": RopeSpec(),
    "PagedAttention": PagedDecodeSpec(), "RopeKVCache": RopeKVCacheSpec(),
    "Embedding": EmbeddingSpec(), "Gather": GatherSpec(), "Split": SplitSpec(),
}
