"""Built-in plugin: RoPE frequency schedules (linear, dynamic NTK, YaRN, Llama-3, LongRoPE).

Answers ``atb_rope_frequencies(config, rope_type, seq_len)`` in NumPy (float64)
for the same configs and with the same results as Hugging Face's
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (which compute in
float32), without importing transformers. Each schedule returns the inverse
frequencies ``[dim // 2]`` and the attention factor the cos/sin tables are
multiplied by (YaRN and LongRoPE have one; the others return 1.0).

    from atbcore.plugin import rope_frequencies
    inv_freq, attention_factor = rope_frequencies(hf_config)  # rope type from the config
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from atbcore.plugin import RopeFrequencies, RopeSettings, hookimpl, rope_settings

__all__ = ["SCHEDULES", "default", "linear", "dynamic", "yarn", "longrope", "llama3",
           "atb_rope_frequencies"]


def _exponents(dim: int) -> np.ndarray:
    # 2i / dim for i in [0, dim/2): the exponent of theta per rotated pair
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    return 1.0 / theta ** _exponents(dim)


def default(s: RopeSettings, seq_len: int | None) -> RopeFrequencies:
    """Plain RoPE: ``theta ** (-2i / dim)``."""
    return RopeFrequencies(_base_inv_freq(s.theta, s.dim), 1.0)


def linear(s: RopeSettings, seq_len: int | None) -> RopeFrequencies:
    """Position interpolation: every frequency divided by ``factor``."""
    return RopeFrequencies(_base_inv_freq(s.theta, s.dim) / float(s.params["factor"]), 1.0)


def dynamic(s: RopeSettings, seq_len: int | None) -> RopeFrequencies:
    """Dynamic NTK: theta grows with the sequence length beyond
    ``max_position_embeddings`` (at or below it the factor has no effect)."""
    factor = float(s.params["factor"])
    max_pos = s.max_position_embeddings
    seq = max_pos if seq_len is None else max(int(seq_len), max_pos)
    theta = s.theta * ((factor * seq / max_pos) - (factor - 1)) ** (s.dim / (s.dim - 2))
    return RopeFrequencies(_base_inv_freq(theta, s.dim), 1.0)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(s: RopeSettings, seq_len: int | None) -> RopeFrequencies:
    """YaRN: interpolate low frequencies, keep high ones, ramp in between
    (``beta_fast``/``beta_slow`` rotations); attention factor from ``factor``,
    ``mscale`` and ``mscale_all_dim`` unless given."""
    p, dim, theta = s.params, s.dim, s.theta
    orig = s.original_max_position_embeddings
    factor = p.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the two lengths
        factor = s.max_position_embeddings / orig
    factor = float(factor)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the pair index whose wavelength makes `rotations` turns over `orig` positions
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # keep the ramp finite
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate fully
    pos_freqs = theta ** _exponents(dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1.0 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return RopeFrequencies(inv_freq, float(attention_factor))


def longrope(s: RopeSettings, seq_len: int | None) -> RopeFrequencies:
    """LongRoPE: per-pair rescale factors, ``long_factor`` past the original
    length and ``short_factor`` otherwise; attention factor
    ``sqrt(1 + log(factor) / log(original length))`` unless given."""
    p = s.params
    orig = s.original_max_position_embeddings
    factor = p.get("factor")
    if factor is None:  # Phi-3 style: the ratio of the two lengths
        factor = s.max_position_embeddings / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(orig))
    ext = p["long_factor"] if seq_len and seq_len > orig else p["short_factor"]
    ext = np.asarray(ext, dtype=np.float64)
    inv_freq = 1.0 / (ext * s.theta ** _exponents(s.dim))
    return RopeFrequencies(inv_freq, float(attention_factor))


def llama3(s: RopeSettings, seq_len: int | None) -> RopeFrequencies:
    """Llama 3.1: wavelengths longer than ``orig / low_freq_factor`` are divided
    by ``factor``, shorter than ``orig / high_freq_factor`` kept, smoothly
    blended in between."""
    p = s.params
    factor, low_ff, high_ff = float(p["factor"]), float(p["low_freq_factor"]), float(
        p["high_freq_factor"])
    orig = float(s.original_max_position_embeddings)
    inv_freq = _base_inv_freq(s.theta, s.dim)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = orig / low_ff, orig / high_ff
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return RopeFrequencies(np.where(medium, smoothed, scaled), 1.0)


SCHEDULES: dict[str, Callable[[RopeSettings, "int | None"], RopeFrequencies]] = {
    "default": default,
    "linear": linear,
    "dynamic": dynamic,
    "yarn": yarn,
    "longrope": longrope,
    "llama3": llama3,
}


@hookimpl(trylast=True)
def atb_rope_frequencies(config: Any, rope_type: str, seq_len: int | None) -> RopeFrequencies | None:
    """The built-in schedules; ``trylast`` so a third-party plugin can override one."""
    fn = SCHEDULES.get(rope_type)
    if fn is None:
        return None
    return fn(rope_settings(config), seq_len)
