"""Fusions a device's kernels do better without: the pass pipeline asks here.

A fusion rule makes one node of several because some kernel runs them as one; on a
device whose kernels fuse *other* neighbours, the rule costs more than it saves.
On an Ascend NPU, torch_npu has no GEMM epilogue and no norm inside a matmul, but
it has ``npu_add_rms_norm``: a residual add folded into the preceding Linear or FFN
(``linear_residual``, ``ffn_residual``) leaves the following RmsNorm alone, so the
add and the norm run as three calls (matmul, add, norm) where the unfused graph's
``add_rmsnorm`` makes them two (matmul, add+norm). Such a device registers, per rule,
why it keeps the nodes apart; :func:`unfused_rules` answers for a device type, and
the GraphOp turns those rules off for graphs whose inputs live there (the report
names each, see ``explain()``).

    prefer_unfused("npu", "linear_residual", "npu_add_rms_norm fuses the add with the norm")
    unfused_rules("npu")  # {"linear_residual": "npu_add_rms_norm fuses ..."}
"""

from __future__ import annotations

__all__ = ["prefer_unfused", "unfused_rules"]

# kernel device type -> {fusion rule name: why that device's kernels run it unfused}
_UNFUSED: dict[str, dict[str, str]] = {}


def prefer_unfused(device: str, rule: str, why: str) -> None:
    """Register that graphs on ``device`` (a kernel device type) keep ``rule`` off."""
    _UNFUSED.setdefault(device, {})[rule] = why


def unfused_rules(device: str) -> dict[str, str]:
    """The rules graphs on ``device`` keep off, each with the reason (empty: none)."""
    return dict(_UNFUSED.get(device, {}))
