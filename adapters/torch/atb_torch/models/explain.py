"""What a :class:`.runner.ModelRunner` runs, as text (:func:`explain_runner`): each
Linear's kernels and weight layout (the few-row decode matmul and the many-row
prefill GEMM, chosen per dtype and measured in ``benchmarks/``), the attention
kernels and the bytes a decode step reads."""

from __future__ import annotations

from typing import Any

from .kernels import Lin

__all__ = ["explain_runner"]

_LINEARS = ("qkv", "q", "k", "v", "o", "gate_up", "gate", "up", "down")


def _attention(runner: Any) -> str:
    from atbcore.backends.cpu_kernels import unavailable_reason

    if runner.device.type != "cpu":
        return f"torch SDPA / PagedAttention kernels on {runner.device.type}"
    why = unavailable_reason()
    if why:
        return f"torch SDPA (C kernels: {why})"
    return ("prefill: C prefill attention (packed sequences, one call per layer); decode: "
            "C one-token attention over the cache (paged blocks read in place)")


def explain_runner(runner: Any) -> str:
    """One line per distinct Linear of the first block (the others match it) and the
    LM head: shape ``[out x in]``, then what runs for few rows | many rows."""
    s = runner.spec
    lines = [f"{s.arch}: {s.num_layers} layers, {str(runner.dtype).replace('torch.', '')}, "
             f"opt_level {runner.opt_level}, quantize {runner.quantize or 'none'}, "
             f"{runner.device.type}"]
    blk = runner.blocks[0] if runner.blocks else None
    lins = [(n, getattr(blk, n, None)) for n in _LINEARS] + [("lm_head", runner.lm_head)]
    for name, lin in lins:
        if isinstance(lin, Lin):
            lines.append(f"  {name:<8} [{lin.out_features} x {lin.in_features}]  {lin.kernel}")
    if blk is not None and getattr(blk, "experts", None):
        e = blk.experts[0][0]
        lines.append(f"  experts  {len(blk.experts)} x [{e.out_features} x {e.in_features}]  "
                     f"{e.kernel}")
    lines.append(f"  attention: {_attention(runner)}")
    if s.kind == "decoder":
        lines.append(f"  weights read per decode step: {runner.weight_bytes / 2**20:.1f} MiB")
    return "\n".join(lines)
