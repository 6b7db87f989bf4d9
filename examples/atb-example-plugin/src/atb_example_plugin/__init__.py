"""An example third-party atb plugin (entry point ``atb_example`` in group ``atb``).

* ``squareplus`` activation: ``(x + sqrt(x**2 + 4)) / 2`` — by name through
  ``atb_activation`` and, when the core has one, the activation registry.
* a pre-attention RoPE variant (``atb_preprocess`` at ``pre_attention``):
  interleaved pairs ``(2i, 2i+1)`` of each head turned by ``pos * theta**(-2i/d)``,
  ``pos`` the index on axis -2; applied to the query and key (the first two
  tensors entering attention, or the only one). Works on torch, MindSpore,
  Paddle and NumPy tensors alike: it computes in NumPy and hands the result
  back in the caller's framework and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from atbcore.plugin import ActivationSpec, hookimpl

__all__ = ["squareplus", "SQUAREPLUS", "RopeSettings", "configure", "settings",
           "rotate_interleaved", "atb_activation", "atb_register_ops", "atb_preprocess"]


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


@hookimpl
def atb_register_ops() -> None:
    """Add ``squareplus`` to the core's activation registry (if the core has one)."""
    try:
        from atbcore.ops.activation import register_activation
    except ImportError:
        return
    register_activation("squareplus", SQUAREPLUS.numpy_fn, SQUAREPLUS.torch_fn, gated=False)


# --------------------------------------------------------------------------- RoPE variant
@dataclass(frozen=True)
class RopeSettings:
    """``theta``: frequency base; ``head_dim``: width of one rotated head (``None``:
    the whole last axis); ``inputs``: indices of the tensors to rotate."""

    theta: float = 10000.0
    head_dim: int | None = None
    inputs: tuple[int, ...] = (0, 1)


_settings = RopeSettings()


def configure(**changes: Any) -> RopeSettings:
    """Change the RoPE settings (``theta``, ``head_dim``, ``inputs``); returns them."""
    global _settings
    _settings = replace(_settings, **changes)
    return _settings


def settings() -> RopeSettings:
    """The current RoPE settings."""
    return _settings


def rotate_interleaved(x: np.ndarray, theta: float, head_dim: int | None) -> np.ndarray:
    """Interleaved RoPE of ``x`` ``[..., S, F]`` in float64 (the reference)."""
    x = np.asarray(x, dtype=np.float64)
    s, f = x.shape[-2], x.shape[-1]
    d = head_dim or f
    heads = x.reshape(*x.shape[:-1], f // d, d)  # [..., S, F] -> [..., S, H, d]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
    ang = np.arange(s, dtype=np.float64)[:, None] * inv[None, :]  # [S, d/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]  # [S, 1, d/2]
    even, odd = heads[..., 0::2], heads[..., 1::2]
    out = np.empty_like(heads)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out.reshape(x.shape)


def _rotate_native(t: Any, st: RopeSettings) -> Any:
    from atbcore.tensor import describe, framework_of, from_numpy, to_numpy

    desc = describe(t)
    y = rotate_interleaved(np.array(to_numpy(t), dtype=np.float64), st.theta, st.head_dim)
    return from_numpy(np.ascontiguousarray(y.astype(desc.dtype.numpy)), framework_of(t))


@hookimpl
def atb_preprocess(point: str, tensors: list, node: str) -> list | None:
    """Rotate query and key entering attention; other points are left alone."""
    if point != "pre_attention":
        return None
    st = _settings
    idx = [i for i in st.inputs if i < len(tensors)] or [0]
    out = list(tensors)
    for i in idx:
        if out[i] is not None:
            out[i] = _rotate_native(out[i], st)
    return out
