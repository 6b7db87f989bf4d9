"""FusedFeedForward on the CPU as C calls over panel-packed weights.

    [gate|up] = norm(x) @ W^T + b   C matmul on 32-output panels, fp32 out, biases (and
                                    with ``norm_eps`` the RmsNorm of x's rows) inside
    h = act(gate [, up])            C activation, fp32
    y = h @ Wd^T + bd [+ residual]  C matmul adding the residual as it stores y, one rounding

A merged gate|up projection of whole panels (I a multiple of 32) applies the activation
in its epilogue instead (``linear_rows(gated=...)``): h in one pass, the same bits,
without the [T, 2I] intermediate written and read again.

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
from ...runtime.native_run import native_call, not_native, slots_of
from ..cpu_kernels import torch_ops as ck
from ..cpu_kernels.torch_act import activation_bound
from ..cpu_kernels.torch_linear import (PANEL, linear_rows, linear_rows_bound,
                                        linear_rows_bound_io)
from .activation import c_activation
from .linear_cpu import is_packed
from .weight_layout import packed_panels, panels, panels_enabled

__all__ = ["CpuFfn", "why_not_cpu_ffn", "ffn_workspace_bytes", "ffn_c_launches"]

_F32 = 4


def why_not_cpu_ffn(p: Any, ins: dict[str, Any]) -> str | None:
    """Why the C path cannot run this call (None = it can); ``ins`` its tensors."""
    name, why = c_activation(p.activation)
    if why:
        return why
    if not panels_enabled():
        return "ATB_PANELS=0 (the [out, in] layout runs torch's GEMMs)"
    nw = ins.get("norm_weight")
    if nw is not None and (type(nw) is Slot or nw.dtype not in ck.DTYPE_CODES
                           or not nw.is_contiguous()):
        return "the norm weight changes per run or is not a contiguous C dtype"
    for n, t in ins.items():
        if n.endswith("_w") and t is not None:
            if type(t) is Slot:
                return f"weight {n} changes per run"
            if is_packed(t):
                continue  # the layout pass packed it for this kernel
            if t.dtype not in ck.DTYPE_CODES:
                return f"weight {n} dtype {t.dtype}"
            if t.is_inference():
                return f"inference-mode weight {n} (no version counter for its panels)"
    return None


def _gated_epilogue(p: Any, lay: Any) -> bool:
    """Whether the merged gate|up projection applies the activation itself (its up half
    starts at a panel boundary)."""
    return bool(p.gate_up_merged) and lay.inter % PANEL == 0


def _parts(p: Any, lay: Any) -> tuple[list[str], int]:
    """The first projections' weight names and the fp32 workspace floats per row."""
    if _gated_epilogue(p, lay):
        return ["gate_up_w"], lay.inter          # h [I]
    if p.gate_up_merged:
        return ["gate_up_w"], 3 * lay.inter      # gu [2I] + h [I]
    if p.activation.gated:
        return ["gate_w", "up_w"], 2 * lay.inter  # g (then h, in place) + u
    return ["up_w"], lay.inter                    # u (then h, in place)


