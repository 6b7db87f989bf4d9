"""How a runner's Linear weights are prepared: :class:`Prep` (opt level, dtype,
quantization, whether the C few-row matmul runs them) and the layouts the C matmul
streams, the ``[out, in]`` rows on huge pages or the 32-output panels
(:func:`atbcore.backends.cpu_kernels.torch_decode.pack_panels`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from atbcore.memory import hugepages

__all__ = ["Prep", "ROWS_MAX", "panels_enabled", "rows_reason", "rows_weight", "weight_panels",
           "w8a8_reason", "w8a8_weight"]


@dataclass(frozen=True)
class Prep:
    """How weights are prepared: ``opt_level`` (0 = unfused, model weights as they
    are), compute ``dtype``, ``quantize`` (None | "w8" | "w4" | "w8a8"), ``device``; ``rows_kernel``:
    decoding calls the Linears with a few rows, so prepare the weights for the C
    matmul (:mod:`atbcore.backends.cpu_kernels`) where it runs: panels, or
    ``[out, in]`` rows with ``ATB_PANELS=0``;
    ``arena``: the runner's :class:`atbcore.memory.hugepages.Arena` those weights are
    packed into (None: each on its own)."""

    opt_level: int
    dtype: torch.dtype
    quantize: str | None = None
    device: torch.device = torch.device("cpu")
    rows_kernel: bool = False
    arena: Any = None

    @property
    def fused(self) -> bool:
        return self.opt_level >= 1


# Row counts up to which the C few-row matmul runs instead of torch's GEMM (steps
# that use it park torch's pool: see cpu_kernels.threads.parked_torch_threads). Measured here
# (2 cores, fp32, default model shapes, C vs F.linear): 32000x512 LM head 3.0 vs
# 11.2 ms at 4 rows, 5.3 vs 11.9 at 16, 8.7 vs 15.4 at 32; 2752x512 gate/up 0.11
# vs 0.32 ms at 4 rows, 0.30 vs 0.41 at 16, 0.60 vs 0.67 at 32 (the 4 x 4 tiles
# of more than 4 rows are compute bound). C was still ahead at 64 rows (LM head
# 15.1 vs 26.1 ms), but the margin shrinks with rows; 32 covers the engine's default
# batch of decode rows, and prefills of more tokens take torch's blocked GEMM (or,
# with panels, the C panel GEMM on torch's OpenMP team, unparked).
ROWS_MAX = 32


def rows_reason(prep: Prep) -> str:
    """Why the C few-row matmul cannot serve these Linears ('' = it can)."""
    if not prep.rows_kernel:
        return "not a decoder"
    if prep.device.type != "cpu":
        return f"C kernels run on the CPU, not {prep.device.type}"
    if prep.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {prep.dtype}"
    from atbcore.backends.cpu_kernels import unavailable_reason

    return unavailable_reason() or ""


def rows_weight(ws: list, params: list, prep: Prep) -> torch.Tensor:
    """The ``[out, in]`` weight the C few-row matmul streams every decode step, on huge
    pages (:mod:`atbcore.memory.hugepages`): a merged one is built in the runner's
    arena, as is a small one converted to the compute dtype; a model parameter of a
    huge page or more already in that dtype moves to its own huge pages itself (its
    ``.data``), so the model and the runner keep sharing one copy (a smaller one stays
    where it is: copying it would keep two)."""
    arena = prep.arena
    if len(ws) > 1:
        rows = sum(w.shape[0] for w in ws)
        shape = (rows, ws[0].shape[1])
        out = arena.empty(shape, prep.dtype) if arena else hugepages.empty(shape, prep.dtype)
        return torch.cat([w.to(prep.dtype) for w in ws], out=out)
    w = ws[0].to(prep.device, prep.dtype).contiguous()
    p = params[0]
    shared = (isinstance(p, torch.nn.Parameter) and p.data_ptr() == w.data_ptr()
              and p.shape == w.shape and p.dtype == w.dtype and p.is_contiguous())
    if w.numel() * w.element_size() < hugepages.HUGE:  # a copy made anyway joins the arena
        return arena.place(w) if arena and not shared else w
    placed = hugepages.place(w)
    if placed is not w and shared:
        p.data = placed  # the model's own tensor moves: no second copy stays behind
    return placed


def panels_enabled() -> bool:
    """Whether decode weights are packed in panels (``ATB_PANELS=0``: no)."""
    return os.environ.get("ATB_PANELS", "1") != "0"


def weight_panels(w: torch.Tensor, prep: Prep) -> torch.Tensor:
    """The ``[out, in]`` weight ``w`` packed in 32-output panels for the C
    matmul (:func:`atbcore.backends.cpu_kernels.torch_decode.pack_panels`), on huge
    pages in the runner's arena: each activation element is broadcast against a panel
    row, with no horizontal sums and the panel read sequentially (16 rows, the default
    model's decode weights: 9.1 -> 6.9 ms per step; 1 row 4.9 -> 4.7), and prefill
    GEMMs run on them too (4224 rows: 205-226 GF/s against MKL's 173-199 here). The
    runner keeps the panels only (a model parameter stays the model's: while the
    model lives its panels are a second copy). ``ATB_PANELS=0`` keeps the
    ``[out, in]`` rows instead."""
    from atbcore.backends.cpu_kernels.torch_decode import PANEL, pack_panels

    shape = (-(-w.shape[0] // PANEL), w.shape[1], PANEL)
    out = prep.arena.empty(shape, w.dtype) if prep.arena else hugepages.empty(shape, w.dtype)
    return pack_panels(w, out=out)


def w8a8_reason(prep: Prep) -> str:
    """Why the w8a8 C matmul (int8 activations quantized per row x int8 weights) cannot
    run these Linears ('' = it can; then every call of theirs runs it, at any row
    count, decoders and encoders alike)."""
    if prep.device.type != "cpu":
        return f"C kernels run on the CPU, not {prep.device.type}"
    if prep.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {prep.dtype}"
    from atbcore.backends.cpu_kernels import unavailable_reason

    return unavailable_reason() or ""


def w8a8_weight(wq: torch.Tensor, prep: Prep) -> torch.Tensor:
    """The int8 ``[out, in]`` weight ``wq`` in the w8a8 kernel's VNNI panels
    (:func:`atbcore.backends.cpu_kernels.torch_w8a8.pack_w8a8`), on huge pages in the
    runner's arena: the only copy the runner keeps."""
    from atbcore.backends.cpu_kernels.torch_w8a8 import pack_w8a8, w8a8_shape

    shape = w8a8_shape(*wq.shape)
    out = (prep.arena.empty(shape, torch.int8) if prep.arena
           else hugepages.empty(shape, torch.int8))
    return pack_w8a8(wq, out=out)
