"""Small value types passed across the plugin boundary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ActivationSpec", "RopeFrequencies"]


@dataclass(frozen=True)
class ActivationSpec:
    """An activation supplied by a plugin through ``atb_activation(name)``.

    ``numpy_fn(x) -> y`` is the reference (called on float64 arrays); ``torch_fn``
    the torch implementation (``None``: atb falls back to the NumPy one). A
    ``gated`` activation takes ``[..., 2 * n]`` and returns ``[..., n]``: the first
    half is the gate passed through the activation, the second half multiplies it
    (``act(x[..., :n]) * x[..., n:]``).
    """

    name: str
    numpy_fn: Callable[[Any], Any]
    torch_fn: Callable[[Any], Any] | None = None
    gated: bool = False

    def __call__(self, x: Any) -> Any:
        """Apply the activation to a NumPy array (reference semantics)."""
        return self.numpy_fn(x)


@dataclass(frozen=True)
class RopeFrequencies:
    """What ``atb_rope_frequencies`` returns: the inverse frequencies ``[dim // 2]``
    (float64 NumPy array) and the factor the cos/sin tables are multiplied by
    (``attention_factor``; 1.0 for methods without one)."""

    inv_freq: Any
    attention_factor: float = 1.0

    def __iter__(self):  # unpacks like Hugging Face's (inv_freq, attention_factor)
        return iter((self.inv_freq, self.attention_factor))
