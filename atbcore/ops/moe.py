"""MoE: top-k softmax routing over experts plus the experts' gated FFNs, one op.

``MoE(x, router_w, w_gate_up, w_down) -> y`` with ``x`` [T, H] (or [B, S, H]),
``router_w`` [E, H], ``w_gate_up`` [E, 2I, H] (gate rows first; [E, I, H] for a
non-gated activation), ``w_down`` [E, H, I] — the 3-D layout of Hugging Face's
Mixtral / Qwen2-MoE experts. Routing: softmax over all E router logits in fp32,
top ``top_k`` experts per token, renormalised when ``norm_topk_prob`` (Mixtral;
Qwen2-MoE configs may set False), then ``y = sum_k w_k * expert_k(x)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes import Dtype
from ..errors import ParamsError, ShapeError
from .activation import ActivationFn, get_activation
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype, expect_rank,
                   expect_same_dtype, f64)
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

    def validate(self) -> None:
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
    inputs = ("x", "router_w", "w_gate_up", "w_down")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x, r, gu, dn = ins["x"], ins["router_w"], ins["w_gate_up"], ins["w_down"]
        expect_dtype(self.name, "x", x, FLOAT_DTYPES)
        expect_param_dtype(self.name, p, "x", x)
        expect_rank(self.name, "x", x, (2, 3))
        for n, d in (("router_w", r), ("w_gate_up", gu), ("w_down", dn)):
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
        return [x]

    def reference(self, p, ins):
        x = ins["x"]
        gu, dn = f64(ins["w_gate_up"]), f64(ins["w_down"])
        x2 = f64(x).reshape(-1, x.shape[-1])                                   # [T, H]
        w, ids = ref_route(x2 @ f64(ins["router_w"]).T, p.top_k, p.norm_topk_prob)
        act = p.activation
        y = np.zeros_like(x2)
        for e in np.unique(ids):
            tok, slot = np.nonzero(ids == e)                                   # tokens routed to e
            h = act.numpy(x2[tok] @ gu[e].T)                                   # [n, I]
            y[tok] += (h @ dn[e].T) * w[tok, slot][:, None]                    # [n, H]
        return [y.reshape(x.shape).astype(x.dtype)]
