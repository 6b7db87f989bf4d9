"""The error hierarchy every front-end re-exports.

Every failure a user can cause raises an :class:`AtbError` subclass whose message
names the op or graph node, what was expected and what was given, e.g.::

    RmsNorm: input 'weight' shape: expected [769], given [768]
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AtbError",
    "ShapeError",
    "DtypeError",
    "DeviceError",
    "ParamsError",
    "InputError",
    "CapabilityError",
    "GraphError",
    "PoolExhaustedError",
    "MemoryError_",
    "PluginError",
]


class AtbError(Exception):
    """Base class of every error atb raises for a user-caused failure.

    Attributes ``op`` (the op or node name), ``expected`` and ``given`` are kept
    so that tools can show them apart from the message.
    """

    def __init__(self, op: str, what: str, expected: Any = None, given: Any = None) -> None:
        self.op = op
        self.what = what
        self.expected = expected
        self.given = given
        msg = f"{op}: {what}"
        if expected is not None or given is not None:
            msg += f": expected {expected}, given {given}"
        super().__init__(msg)


class ShapeError(AtbError):
    """A tensor's rank or shape does not fit the op."""


class DtypeError(AtbError):
    """A tensor's dtype does not fit the op."""


class DeviceError(AtbError):
    """A tensor lives on a device the op or backend cannot use."""


class ParamsError(AtbError):
    """An op's parameters are invalid (unknown name, out of range, inconsistent)."""


class InputError(AtbError):
    """Wrong number or kind of inputs/outputs, or invalid values (e.g. ids out of range)."""


class CapabilityError(AtbError):
    """No available backend can run the op here; the reasons are listed."""


class GraphError(AtbError):
    """A graph is malformed (cycle, dangling input, tensor produced twice, ...)."""


class PoolExhaustedError(AtbError):
    """The memory pool cannot serve a request within its ``max_size``."""


class MemoryError_(AtbError):
    """Misuse of pool memory: double free, foreign handle, use after free."""


class PluginError(AtbError):
    """A plugin failed to load, raised in a hook, or returned an invalid value."""
