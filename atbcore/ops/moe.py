"""MoE: top-k softmax routing over experts plus the experts' gated FFNs, one op.

``MoE(x, router_w, w_gate_up, w_down) -> y`` with ``x`` [T, H] (or [B, S, H]),
``router_w`` [E, H], ``w_gate_up`` [E, 2I, H] (gate rows first; [E, I, H] for a
non-gated activation), ``w_down`` [E, H, I] — the 3-D layout of Hugging Face's
Mixtral / Qwen2-MoE experts. Routing: softmax over all E router logits in fp32,
top ``top_k`` experts per token, renormalised when ``norm_topk_prob`` (Mixtral;
Qwen2-MoE configs may set False), then ``y = sum_k w_k * expert_k(x)``.

With ``quant`` ("w8", "w8a8", "w4") the experts' weights are quantized as a quantized
Linear's (:mod:`.linear`), one expert per leading index: int8 / uint8 ``w_gate_up`` and
``w_down`` with ``gate_up_scale`` / ``down_scale`` (``[E, rows]`` per channel,
``[E, rows, groups]`` for w4) and for w4 optional zero points ``gate_up_zeros`` /
``down_zeros``; each expert runs as that Linear does (the router stays float).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ParamsError, ShapeError
from .activation import ActivationFn, get_activation
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype, expect_rank,
                   expect_same_dtype, f64)
from .linear import QUANT_TYPES, LinearParams, _check_linear, ref_linear
from .linear_quant import W4_GROUP
from .registry import register_op
from .softmax import ref_softmax

__all__ = ["MoEParams", "ref_route"]


@dataclass(frozen=True)
class MoEParams(Params):
    """``num_experts`` (None = router rows), ``top_k`` (alias ``num_experts_per_tok``),
    ``norm_topk_prob``, ``activation_type`` (default ``swiglu``), ``dtype``."""

    ALIASES = {"num_experts_per_tok": "top_k", "num_local_experts": "num_experts",
               "expert_num": "num_experts", "topk": "top_k"}
    num_experts: int | None = None
    top_k: int = 2
    norm_topk_prob: bool = True
    activation_type: str = "swiglu"
    dtype: Dtype | None = None
    quant: str | None = None
    group_size: int = W4_GROUP

    def expert_linear(self, rows: int) -> LinearParams:
        """The Linear params of one expert's projection with ``rows`` outputs."""
        return LinearParams(out_features=rows, bias=False, quant=self.quant,
                            group_size=self.group_size)

    def validate(self) -> None:
        if self.quant is not None:
            q = QUANT_TYPES.get(str(self.quant).lower())
            if q is None:
                self.fail("quant", f"None or one of {sorted(QUANT_TYPES)}", repr(self.quant))
            object.__setattr__(self, "quant", q)
            LinearParams(quant=q, group_size=self.group_size)  # checks the group size
        for f in ("num_experts", "top_k"):
            v = getattr(self, f)
            if (v is not None or f == "top_k") and (not isinstance(v, (int, np.integer))
                                                   or isinstance(v, bool) or v <= 0):
                self.fail(f"parameter {f!r}", "a positive int", repr(v))
        if self.num_experts is not None and self.top_k > self.num_experts:
            self.fail("parameter 'top_k' exceeds num_experts", f"<= {self.num_experts}", self.top_k)
        object.__setattr__(self, "norm_topk_prob", bool(self.norm_topk_prob))
        object.__setattr__(self, "activation_type",
                           get_activation(self.activation_type, self.OP).name)

    @property
    def activation(self) -> ActivationFn:
        return get_activation(self.activation_type, self.OP)