def ffn_c_launches(p: Any, shapes: dict[str, Any]) -> int:
    """C calls of one call with these input shapes: the first projections, the
    activation unless the gate|up matmul applies it, and the down projection."""
    try:
        lay = ffn_layout("FusedFeedForward", p, shapes)
    except Exception:  # the op's own checks report bad shapes
        return 3
    return len(_parts(p, lay)[0]) + (0 if _gated_epilogue(p, lay) else 1) + 1


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
        self.gated = _gated_epilogue(p, lay)
        self.first, self.ws_floats = _parts(p, lay)
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor, Any]] = {}
        for w in (*self.first, "down_w"):
            pan, meta = packed_panels(ins[w]) if is_packed(ins[w]) else \
                panels(ins[w], lay.transposed[w])
            self.weights[w] = (meta, pan, ins.get(w[:-1] + "b"))
        self.norm = {} if p.norm_eps is None else {
            "rms_norm_eps": float(p.norm_eps), "rms_norm_weight": ins["norm_weight"]}

    def _buffers(self, rows: int, ws: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fp32 workspace views: (first projection outputs..., h)."""
        inter = self.lay.inter
        if self.gated:
            return (ws[:rows * inter].view(rows, inter),)                   # h [T, I]
        if self.p.gate_up_merged:
            gu = ws[:rows * 2 * inter].view(rows, 2 * inter)               # [T, 2I] gate|up
            return gu, ws[rows * 2 * inter:rows * 3 * inter].view(rows, inter)   # h [T, I]
        h = ws[:rows * inter].view(rows, inter)                            # gate (or up), then h
        if len(self.first) == 2:
            return h, ws[rows * inter:rows * 2 * inter].view(rows, inter), h    # gate, up, h
        return h, h                                                        # up, h

    def _first(self, x2: torch.Tensor, bufs: tuple) -> list[tuple[torch.Tensor, str, Any]]:
        """(input, weight name, output) of each first projection."""
        return [(x2, w, b) for w, b in zip(self.first, bufs)]

    def _act_args(self, bufs: tuple) -> tuple[torch.Tensor, dict]:
        if self.p.gate_up_merged:
            return bufs[0], {"split": True, "out": bufs[1]}
        if len(self.first) == 2:
            return bufs[0], {"up": bufs[1], "out": bufs[2]}
        return bufs[0], {"out": bufs[1]}

    def _linear_args(self, w: str) -> tuple[torch.Tensor, dict]:
        meta, pan, b = self.weights[w]
        if w == "down_w":
            return meta, {"bias": b, "panels": pan}
        if self.gated:
            return meta, {"bias": b, "panels": pan, "gated": self.act, **self.norm}
        return meta, {"bias": b, "panels": pan, **self.norm}

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, y: torch.Tensor,
            ws: torch.Tensor) -> None:
        """``y`` [..., H] in x's dtype; ``ws`` fp32 with ``rows * ws_floats`` elements."""
        lay, rows = self.lay, x.numel() // self.lay.hidden
        bufs = self._buffers(rows, ws)
        for xi, w, out in self._first(x.reshape(rows, lay.hidden), bufs):     # [T, H]
            meta, kw = self._linear_args(w)
            linear_rows(xi, meta, out=out, **kw)
        if not self.gated:
            g, kw = self._act_args(bufs)
            ck.activation(g, self.act, **kw)
        y2 = y.view(rows, lay.hidden)                                      # [T, H]
        r2 = None if residual is None else residual.reshape(rows, lay.hidden).contiguous()
        meta, kw = self._linear_args("down_w")
        linear_rows(bufs[-1], meta, out=y2, residual=r2, **kw)

    def _bind_down(self, h: torch.Tensor, r: Any, y: Any, rows: int) -> Callable[[list], None]:
        """The down projection's step: ``y = h @ Wd^T + bd [+ r]``, packed once where
        ``y`` and ``r`` are fixed buffers, else with their addresses per call."""
        meta, kw = self._linear_args("down_w")
        hid = self.lay.hidden
        ys = y.desc.shape if type(y) is Slot else y.shape
        hv = h.view(*ys[:-1], -1)
        if type(y) is not Slot and type(r) is not Slot:
            call = linear_rows_bound(hv, meta, y, residual=r, **kw)
            if call is not None:
                return native_call(lambda env: call())

        def like(t: Any) -> Any:
            return torch.empty(t.desc.shape, dtype=t.desc.dtype.torch) if type(t) is Slot else t
        io = linear_rows_bound_io(hv, meta, like(y), residual_like=None if r is None else like(r),
                                  **kw)

        def down(env: list) -> None:
            out, res = resolve(y, env), resolve(r, env)
            if io is not None and out.is_contiguous() and (res is None or res.is_contiguous()):
                io(hv, out) if res is None else io(hv, out, res)
            else:
                not_native()
                linear_rows(h, meta, out=out.view(rows, hid), residual=None if res is None
                            else res.reshape(rows, hid).contiguous(), **kw)
        return native_call(down, io is not None)

    def bind(self, x: Any, residual: Any, y: Any, ws: torch.Tensor) -> Callable[[list], None]:
        """The steps of :meth:`run` bound once: a tensor argument is a fixed buffer (its
        C call packed now), a :class:`Slot` one read per call from ``env``."""
        xd = x.desc.shape if type(x) is Slot else x.shape
        rows = 1
        for d in xd[:-1]:
            rows *= int(d)
        hid, bufs = self.lay.hidden, self._buffers(rows, ws)
        steps: list[Callable[[list], None]] = []
        pure = type(x) is not Slot  # every step one bound C call: recordable
        for _, w, out in self._first(None, bufs):
            meta, kw = self._linear_args(w)
            if type(x) is Slot:
                steps.append(lambda env, meta=meta, kw=kw, out=out: linear_rows(
                    resolve(x, env).reshape(rows, hid), meta, out=out, **kw))
            else:
                x2 = x.reshape(rows, hid)
                call = linear_rows_bound(x2, meta, out, **kw)
                pure = pure and call is not None
                call = call or (
                    lambda x2=x2, meta=meta, out=out, kw=kw: linear_rows(x2, meta, out=out, **kw))
                steps.append(lambda env, call=call: call())
        if not self.gated:
            g, kw = self._act_args(bufs)
            act = activation_bound(g, self.act, **kw)
            pure = pure and act is not None
            act = act or (lambda: ck.activation(g, self.act, **kw))
            steps.append(lambda env: act())
        steps.append(self._bind_down(bufs[-1], residual, y, rows))
        pure = pure and getattr(steps[-1], "native", False)
        # the down step reads the residual by address alone (its io path: contiguous)
        by_address = slots_of([residual])
        if len(steps) == 2:
            s0, s1 = steps

            def run2(env: list) -> None:
                s0(env)
                s1(env)
            return native_call(run2, pure, by_address)
        if len(steps) == 3:
            s0, s1, s2 = steps

            def run3(env: list) -> None:
                s0(env)
                s1(env)
                s2(env)
            return native_call(run3, pure, by_address)

        def run(env: list) -> None:
            for step in steps:
                step(env)
        return native_call(run, pure, by_address)


def shapes_of(ins: dict[str, Any]) -> dict[str, Any]:
    """Input shapes of tensors, slots (their descriptors) and absent inputs skipped."""
    out = {}
    for n, v in ins.items():
        if v is None:
            continue
        out[n] = tuple(v.desc.shape) if type(v) is Slot or is_packed(v) else tuple(v.shape)
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
    return ffn.bind(x, ins.get("residual"), outs[0], ws)


bind_cpu_ffn.takes_packed = True  # type: ignore[attr-defined]  # reads its panels as they are
