"""atb torch kernels bound once, and the prepared weights they run on.

:class:`Kern` is one op's torch kernel (``get_backend("torch").kernel(op).fn``) with
its params object built at compile time; calling it is one kernel call, without
``Operation.execute``'s per-call validation and dispatch. :class:`Lin`, :class:`Norm`
and :class:`Act` pair kernels with weights prepared per :class:`Prep` (merged,
pre-transposed, cast, int8-quantized or packed in panels once: :mod:`.weight_prep`);
:func:`moe_forward` is the routed expert FFN.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from atbcore.backends import get_backend
from atbcore.memory import hugepages
from atbcore.ops import get_op

from .weight_prep import (ROWS_MAX, Prep, panels_enabled, rows_reason, rows_weight, w8a8_reason,
                          w8a8_weight, weight_panels)

__all__ = ["Kern", "Lin", "Norm", "Act", "Prep", "moe_forward", "detach", "ROWS_MAX"]


def detach(t: Any, dtype: torch.dtype | None = None) -> Any:
    """``t`` without autograd history (optionally cast); None stays None."""
    if t is None:
        return None
    t = t.detach()
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


class Kern:
    """The torch kernel of one atb op with params bound once: ``k(x=..., weight=...)``
    returns the kernel's output list."""

    __slots__ = ("op", "fn", "p", "names", "launches", "writes_out")

    def __init__(self, op: str, **params: Any) -> None:
        opdef = get_op(op)
        kernel = get_backend("torch").kernel(opdef.name)
        if kernel is None:  # pragma: no cover - every op used here has one
            from atbcore.errors import CapabilityError

            raise CapabilityError(op, "no torch kernel", "a registered torch kernel", "none")
        self.op, self.fn, self.launches = opdef.name, kernel.fn, kernel.launches
        # kernels declaring writes_out accept fn(params, ins, out=[...]) (planned buffers)
        self.writes_out = bool(getattr(kernel, "writes_out", False))
        self.p = opdef.make_params(params)
        self.names = opdef.input_names

    def __call__(self, out: Any = None, **ins: Any) -> list:
        """The kernel's outputs; ``out`` (a list, kernels that write into given buffers
        only) receives them where it can."""
        d = dict.fromkeys(self.names)
        d.update(ins)
        if out is not None and self.writes_out:
            return self.fn(self.p, d, out=out)
        return self.fn(self.p, d)


