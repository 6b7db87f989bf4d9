"""Torch kernel of UnpadFlashAttention: on the CPU the C prefill attention over the
packed sequences as they lie (one call for every sequence and head, q/k/v read as
views of the packed QKV rows, fp32 softmax, one rounding into the output); else
:func:`.attention.sdpa_attention` per sequence (fp32 compute).

The bound form reads ``seq_lens`` once per run (a ``[B]`` host read) and writes the
planned output buffer; nothing else is looked up per call."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...dtypes import Dtype
from ...ops.attention_unpad import unpad_geometry
from ...runtime.binding import getter
from ...tensor import TensorDesc
from ..cpu_kernels import torch_ops as ck
from . import kernel
from .attention import sdpa_attention

__all__: list[str] = []


def _views(qkv: torch.Tensor, h: int, hkv: int, d: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k/v [T, Hkv, D]: views of the packed rows."""
    t = qkv.shape[0]
    q = qkv[:, :h * d].view(t, h, d) if qkv.is_contiguous() else qkv[:, :h * d].reshape(t, h, d)
    k = qkv[:, h * d:(h + hkv) * d].unflatten(1, (hkv, d))
    v = qkv[:, (h + hkv) * d:].unflatten(1, (hkv, d))
    return q, k, v


def _why_not_c(qkv: torch.Tensor, d: int) -> str | None:
    from ..cpu_kernels.torch_prefill import MAX_HEAD_DIM

    why = ck.why_not(qkv)
    if why:
        return why
    if qkv.stride(-1) != 1:
        return "qkv has a strided last dim"
    if d > MAX_HEAD_DIM:
        return f"head_dim {d} > {MAX_HEAD_DIM}"
    return None


def _run(p: Any, qkv: torch.Tensor, lens: list[int], out: torch.Tensor | None
         ) -> torch.Tensor:
    h, hkv, d = unpad_geometry("UnpadFlashAttention", p, TensorDesc.of(qkv),
                               TensorDesc((len(lens),), Dtype.INT64))
    scale = p.scale if p.scale is not None else d ** -0.5
    t = qkv.shape[0]
    given = out
    if out is None or not out.is_contiguous() or out.dtype != qkv.dtype or \
            tuple(out.shape) != (t, h * d) or out.device != qkv.device:
        out = torch.empty(t, h * d, dtype=qkv.dtype, device=qkv.device)
    q, k, v = _views(qkv, h, hkv, d)
    why = _why_not_c(qkv, d) if qkv.is_cpu else "not on the CPU"
    if why is None:
        from ..cpu_kernels.torch_prefill import prefill_attention

        prefill_attention(q, k, v, scale=scale, q_lens=lens, causal=p.causal,
                          out=out.view(t, h, d))
        return ck.into([given], 0, out) if given is not None else out
    ck.log_fallback("UnpadFlashAttention", why)
    start = 0
    for n in lens:                                                       # [n, heads, D] -> [1, heads, n, D]
        if n:
            sl = slice(start, start + n)
            o = sdpa_attention(q[sl].transpose(0, 1)[None].float(), k[sl].transpose(0, 1)[None].float(),
                               v[sl].transpose(0, 1)[None].float(), scale=scale, causal=p.causal)
            out[sl] = o[0].transpose(0, 1).reshape(n, h * d).to(out.dtype)
        start += n
    return ck.into([given], 0, out) if given is not None else out


def _lens(seq_lens: torch.Tensor) -> list[int]:
    return [int(n) for n in seq_lens.tolist()]


def _bind(p: Any, ins: dict[str, Any], outs: list, ctx: Any) -> Callable[[list], None] | None:
    """The call with its output (and weights) fixed: seq_lens read per run."""
    get_qkv, get_lens = getter(ins["qkv"]), getter(ins["seq_lens"])
    get_out = getter(outs[0])

    def call(env: list) -> None:
        _run(p, get_qkv(env), _lens(get_lens(env)), get_out(env))
    return call


@kernel("UnpadFlashAttention", impl="C prefill attention over the packed sequences (CPU); "
        "else torch scaled_dot_product_attention per sequence (fp32 compute)",
        # the composite's count is per sequence (3 finiteness sums, SDPA, the copy out);
        # declared for one
        launches=ck.c_launches(5), writes_out=True, bind=_bind)
def unpad_flash_attention(p, ins, out=None):
    return [_run(p, ins["qkv"], _lens(ins["seq_lens"]), ck.out_at(out, 0))]
