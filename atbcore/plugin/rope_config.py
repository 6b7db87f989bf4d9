"""Reading RoPE settings from a Hugging Face config or a plain dict.

Hugging Face 5.x keeps RoPE settings in ``config.rope_parameters`` (``rope_type``,
``rope_theta``, ``factor``, ...); older configs used ``rope_scaling`` (with
``type``) and a top-level ``rope_theta``. :func:`rope_settings` accepts both, and
plain dicts with the same keys, so the core never needs ``transformers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["RopeSettings", "rope_settings", "SCALED_TYPES"]

#: rope types whose pre-training length lives in ``original_max_position_embeddings``
SCALED_TYPES = ("llama3", "yarn", "longrope")
DEFAULT_THETA = 10_000.0


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _has(config: Any, key: str) -> bool:
    return key in config if isinstance(config, Mapping) else hasattr(config, key)


@dataclass(frozen=True)
class RopeSettings:
    """Normalized RoPE settings: ``dim`` is the rotated width
    (``int(head_dim * partial_rotary_factor)``); ``params`` the scaling dict."""

    rope_type: str
    theta: float
    head_dim: int
    dim: int
    max_position_embeddings: int | None
    original_max_position_embeddings: int | None
    params: dict = field(default_factory=dict)


def rope_settings(config: Any) -> RopeSettings:
    """Normalize ``config`` (object or mapping). A mapping without
    ``rope_parameters``/``rope_scaling`` is itself taken as the parameter dict."""
    params = _get(config, "rope_parameters") or _get(config, "rope_scaling")
    if params is None and isinstance(config, Mapping):
        params = config
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", _get(config, "rope_theta", None)) or DEFAULT_THETA
    partial = params.get("partial_rotary_factor", _get(config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    head_dim = _get(config, "head_dim", None)
    if not head_dim:
        head_dim = _get(config, "hidden_size") // _get(config, "num_attention_heads")
    max_pos = _get(config, "max_position_embeddings", None)
    orig = None
    if rope_type in SCALED_TYPES:
        # a top-level original_max_position_embeddings (Phi-3 style) wins, as in transformers
        if _has(config, "original_max_position_embeddings"):
            orig = _get(config, "original_max_position_embeddings")
        if orig is None:
            orig = params.get("original_max_position_embeddings", max_pos)
    return RopeSettings(rope_type=str(rope_type), theta=float(theta), head_dim=int(head_dim),
                        dim=int(head_dim * partial), max_position_embeddings=max_pos,
                        original_max_position_embeddings=orig, params=params)
