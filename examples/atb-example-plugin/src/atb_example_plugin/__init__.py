"""An example third-party atb plugin (entry point ``atb_example`` in group ``atb``).

* ``squareplus`` activation: ``(x + sqrt(x**2 + 4)) / 2``, by name through the
  ``atb_activation`` hook alone (atb registers what the hook answers).
* a custom RoPE at the ``rope`` point (``atb_rope``): a *partial, position-scaled,
  interleaved* rotation. Of each head only the first ``fraction * head_dim`` dims
  turn, in GPT-J pairs ``(2i, 2i+1)``, by ``(pos / factor) * base**(-2i/rd)``
  (``rd`` the rotated width, ``base`` the model's own unless ``theta`` is set);
  the other dims pass through. It rotates q and k only (v is never touched),
  at the absolute positions atb hands it (the KV-cache offset included), so
  incremental decoding equals a full recompute. It works on torch, MindSpore,
  Paddle and NumPy tensors alike: it computes in NumPy float64 and hands the
  result back in the caller's framework and dtype.

``configure(fraction=..., factor=..., theta=..., enabled=...)`` changes the settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from atbcore.plugin import ActivationSpec, hookimpl

__all__ = ["squareplus", "SQUAREPLUS", "RopeSettings", "configure", "settings",
           "rotate_partial", "atb_activation", "atb_rope"]


# --------------------------------------------------------------------------- activation
def squareplus(x: Any, b: float = 4.0) -> np.ndarray:
    """Squareplus (Barron, 2021): a smooth ReLU, ``(x + sqrt(x^2 + b)) / 2``."""
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * (x + np.sqrt(x * x + b))


def _squareplus_torch(x: Any) -> Any:
    import torch  # only when torch tensors are being processed

    xf = x.float()
    return (0.5 * (xf + torch.sqrt(xf * xf + 4.0))).to(x.dtype)


SQUAREPLUS = ActivationSpec("squareplus", squareplus, _squareplus_torch)


@hookimpl
def atb_activation(name: str) -> ActivationSpec | None:
    """Provide ``squareplus`` by name."""
    return SQUAREPLUS if name.lower() == "squareplus" else None


# --------------------------------------------------------------------------- RoPE
@dataclass(frozen=True)
class RopeSettings:
    """``fraction``: share of each head that rotates (rounded down to an even
    width); ``factor``: positions are divided by it (linear scaling);
    ``theta``: frequency base (``None``: the model's); ``enabled``: rotate at all
    (off: atb's built-in RoPE runs)."""

    fraction: float = 0.5
    factor: float = 2.0
    theta: float | None = None
    enabled: bool = True


_settings = RopeSettings()


def configure(**changes: Any) -> RopeSettings:
    """Change the RoPE settings; returns them."""
    global _settings
    _settings = replace(_settings, **changes)
    return _settings


def settings() -> RopeSettings:
    """The current RoPE settings."""
    return _settings


def rotate_partial(x: np.ndarray, positions: np.ndarray, base: float,
                   st: RopeSettings) -> np.ndarray:
    """The rotation of ``x`` ``[B, S, H, D]`` at ``positions`` ``[B | 1, S]``, float64."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    rd = int(d * st.fraction) // 2 * 2
    inv = (st.theta or base) ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)  # [rd/2]
    pos = np.asarray(positions, dtype=np.float64) / st.factor                  # [B|1, S]
    ang = pos[..., None, None] * inv                                            # [B|1, S, 1, rd/2]
    cos, sin = np.cos(ang), np.sin(ang)
    even, odd = x[..., 0:rd:2], x[..., 1:rd:2]
    out = x.copy()
    out[..., 0:rd:2] = even * cos - odd * sin
    out[..., 1:rd:2] = even * sin + odd * cos
    return out


def _native(t: Any, positions: np.ndarray, base: float, st: RopeSettings) -> Any:
    from atbcore.tensor import describe, framework_of, from_numpy, to_numpy

    y = rotate_partial(np.array(to_numpy(t), dtype=np.float64), positions, base, st)
    return from_numpy(np.ascontiguousarray(y.astype(describe(t).dtype.numpy)), framework_of(t))


@hookimpl
def atb_rope(payload: Any) -> list | None:
    """Rotate q and k of every RoPE node (see the module docstring)."""
    st = _settings
    if not st.enabled:
        return None
    from atbcore.tensor import to_numpy

    pos = np.asarray(to_numpy(payload.positions))
    base = payload.rope.base
    return [None if t is None else _native(t, pos, base, st) for t in (payload.q, payload.k)]
