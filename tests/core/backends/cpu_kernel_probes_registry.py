"""The probe registry shared by ``cpu_kernel_probes.py`` and its attention half.

A probe is a function returning ``(bad_call, buffers)``: the call must raise an
``AtbError`` and leave every buffer in ``buffers`` as it was.
"""

from __future__ import annotations

import torch

PROBES: dict[str, object] = {}


def probe(fn):
    """Register ``fn`` under its name."""
    PROBES[fn.__name__] = fn
    return fn


def sentinel(*shape, dtype=torch.float32):
    """A buffer of 7s that a rejected call must leave as it is."""
    return torch.full(shape, 7.0, dtype=dtype)
