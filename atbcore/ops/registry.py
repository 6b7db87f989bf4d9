"""The op registry: ops register themselves by name; aliases resolve case-insensitively."""

from __future__ import annotations

import importlib
import pkgutil
from typing import TypeVar

from ..errors import ParamsError
from .base import OpDef

__all__ = ["register_op", "get_op", "list_operations", "all_ops", "load_builtin_ops"]

_OPS: dict[str, OpDef] = {}
_LOOKUP: dict[str, str] = {}
_loaded = False

T = TypeVar("T", bound=type)


def register_op(cls: T) -> T:
    """Class decorator: instantiate and register an :class:`OpDef` subclass."""
    inst = cls()
    if not inst.name:
        raise ValueError(f"{cls.__name__} has no name")
    for key in (inst.name, *inst.aliases):
        k = key.lower()
        if k in _LOOKUP and _LOOKUP[k] != inst.name:
            raise ValueError(f"op name {key!r} registered twice ({_LOOKUP[k]} and {inst.name})")
        _LOOKUP[k] = inst.name
    owner = inst.Params.__dict__.get("OP")
    if owner is not None and owner != inst.name and owner in _OPS:
        # Params shared with another op (AddRmsNorm reuses RmsNorm's): give this op its
        # own subclass so errors name the op that was built and params of the two ops
        # never compare equal.
        base = inst.Params
        inst.Params = type(f"{cls.__name__}Params", (base,), {"__doc__": base.__doc__})
        type(inst).Params = inst.Params
    inst.Params.OP = inst.name
    _OPS[inst.name] = inst
    return cls


def load_builtin_ops() -> None:
    """Import every module of ``atbcore.ops`` so their ops register (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import __path__ as ops_path

    for mod in sorted(pkgutil.iter_modules(ops_path), key=lambda m: m.name):
        if mod.name not in ("base", "registry", "samples"):
            importlib.import_module(f"{__package__}.{mod.name}")


def get_op(name: str) -> OpDef:
    """The op registered under ``name`` or one of its aliases."""
    load_builtin_ops()
    key = _LOOKUP.get(str(name).lower())
    if key is None:
        raise ParamsError("Builder", "unknown operation", f"one of {list_operations()}", repr(name))
    return _OPS[key]


def list_operations() -> list[str]:
    """Canonical names of every registered op, sorted."""
    load_builtin_ops()
    return sorted(_OPS)


def all_ops() -> dict[str, OpDef]:
    load_builtin_ops()
    return dict(_OPS)


def aliases_of(name: str) -> list[str]:
    """The aliases an op was registered with, as spelled there."""
    return list(get_op(name).aliases)
