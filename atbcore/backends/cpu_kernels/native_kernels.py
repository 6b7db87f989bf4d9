"""atb ops as C kernels for any framework's CPU tensors (NumPy, MindSpore, Paddle).

:func:`native_kernels` wraps a backend's kernels: each wrapped op runs the C kernel
through :mod:`.native_ops` when the call suits it (CPU, fp32/bf16/fp16, contiguous,
a built-in activation, ...) and the backend's own kernel otherwise, saying why at
DEBUG. The framework comes in as a :class:`TensorIO` — how to read a tensor's
address and allocate one — so one implementation serves every framework::

    MS_KERNELS.update(native_kernels(MindSporeIO(), MS_KERNELS))

A plan binds a wrapped kernel once (``Kernel.bind``): weights and planned buffers
have their addresses packed then; per run only the inputs and outputs that change
(plan slots) have their addresses read, and outputs are allocated by the framework.
A Split of a planned buffer (which the memory planner treats as a view of it) binds
its parts once: views of that buffer where they are contiguous in it, else buffers
of the bound call's own that each run copies into; so the ops reading the parts
bind to fixed tensors too.
The op-specific parts live in :mod:`.native_specs`.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from typing import Any, Callable, Mapping

import numpy as np

from ...dtypes import Dtype
from ...errors import InputError
from ...log import logger
from ..base import Kernel
from .bindings import unavailable_reason
from .native_layout import is_packed, packed_view, plain_ins
from .native import NativeView, array_view, contiguous_strides, view_of
from .native_ops import Ref, TableTooShort, compile_steps

__all__ = ["TensorIO", "NumpyIO", "native_kernels", "why_not_native", "native_off"]

_OFF = [0]


class native_off:
    """``with native_off(): ...`` runs the wrapped kernels' framework paths (plans
    built meanwhile bind no C calls): to test those paths, or to compare."""

    def __enter__(self) -> "native_off":
        _OFF[0] += 1
        return self

    def __exit__(self, *exc: object) -> None:
        _OFF[0] -= 1


class TensorIO:
    """One framework's CPU tensors as the C kernels need them (subclass per framework)."""

    name = "numpy"

    def view(self, t: Any) -> NativeView:
        """The tensor's view (checked: a CPU tensor)."""
        raise NotImplementedError

    def address(self, t: Any) -> int:
        """The address of element 0 (the hot path: attribute reads only)."""
        raise NotImplementedError

    def is_contiguous(self, t: Any) -> bool:
        raise NotImplementedError

    def contiguous(self, t: Any) -> Any:
        """A contiguous copy of ``t`` in the framework."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: Dtype) -> Any:
        """A new uninitialised CPU tensor."""
        raise NotImplementedError

    def wrap(self, a: np.ndarray) -> Any:
        """A tensor of the framework sharing the memory of the contiguous array ``a``,
        or None where it cannot share it."""
        from ...tensor import convert

        return convert(a, self.name)

    def why_not(self, t: Any) -> str | None:
        """Why the C kernels cannot read ``t`` in place (None = they can)."""
        raise NotImplementedError

    def note(self, op: str, path: str) -> None:
        """Record that ``op`` ran ``path`` (a backend's record of its paths)."""


class MethodsIO(TensorIO):
    """Tensors with ``data_ptr()``, ``is_contiguous()`` and ``contiguous()`` whose
    :func:`~.native.view_of` view is exact (Paddle, MindSpore): subclasses give
    ``name``, ``empty`` and ``why_not``."""

    def view(self, t: Any) -> NativeView:
        return view_of(t)

    def address(self, t: Any) -> int:
        return t.data_ptr()

    def is_contiguous(self, t: Any) -> bool:
        return t.is_contiguous()

    def contiguous(self, t: Any) -> Any:
        return t.contiguous()


class NumpyIO(TensorIO):
    """NumPy arrays (through the array interface)."""

    name = "numpy"

    def view(self, t: Any) -> NativeView:
        return array_view(t)

    def address(self, t: Any) -> int:
        return t.__array_interface__["data"][0]

    def is_contiguous(self, t: Any) -> bool:
        return t.flags.c_contiguous

    def contiguous(self, t: Any) -> Any:
        return np.ascontiguousarray(t)

    def empty(self, shape: tuple[int, ...], dtype: Dtype) -> Any:
        return np.empty(shape, dtype.numpy)

    def wrap(self, a: np.ndarray) -> Any:
        return a

    def why_not(self, t: Any) -> str | None:
        if not isinstance(t, np.ndarray):
            return f"not a NumPy array ({type(t).__name__})"
        if not t.flags.c_contiguous:
            return "a non-contiguous array"
        if not t.flags.aligned:
            return "an unaligned array"
        if not t.dtype.isnative:
            return "a byte-swapped array"
        return None


def why_not_native(io: TensorIO, ins: Mapping[str, Any]) -> str | None:
    """Why the C kernels cannot take these tensors at all (None = they can)."""
    why = "turned off (native_off)" if _OFF[0] else unavailable_reason()
    if why:
        return why
    for name, t in ins.items():
        if t is None:
            continue
        if isinstance(t, list):
            return f"input {name!r} is a list"
        why = io.why_not(t)
        if why:
            return f"input {name!r}: {why}"
    return None


_LOGGED: set[tuple[str, str, str]] = set()


def _fallback(io: TensorIO, op: str, why: str) -> None:
    key = (io.name, op, why)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.debug("%s [%s]: C kernel skipped (%s) -> the framework's kernel", op, io.name,
                     why)


def native_kernels(io: TensorIO, base: Mapping[str, Kernel]) -> dict[str, Kernel]:
    """The kernels of ``base`` that have a C form, wrapped (see the module doc)."""
    from .native_specs import SPECS

    out = {}
    for op, spec in SPECS.items():
        k = base.get(op)
        if k is not None:
            out[op] = _wrap(io, op, spec, k)
    return out


def _wrap(io: TensorIO, op: str, spec: Any, k: Kernel) -> Kernel:
    fallback = k.fn

    def fn(p: Any, ins: Mapping[str, Any]) -> list:
        packed = {n: packed_view(t) for n, t in ins.items() if is_packed(t)}
        why = why_not_native(io, {n: t for n, t in ins.items() if n not in packed})
        views: dict[str, NativeView] = {}
        if not why and None in packed.values():
            why = "a weight packed in a layout the C kernel does not read"
        if not why:
            views = {n: packed[n] if n in packed else io.view(t) for n, t in ins.items()
                     if t is not None}
            why = spec.why_not(p, views)
        if why:
            _fallback(io, op, why)
            return fallback(p, plain_ins(ins, io.name) if packed else ins)
        io.note(op, path)
        inplace = getattr(spec, "inplace", ())
        # an output named by a string is that input, written in place
        outs = [ins[n] for n in inplace] or [ins[o] if isinstance(o, str) else io.empty(*o)
                                              for o in spec.outputs(p, views)]
        ws = None
        nbytes = spec.workspace(p, {n: v.shape for n, v in views.items()})
        if nbytes:
            ws = np.empty(nbytes, np.uint8)
            views["<workspace>"] = array_view(ws)
        out_views = [io.view(o) for o in outs]
        try:
            compile_steps(spec.steps(p, views, out_views))({})
        except TableTooShort as e:  # atb's RoPE table grows to the positions asked for
            if e.need > spec.max_table_len:
                _fallback(io, op, f"a position past {spec.max_table_len}")
                return fallback(p, ins)
            compile_steps(spec.steps(p, views, out_views, table_len=e.need))({})
        del ws
        return outs

    path = f"C kernel atb_{spec.entry} ({io.name} tensors in place)"
    fn.__qualname__ = f"native_{op}"
    fn.takes_packed = True  # type: ignore[attr-defined]  # a layout pass's panels, as they are
    bind = _binder(io, op, spec)
    workspace = None
    if spec.has_workspace:
        workspace = lambda p, shapes: spec.workspace(p, shapes)  # noqa: E731
    return replace(k, fn=fn, impl=f"C kernel (atb {spec.entry}, {io.name} tensors in place) "
                   f"where it fits, else {k.impl}", bind=bind, workspace=workspace,
                   launches=spec.launches, writes_out=False)


def _slot_view(key: str, desc: Any) -> NativeView:
    shape = tuple(int(d) for d in desc.shape)
    return NativeView(Ref(key), shape, contiguous_strides(shape), desc.dtype)


def _binder(io: TensorIO, op: str, spec: Any) -> Callable[..., Any]:
    from ...runtime.binding import Slot

    def bind(p: Any, ins: Mapping[str, Any], outs: list, ctx: Any
             ) -> Callable[[list], None] | None:
        if _OFF[0] or getattr(spec, "inplace", ()):
            return None  # in-place ops run their fn (the plan's generic call)
        if hasattr(spec, "parts_in_place"):
            call = _bind_parts(io, op, p, spec, ins, outs)
            if call is not None:
                return call
        views: dict[str, NativeView] = {}
        dyn_in: list[tuple[str, int]] = []
        for name, v in ins.items():
            if v is None:
                continue
            if type(v) is Slot:
                if not v.desc.device.startswith("cpu"):
                    return None
                views[name] = _slot_view(name, v.desc)
                dyn_in.append((name, v.index))
            elif is_packed(v):
                pv = packed_view(v)
                if pv is None:
                    return None
                views[name] = pv
            elif type(v) is list or why_not_native(io, {name: v}):
                return None
            else:
                views[name] = io.view(v)
        if spec.why_not(p, views):
            return None
        out_views, dyn_out, aliases = [], [], []
        named = spec.outputs(p, views) if getattr(spec, "in_place_outputs", False) else ()
        for i, o in enumerate(outs):
            if i < len(named) and isinstance(named[i], str):  # input named[i], in place
                src = ins[named[i]]
                if type(o) is not Slot:
                    return None
                aliases.append((o.index, src.index if type(src) is Slot else None, src))
                out_views.append(views[named[i]])
            elif type(o) is Slot:
                key = f"<out{i}>"
                out_views.append(_slot_view(key, o.desc))
                dyn_out.append((key, o.index, tuple(o.desc.shape), o.desc.dtype))
            elif why_not_native(io, {"out": o}):
                return None
            else:
                out_views.append(io.view(o))
        nbytes = spec.workspace(p, {n: v.shape for n, v in views.items()})
        keep: Any = None
        if nbytes:
            ws = ctx.workspace
            if ws is None or why_not_native(io, {"workspace": ws}):
                ws = keep = np.empty(nbytes, np.uint8)  # no arena: the call's own scratch
                views["<workspace>"] = array_view(ws)
            else:
                views["<workspace>"] = io.view(ws)
        runs = [compile_steps(spec.steps(p, views, out_views))]
        io.note(op, f"C kernel atb_{spec.entry} ({io.name} tensors in place), bound")
        fixed = [v.owner for v in views.values()] + [v.owner for v in out_views]

        def run(addrs: Mapping[str, int]) -> None:
            try:
                runs[-1](addrs)
            except TableTooShort as e:  # grow atb's RoPE table once, then keep it
                if e.need > spec.max_table_len:
                    raise InputError(op, "position_ids values", f"< {spec.max_table_len}",
                                     e.need - 1) from None
                runs.append(compile_steps(spec.steps(p, views, out_views, table_len=e.need)))
                runs[-1](addrs)
        return _bound_call(io, run, tuple(dyn_in), tuple(dyn_out), (keep, fixed),
                           tuple(aliases))

    bind.fills_slots = True  # type: ignore[attr-defined]  # it allocates its slot outputs
    bind.takes_packed = True  # type: ignore[attr-defined]  # None where it cannot read them
    return bind


def _array_at(address: int, shape: tuple[int, ...], dtype: Dtype) -> np.ndarray:
    """A NumPy array over ``address`` (the caller keeps the memory alive)."""
    n = max(1, int(np.prod(shape, dtype=np.int64))) * dtype.itemsize
    raw = np.frombuffer((ctypes.c_uint8 * n).from_address(address), np.uint8)
    return raw.view(dtype.numpy).reshape(shape)


def _bind_parts(io: TensorIO, op: str, p: Any, spec: Any, ins: Mapping[str, Any],
                outs: list) -> Callable[[list], None] | None:
    """A Split of a planned buffer ``x`` with its parts bound once (see the module
    doc). None for an ``x`` in a slot (an input or output of the graph, whose parts
    may be graph outputs and must be fresh per run): the general binding runs it."""
    from ...runtime.binding import Slot

    x = ins.get("x")
    if x is None or type(x) is Slot or any(type(o) is not Slot for o in outs) or \
            why_not_native(io, {"x": x}):
        return None
    xv = io.view(x)
    if spec.why_not(p, {"x": xv}):
        return None
    cuts = spec.parts_in_place(p, xv)
    if cuts is not None:  # views: nothing to run
        parts = [io.wrap(_array_at(xv.address + off, shape, xv.dtype)) for off, shape in cuts]
        run = None
    else:
        parts = [io.empty(shape, dtype) for shape, dtype in spec.outputs(p, {"x": xv})]
        run = compile_steps(spec.steps(p, {"x": xv}, [io.view(t) for t in parts]))
    if any(t is None for t in parts):
        return None
    pairs = [(o.index, t) for o, t in zip(outs, parts)]
    io.note(op, f"{op} parts bound once ({io.name} tensors): "
            + ("views of the planned input" if run is None else "copies into bound parts"))

    def call(env: list) -> None:
        if run is not None:
            run({})
        for j, t in pairs:
            env[j] = t
    call.fixed_out = parts  # type: ignore[attr-defined]  # readers bind to the parts
    call.keep = (x, xv.owner)  # type: ignore[attr-defined]  # the memory the views are of
    return call


def _bound_call(io: TensorIO, run: Callable[[Mapping[str, int]], None], dyn_in: tuple,
                dyn_out: tuple, keep: Any, aliases: tuple = ()) -> Callable[[list], None]:
    address, is_contiguous, empty = io.address, io.is_contiguous, io.empty

    def call(env: list) -> None:
        addrs: dict[str, int] = {}
        held = []
        for key, i in dyn_in:
            t = env[i]
            if not is_contiguous(t):
                t = io.contiguous(t)   # one copy; the C kernel reads rows in place
                held.append(t)
            addrs[key] = address(t)
        for key, i, shape, dtype in dyn_out:
            t = env[i] = empty(shape, dtype)
            addrs[key] = address(t)
        run(addrs)
        for out, src, tensor in aliases:  # outputs that are inputs written in place
            env[out] = env[src] if src is not None else tensor
        del held
    call.keep = keep  # type: ignore[attr-defined]  # bound buffers live with the call
    return call