def ref_route(logits: np.ndarray, top_k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(weights [T, k] float64, expert ids [T, k]) from router logits [T, E]: softmax,
    the k largest (ties: lower id first), renormalised when ``norm``."""
    probs = ref_softmax(logits, (1,), empty_rows_zero=False)
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(probs, ids, axis=1)
    if norm:
        w = w / w.sum(axis=1, keepdims=True)
    return w, ids


@register_op
class MoE(OpDef):
    """Top-k routed mixture of gated expert FFNs (Mixtral / Qwen2-MoE style)."""

    name = "MoE"
    aliases = ("SparseMoe", "MoeFFN", "MixtureOfExperts")
    Params = MoEParams
    inputs = ("x", "router_w", "w_gate_up", "w_down", "gate_up_scale?", "down_scale?",
              "gate_up_zeros?", "down_zeros?")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x, r, gu, dn = ins["x"], ins["router_w"], ins["w_gate_up"], ins["w_down"]
        expect_dtype(self.name, "x", x, FLOAT_DTYPES)
        expect_param_dtype(self.name, p, "x", x)
        expect_rank(self.name, "x", x, (2, 3))
        experts = (("router_w", r),) if p.quant else (("router_w", r), ("w_gate_up", gu),
                                                     ("w_down", dn))
        for n, d in experts:
            expect_same_dtype(self.name, "x", x, n, d)
        expect_rank(self.name, "router_w", r, 2)
        expect_rank(self.name, "w_gate_up", gu, 3)
        expect_rank(self.name, "w_down", dn, 3)
        h, e = x.shape[-1], r.shape[0]
        if p.num_experts is not None and e != p.num_experts:
            raise ShapeError(self.name, "input 'router_w' rows (num_experts)", p.num_experts,
                             f"{e} (shape {list(r.shape)})")
        if p.top_k > e:
            raise ParamsError(self.name, "parameter 'top_k' exceeds the number of experts",
                              f"<= {e}", p.top_k)
        if r.shape[1] != h:
            raise ShapeError(self.name, "input 'router_w' shape [E, H]", [e, h], list(r.shape))
        inter = dn.shape[2]
        rows = 2 * inter if p.activation.gated else inter
        if tuple(dn.shape) != (e, h, inter):
            raise ShapeError(self.name, "input 'w_down' shape [E, H, I]", [e, h, "I"], list(dn.shape))
        if tuple(gu.shape) != (e, rows, h):
            lay = "[E, 2I, H]" if p.activation.gated else "[E, I, H]"
            raise ShapeError(self.name, f"input 'w_gate_up' shape {lay} (I = {inter} from w_down)",
                             [e, rows, h], list(gu.shape))
        if p.quant:
            self._check_experts(p, ins, x, e)
        else:
            for n in self.input_names[4:]:
                if ins.get(n) is not None:
                    raise InputError(self.name, f"input {n!r} given without a quant mode",
                                     "no scales or zero points for float experts",
                                     list(ins[n].shape))
        return [x]

    def _check_experts(self, p, ins, x, e) -> None:
        """Each expert's projections as the quantized Linears they are."""
        from ..tensor import TensorDesc

        def one(d):
            return None if d is None else TensorDesc(tuple(d.shape)[1:], d.dtype)
        for w, part, n_in in (("w_gate_up", "gate_up", x.shape[-1]),
                              ("w_down", "down", ins["w_down"].shape[2])):
            s, z = ins.get(f"{part}_scale"), ins.get(f"{part}_zeros")
            for name, d in ((f"{part}_scale", s), (f"{part}_zeros", z)):
                if d is not None and d.shape[0] != e:
                    raise ShapeError(self.name, f"input {name!r} experts", e, list(d.shape))
            _check_linear(self.name, p.expert_linear(ins[w].shape[1]),
                          {"x": TensorDesc((1, n_in), x.dtype), "weight": one(ins[w]),
                           "scale": one(s), "zeros": one(z)})

    def reference(self, p, ins):
        x = ins["x"]
        gu, dn = f64(ins["w_gate_up"]), f64(ins["w_down"])
        x2 = f64(x).reshape(-1, x.shape[-1])                                   # [T, H]
        w, ids = ref_route(x2 @ f64(ins["router_w"]).T, p.top_k, p.norm_topk_prob)
        act = p.activation
        y = np.zeros_like(x2)
        for e in np.unique(ids):
            tok, slot = np.nonzero(ids == e)                                   # tokens routed to e
            if p.quant:
                h = act.numpy(self._expert(p, ins, "gate_up", e, x2[tok]))     # [n, I]
                y[tok] += self._expert(p, ins, "down", e, h) * w[tok, slot][:, None]
                continue
            h = act.numpy(x2[tok] @ gu[e].T)                                   # [n, I]
            y[tok] += (h @ dn[e].T) * w[tok, slot][:, None]                    # [n, H]
        return [y.reshape(x.shape).astype(x.dtype)]

    @staticmethod
    def _expert(p, ins, part: str, e: int, rows: np.ndarray) -> np.ndarray:
        """float64 quantized projection ``part`` of expert ``e`` on ``rows``."""
        w = np.asarray(ins["w_gate_up" if part == "gate_up" else "w_down"])[e]
        z = ins.get(f"{part}_zeros")
        return ref_linear(p.expert_linear(w.shape[0]), rows, w, None,
                          np.asarray(ins[f"{part}_scale"])[e], None,
                          None if z is None else np.asarray(z)[e])