class Lin:
    """A (possibly merged) Linear: ``lin(x) -> [..., out]``.

    ``mode``: "dense" (weight ``[out, in]``, the model's own tensor), "t" (a merged
    ``[in, out]`` contiguous copy; :meth:`into` is one ``mm``/``addmm`` into a
    preallocated buffer), "rows" (a merged ``[out, in]`` contiguous copy: up to
    :data:`ROWS_MAX` rows run the C few-row matmul, more rows torch's GEMM on the
    transposed view; with panels, the default, the weight is kept only as
    32-output ``panels``, which the C matmul runs at any row count) or "w8" (int8 ``[out, in]`` + per-channel scale; the C
    matmul for few rows when ``rows`` is set). :attr:`kernel` names what runs."""

    def __init__(self, weights: list, biases: list, prep: Prep) -> None:
        ws = [detach(w) for w in weights]
        self.out_features = sum(w.shape[0] for w in ws)
        self.in_features = ws[0].shape[1]
        self.b = None
        if any(b is not None for b in biases):
            self.b = torch.cat([detach(b, prep.dtype) if b is not None else
                                torch.zeros(w.shape[0], dtype=prep.dtype, device=w.device)
                                for w, b in zip(ws, biases)]).to(prep.device)
        self.scale = self.scale32 = self.panels = self.w4 = self.packed = None
        self.rows_why = rows_reason(prep) if prep.fused or prep.quantize else "opt_level 0"
        if prep.quantize == "w4":
            self._init_w4(weights, ws, prep)
        elif prep.quantize == "w8a8" and not w8a8_reason(prep):
            from atbcore.ops.linear import quantize_w8

            wq, scale = quantize_w8(torch.cat(ws) if len(ws) > 1 else ws[0])
            self.packed = w8a8_weight(wq.contiguous(), prep)  # all the runner keeps
            self.w = torch.empty(wq.shape, dtype=torch.int8, device="meta")
            self.scale32 = scale.to(torch.float32).contiguous()
            self.b = None if self.b is None else self.b.to(torch.float32)
            self.mode = "w8a8"
            self.k = Kern("Linear", quant="w8", bias=self.b is not None)
        elif prep.quantize in ("w8", "w8a8"):  # w8a8 where its kernel cannot run: weight-only
            from atbcore.ops.linear import quantize_w8

            w = torch.cat(ws) if len(ws) > 1 else ws[0]
            self.w, scale = quantize_w8(w)
            self.w = self.w.to(prep.device).contiguous()
            if not self.rows_why and panels_enabled():  # the C matmul runs on panels only
                self.panels = weight_panels(self.w, prep)
                self.w = torch.empty(self.w.shape, dtype=self.w.dtype, device="meta")
            elif not self.rows_why:  # the C matmul streams it every decode step
                self.w = prep.arena.place(self.w) if prep.arena else hugepages.place(self.w)
            # bf16 activations take the int8pack kernel only with bf16 scales, and
            # torch_npu's npu_weight_quant_batchmatmul scales in x's dtype
            from atbcore.backends.npu import kernel_device

            half = prep.dtype == torch.bfloat16 or (
                prep.dtype == torch.float16 and kernel_device(prep.device.type) == "npu")
            self.scale = scale.to(prep.device, prep.dtype if half else torch.float32)
            if not self.rows_why:
                self.scale32 = scale.to(torch.float32).contiguous()
            self.mode = "w8"
            self.k = Kern("Linear", quant="w8", bias=self.b is not None)
        elif prep.fused and not self.rows_why:
            self.mode = "rows"
            self.k = Kern("Linear", bias=self.b is not None)
            if panels_enabled():
                # every call runs on the panels, so they are all the runner keeps (w:
                # the shape and dtype, a meta tensor); the model's own tensors stay
                # where they are, the model's to keep or drop
                src = (torch.cat([w.to(prep.device, prep.dtype) for w in ws]) if len(ws) > 1
                       else ws[0].to(prep.device, prep.dtype))
                self.panels = weight_panels(src, prep)
                self.w = torch.empty(src.shape, dtype=src.dtype, device="meta")
            else:
                self.w = rows_weight(ws, weights, prep)                    # [out, in]
        elif prep.fused:
            w = torch.cat(ws) if len(ws) > 1 else ws[0]
            self.w = w.to(prep.device, prep.dtype).t().contiguous()       # [in, out]
            self.mode = "t"
            self.k = Kern("Linear", transpose_weight=False, bias=self.b is not None)
        else:
            assert len(ws) == 1, "opt 0 keeps Linears separate"
            self.w = ws[0].to(prep.device, prep.dtype)
            self.mode = "dense"
            self.k = Kern("Linear", bias=self.b is not None)

    def _init_w4(self, weights: list, ws: list, prep: Prep) -> None:
        """w4: the C w4 matmul at every row count on packed 4-bit codes (:mod:`.weight_w4`),
        or, where it cannot run, the dequantized weight as a dense Linear."""
        from .weight_w4 import w4_reason, w4_weight

        self.rows_why = w4_reason(prep)
        w4 = w4_weight(weights, ws)
        self.mode = "w4"
        self.k = Kern("Linear", bias=self.b is not None)
        if self.rows_why:
            self.w = w4.dequantize(prep.dtype).to(prep.device)            # [out, in]
        else:
            self.w4 = w4
            self.w = torch.empty((w4.n, w4.k), dtype=prep.dtype, device="meta")

    @property
    def rows(self) -> bool:
        """True when few-row calls run the C matmul."""
        return self.mode in ("rows", "w8", "w4", "w8a8") and not self.rows_why

    def _few(self, x: torch.Tensor) -> bool:
        return self.rows and (self.w4 is not None or x.numel() <= ROWS_MAX * self.in_features)

    @property
    def kernel(self) -> str:
        """What runs, for explain(): few-row (decode) and many-row (prefill) kernels."""
        if self.mode == "w8a8":
            return "C w8a8 matmul (int8 rows quantized per row x int8 VNNI panels, any row count)"
        many = {"dense": "F.linear", "t": "torch.mm (pre-transposed [in, out])",
                "rows": "torch F.linear on [out, in]",
                "w8": "atb w8 Linear (int8pack / dequantize + GEMM)",
                "w4": "F.linear on the dequantized w4 weight"}[self.mode]
        dt = str(self.w.dtype).replace("torch.", "")
        if self.w4 is not None:
            return (f"C w4 matmul (4-bit codes, group {self.w4.group}, int8 activation "
                    "blocks, VNNI), any row count")
        if self.panels is not None:
            dot = ("; VDPBF16PS on bf16 rows where the CPU has it" if dt == "bfloat16" else "")
            return (f"C few-row matmul ({dt} weights, 32-output panels, <= {ROWS_MAX} rows) | "
                    f"C panel GEMM (64-row blocks{dot})")
        if self.rows:
            return f"C few-row matmul ({dt} weights, <= {ROWS_MAX} rows) | {many}"
        why = "" if self.mode == "dense" else f" (C few-row matmul: {self.rows_why})"
        return f"{many}{why}"

    def _c(self, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        """The C matmul on this Linear's weight (its panels when packed, the fp32 scale
        of int8 weights, the bias): :func:`~atbcore.backends.cpu_kernels.torch_decode.
        linear_rows` with ``kw``."""
        if self.w4 is not None:
            from atbcore.backends.cpu_kernels.torch_linear_w4 import linear_w4

            return linear_w4(x, self.w4, bias=self.b, **kw)
        if self.mode == "w8a8":
            from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8

            return linear_w8a8(x, self.packed, self.scale32, bias=self.b, **kw)
        from atbcore.backends.cpu_kernels.torch_decode import linear_rows

        return linear_rows(x, self.w, scale=self.scale32, bias=self.b, panels=self.panels, **kw)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T + b``; ``out`` (contiguous ``[..., out_features]`` in x's dtype), when
        given, receives a many-row GEMM's result (the prefill workspace), which is returned."""
        # panels, w4, w8a8: the C GEMM at any row count
        if self._few(x) or self.panels is not None or self.mode == "w8a8":
            return self._c(x, out=out)
        if (out is not None and self.mode in ("rows", "t") and x.dtype == self.w.dtype
                and (self.b is None or self.b.dtype == x.dtype)):
            x2, o2 = x.reshape(-1, self.in_features), out.view(-1, self.out_features)
            w = self.w.t() if self.mode == "rows" else self.w               # [in, out]
            if self.b is None:
                torch.mm(x2, w, out=o2)
            else:
                torch.addmm(self.b, x2, w, out=o2)
            return out
        if self.mode == "rows":
            if self.b is not None and self.b.dtype != x.dtype:
                return self.k(x=x, weight=self.w, bias=self.b)[0]
            return F.linear(x, self.w, self.b)
        return self.k(x=x, weight=self.w, bias=self.b, scale=self.scale)[0]

    def into(self, x2: torch.Tensor, out: torch.Tensor, norm: "Norm | None" = None) -> torch.Tensor:
        """``x2`` [M, in] -> ``out`` [M, out] in place (the decode fast path); with an
        RmsNorm ``norm`` the C matmul normalises the rows itself (one call, the same
        rounding as the norm kernel's stored output), else ``norm(x2)`` runs first."""
        if self._few(x2):
            if norm is not None and norm.fusable:
                return self._c(x2, out=out, rms_norm_eps=norm.eps, rms_norm_weight=norm.w)
            return self._c(x2 if norm is None else norm(x2), out=out)
        if norm is not None:
            x2 = norm(x2)
        y = self(x2, out=out)  # the GEMM writes into out where it can (no copy then)
        return y if y is out else out.copy_(y)

    def bound(self, x2: torch.Tensor, out: torch.Tensor, norm: "Norm | None" = None,
              accumulate: bool = False) -> Callable[[], None] | None:
        """:meth:`into` (or :meth:`acc` with ``accumulate``) of these fixed buffers as
        one prebuilt C call (a decode plan's); None where that cannot be (more rows
        than the C matmul takes, a norm it cannot apply itself, buffers it would have
        to copy): then call the method."""
        if not self._few(x2) or (norm is not None and (accumulate or not norm.fusable)):
            return None
        norm_kw = {"rms_norm_eps": None if norm is None else norm.eps,
                   "rms_norm_weight": None if norm is None else norm.w}
        if self.w4 is not None:
            from atbcore.backends.cpu_kernels.torch_linear_w4 import linear_w4_bound

            return linear_w4_bound(x2, self.w4, out, bias=self.b, accumulate=accumulate,
                                   **norm_kw)
        if self.mode == "w8a8":
            from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8_bound

            return linear_w8a8_bound(x2, self.packed, self.scale32, out, bias=self.b,
                                     accumulate=accumulate, **norm_kw)
        from atbcore.backends.cpu_kernels.torch_decode import linear_rows_bound

        return linear_rows_bound(x2, self.w, out, scale=self.scale32, bias=self.b,
                                 accumulate=accumulate, panels=self.panels,
                                 rms_norm_eps=None if norm is None else norm.eps,
                                 rms_norm_weight=None if norm is None else norm.w)

    def acc(self, x2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y += lin(x2)`` in place (a residual add riding in the matmul)."""
        if self._few(x2):
            return self._c(x2, out=y, accumulate=True)
        if self.mode == "t" and self.b is None:
            return y.addmm_(x2, self.w)
        return y.add_(self(x2))

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads: the panels when there are (the ``[out, in]``
        weight stays for many-row GEMMs), else the weight; and the scales."""
        if self.w4 is not None:
            return self.w4.nbytes
        w = self.packed if self.mode == "w8a8" else (self.w if self.panels is None else self.panels)
        n = w.numel() * w.element_size()
        for t in (self.scale, self.scale32):
            n += 0 if t is None else t.numel() * t.element_size()
        return n


class Norm:
    """RmsNorm / LayerNorm with its Add+Norm variant (fused at opt >= 1)."""

    def __init__(self, kind: str, w: Any, b: Any, eps: float, prep: Prep) -> None:
        self.kind = kind
        self.w = detach(w, prep.dtype)
        self.b = detach(b, prep.dtype)
        self.eps = float(eps)
        name = "RmsNorm" if kind == "rms" else "LayerNorm"
        self.k = Kern(name, eps=eps)
        self.kadd = Kern("Add" + name, eps=eps) if prep.fused else None
        self.kres = Kern("ResidualAdd")
        self.launches = self.k.launches

    @property
    def fusable(self) -> bool:
        """True when the C few-row matmul can apply this norm itself (RmsNorm)."""
        return self.kind == "rms" and (self.w is None or self.w.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rms":
            return self.k(x=x, weight=self.w)[0]
        return self.k(x=x, weight=self.w, bias=self.b)[0]

    def add(self, x: torch.Tensor, residual: torch.Tensor,
            out: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; ``out`` (two buffers, neither x nor
        residual: the prefill workspace) receives them where the fused kernel can."""
        if self.kadd is None:
            s = self.kres(x=x, residual=residual)[0]
            return self(s), s
        if self.kind == "rms":
            y, s = self.kadd(x=x, residual=residual, weight=self.w, out=out)
        else:
            y, s = self.kadd(x=x, residual=residual, weight=self.w, bias=self.b, out=out)
        return y, s


_GATED = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}


class Act:
    """The MLP activation: ``act(x)``; gated: ``act(gate) * up`` given either the
    merged ``[..., 2I]`` (gate first) or ``gate`` and ``up`` apart."""

    def __init__(self, name: str, gated: bool) -> None:
        from atbcore.errors import AtbError
        from atbcore.ops.activation import get_activation

        self.gated = gated
        self.torch_fn: Callable | None = None
        try:
            get_activation(name)
        except AtbError:  # provided by a plugin's atb_activation hook only
            from atbcore.plugin import resolve_activation

            spec = resolve_activation(name)
            if spec.torch_fn is None:
                from .arch import unsupported

                raise unsupported("hidden_act", "an activation with a torch function", name)
            self.torch_fn = spec.torch_fn
        self.k = None if self.torch_fn else Kern("Activation", activation_type=_GATED.get(name, name)
                                                   if gated and name in _GATED else name)
        self.split = gated and (self.torch_fn is not None or name not in _GATED)
        self.mul = Kern("Elewise", elewise_type="mul")

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        if self.torch_fn is not None:
            return self.torch_fn(x.float()).to(x.dtype)
        return self.k(x=x)[0]

    def __call__(self, x: torch.Tensor, up: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: a buffer the merged gated kernel may write into (the prefill
        workspace); the result is returned either way."""
        if not self.gated:
            return self._plain(x)
        if not self.split:
            return self.k(x=x, up=up, out=None if out is None else [out])[0]
        if up is None:
            x, up = x.chunk(2, dim=-1)  # [..., 2I] -> gate, up
        return self.mul(x=self._plain(x), y=up)[0]


def moe_forward(x: torch.Tensor, router: torch.Tensor, experts: list[tuple[Lin, Lin]],
                top_k: int, norm_topk: bool, act: Act) -> torch.Tensor:
    """Mixtral-style MoE on ``x`` [..., H]: router softmax in fp32 over all experts,
    top-k, optional renormalisation, weighted sum of the chosen experts' gated FFNs.
    (No MoE kernel is registered in the core yet; this is its torch form.)"""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])                                        # [T, H]
    logits = torch.mm(x2, router.t())                                    # [T, E]
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)                      # [T, k]
    if norm_topk:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x2)
    hit = torch.unique(top_i).tolist()
    for e in hit:
        rows, slot = torch.where(top_i == e)
        gu, down = experts[e]
        y = down(act(gu(x2[rows])))                                      # [n, H]
        out.index_add_(0, rows, (y * top_w[rows, slot, None]).to(out.dtype))
    return out.reshape(shape)
