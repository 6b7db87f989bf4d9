"""Torch kernels for the activation ops.

On the CPU the built-in activations (gelu, gelu_tanh, quick_gelu, silu/swish,
relu and the gated swiglu / geglu / geglu_tanh, split ``[..., 2n]`` or with a
separate ``up``) run as one C kernel: fp32 math, one rounding, written into a
planned ``out`` buffer when given. Activations a plugin registered (or
replaced) have no C kernel: the registry's torch function runs on fp32 (half
types upcast once, rounded once), as it does on CUDA; the fallback is logged.
"""

from __future__ import annotations

from typing import Any, Callable

from ...ops import activation_fns as _acts
from ...ops.activation import ActivationFn, get_activation
from ...runtime.native_run import native_call
from ..cpu_kernels import torch_ops as ck
from . import kernel

__all__ = ["c_activation"]

# the built-in torch functions -> the C kernel's activation name
_ELEMENTWISE = {_acts._t_gelu: "gelu", _acts._t_gelu_tanh: "gelu_tanh",
                _acts._t_quick_gelu: "quick_gelu", _acts._t_silu: "silu", _acts._t_relu: "relu"}


def _gated_base(act: ActivationFn) -> ActivationFn | None:
    """The elementwise entry a built-in gated entry wraps (``base(gate) * up``)."""
    pair = act.torch_pair
    if pair is None or pair.__qualname__ != "_register_gated.<locals>.<lambda>":
        return None
    for cell in pair.__closure__ or ():
        if isinstance(cell.cell_contents, ActivationFn):
            return cell.cell_contents
    return None


def c_activation(act: ActivationFn) -> tuple[str | None, str]:
    """(C activation name, '') when the C kernel computes ``act``, else (None, why).

    Only the built-in formulas qualify: a plugin that re-registers a name must
    see its own function run. Memoised per registry entry (entries are immutable)."""
    hit = _NAMES.get(id(act))
    if hit is not None and hit[0] is act:
        return hit[1]
    res = _c_activation(act)
    _NAMES[id(act)] = (act, res)
    return res


_NAMES: dict[int, tuple[ActivationFn, tuple[str | None, str]]] = {}


def _c_activation(act: ActivationFn) -> tuple[str | None, str]:
    base = _gated_base(act) if act.gated else act
    name = None if base is None else _ELEMENTWISE.get(base.torch_fn)
    if name is None:
        return None, f"activation {act.name!r} is not a built-in formula"
    return name, ""


def _make(op: str) -> Callable[..., list]:
    def run(p: Any, ins: dict, out: list | None = None) -> list:
        x, up = ins["x"], ins.get("up")
        act = get_activation(p.activation_name(), op)
        name, why = c_activation(act)
        why = why or ck.why_not(x, up)
        if not why:
            if act.gated:
                y = ck.activation(x, name, up=up, split=up is None, out=ck.out_at(out, 0))
            else:
                y = ck.activation(x, name, out=ck.out_at(out, 0))
            return [y]
        ck.log_fallback(op, why)
        y = act.torch(x.float(), None if up is None else up.float())
        return [ck.into(out, 0, y.to(x.dtype))]

    run.__qualname__ = f"activation_{op}"
    return run


def _binder(op: str) -> Callable[..., Any]:
    """A plan's binder: with fixed CPU buffers (the planned intermediates of a decode
    step) one C call with its arguments packed once; None (the kernel's ``fn`` runs)
    for inputs that change per run, plugin activations or other devices."""
    def bind(p: Any, ins: dict, outs: list, ctx: Any) -> Callable[[list], None] | None:
        from ...runtime.binding import Slot

        x, up, y = ins["x"], ins.get("up"), outs[0]
        if Slot in (type(x), type(up), type(y)) or ck.why_not(x, up):
            return None
        act = get_activation(p.activation_name(), op)
        name, why = c_activation(act)
        if why:
            return None
        call = ck.activation_bound(x, name, y, up=up, split=act.gated and up is None)
        return None if call is None else native_call(lambda env: call())
    return bind


# (op, launches of the fp32 torch composite): QuickGelu is mul, sigmoid, mul; the
# gated ones act(gate) then a multiply (Activation is counted for swiglu)
for _op, _composite in (("Gelu", 1), ("QuickGelu", 3), ("SiLU", 1), ("Relu", 1), ("SwiGLU", 2),
                        ("GeGLU", 2), ("Activation", 2)):
    kernel(_op, impl="C activation, one kernel (CPU built-ins); else the registry torch fn "
           "(fp32 compute)", launches=ck.c_launches(_composite), writes_out=True,
           bind=_binder(_op))(_make(_op))
