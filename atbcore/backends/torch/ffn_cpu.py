"""FusedFeedForward on the CPU as C calls over panel-packed weights.

    [gate|up] = x @ W^T + b      C matmul on 32-output panels, fp32 out, biases inside
    h = act(gate [, up])         C activation, fp32
    y (= residual) += h @ Wd^T + bd   C matmul accumulating into y, one rounding

The fp32 intermediates live in a workspace: the plan's arena when the kernel is
bound (``FusedFeedForward``'s ``workspace`` declares its size), fresh tensors in an
unbound call. Bound and unbound calls run the same kernels on the same panels
(:mod:`.weight_layout`), so they give the same bits.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...ops.ffn import ffn_layout
from ...runtime.binding import Slot, resolve
from ..cpu_kernels import torch_ops as ck
from ..cpu_kernels.torch_decode import linear_rows
from .activation import c_activation
from .weight_layout import panels, panels_enabled

__all__ = ["CpuFfn", "why_not_cpu_ffn", "ffn_workspace_bytes"]

_F32 = 4


def why_not_cpu_ffn(p: Any, ins: dict[str, Any]) -> str | None:
    """Why the C path cannot run this call (None = it can); ``ins`` its tensors."""
    name, why = c_activation(p.activation)
    if why:
        return why
    if not panels_enabled():
        return "ATB_PANELS=0 (the [out, in] layout runs torch's GEMMs)"
    for n, t in ins.items():
        if n.endswith("_w") and t is not None:
            if type(t) is Slot:
                return f"weight {n} changes per run"
            if t.dtype not in ck.DTYPE_CODES:
                return f"weight {n} dtype {t.dtype}"
            if t.is_inference():
                return f"inference-mode weight {n} (no version counter for its panels)"
    return None


def _parts(p: Any, lay: Any) -> tuple[list[str], int]:
    """The first projections' weight names and the fp32 workspace floats per row."""
    if p.gate_up_merged:
        return ["gate_up_w"], 3 * lay.inter      # gu [2I] + h [I]
    if p.activation.gated:
        return ["gate_w", "up_w"], 2 * lay.inter  # g (then h, in place) + u
    return ["up_w"], lay.inter                    # u (then h, in place)


def ffn_workspace_bytes(p: Any, shapes: dict[str, Any]) -> int:
    """Workspace bytes of a bound call with these input shapes."""
    lay = ffn_layout("FusedFeedForward", p, shapes)
    rows = 1
    for s in shapes["x"][:-1]:
        rows *= int(s)
    return rows * _parts(p, lay)[1] * _F32


class CpuFfn:
    """One FusedFeedForward call's C steps for fixed weights (see the module doc)."""

    def __init__(self, p: Any, ins: dict[str, Any], shapes: dict[str, Any]) -> None:
        self.p = p
        self.lay = lay = ffn_layout("FusedFeedForward", p, shapes)
        self.act = c_activation(p.activation)[0]
        self.first, self.ws_floats = _parts(p, lay)
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor, Any]] = {}
        for w in (*self.first, "down_w"):
            pan, meta = panels(ins[w], lay.transposed[w])
            self.weights[w] = (meta, pan, ins.get(w[:-1] + "b"))

    def _linear(self, x: torch.Tensor, w: str, out: torch.Tensor, accumulate: bool = False
                ) -> None:
        meta, pan, b = self.weights[w]
        linear_rows(x, meta, bias=b, out=out, accumulate=accumulate, panels=pan)

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, y: torch.Tensor,
            ws: torch.Tensor) -> None:
        """``y`` [..., H] in x's dtype; ``ws`` fp32 with ``rows * ws_floats`` elements."""
        lay, rows = self.lay, x.numel() // self.lay.hidden
        x2 = x.reshape(rows, lay.hidden)                                   # [T, H]
        inter = lay.inter
        if self.p.gate_up_merged:
            gu = ws[:rows * 2 * inter].view(rows, 2 * inter)               # [T, 2I] fp32
            h = ws[rows * 2 * inter:rows * 3 * inter].view(rows, inter)    # [T, I] fp32
            self._linear(x2, "gate_up_w", gu)
            ck.activation(gu, self.act, split=True, out=h)
        elif len(self.first) == 2:
            h = ws[:rows * inter].view(rows, inter)                        # gate, then h
            u = ws[rows * inter:rows * 2 * inter].view(rows, inter)
            self._linear(x2, "gate_w", h)
            self._linear(x2, "up_w", u)
            ck.activation(h, self.act, up=u, out=h)
        else:
            h = ws[:rows * inter].view(rows, inter)                        # up, then h
            self._linear(x2, "up_w", h)
            ck.activation(h, self.act, out=h)
        y2 = y.view(rows, lay.hidden)                                      # [T, H]
        if residual is not None:
            y2.copy_(residual.reshape(rows, lay.hidden))
        self._linear(h, "down_w", y2, accumulate=residual is not None)


def shapes_of(ins: dict[str, Any]) -> dict[str, Any]:
    """Input shapes of tensors, slots (their descriptors) and absent inputs skipped."""
    out = {}
    for n, v in ins.items():
        if v is None:
            continue
        out[n] = tuple(v.desc.shape) if type(v) is Slot else tuple(v.shape)
    return out


def bind_cpu_ffn(p: Any, ins: dict[str, Any], outs: list, ctx: Any
                 ) -> Callable[[list], None] | None:
    """The binder of FusedFeedForward: the C steps with weights packed once and the
    intermediates in the plan's workspace (None where the C path cannot run)."""
    x = ins["x"]
    xd = x.desc if type(x) is Slot else None
    dtype = xd.dtype.torch if xd is not None else x.dtype
    device = xd.device if xd is not None else str(x.device)
    if (not str(device).startswith("cpu") or dtype not in ck.DTYPE_CODES
            or ck.unavailable_reason() or why_not_cpu_ffn(p, ins) or ctx.workspace is None):
        return None
    shapes = shapes_of(ins)
    ffn = CpuFfn(p, ins, shapes)
    for w in ffn.weights:
        ctx.note_layout(w, "32-output panels")
    rows = 1
    for d in shapes["x"][:-1]:
        rows *= int(d)
    ctx.note_pool_rows(rows)
    ws = ctx.workspace.view(torch.float32)
    r, y = ins.get("residual"), outs[0]

    def call(env: list) -> None:
        ffn.run(resolve(x, env), None if r is None else resolve(r, env), resolve(y, env), ws)
    return call
