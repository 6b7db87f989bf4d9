"""Every core op as a Paddle layer called on all its tensors (no weights of its own):

    import atb_paddle as atb
    attn = atb.ops.FlashAttention(num_heads=32, num_kv_heads=8, causal=True)
    out = attn(q, k, v)                      # paddle tensors in, paddle tensor out
    y, s = atb.ops.AddRmsNorm(eps=1e-6)(x, residual, weight)

Imports Paddle. The top-level ``atb_paddle.<Name>`` is the seed-style layer (with
its own weights) where the core has one, else this op layer.
"""

from .layers.catalog import OPS

globals().update(OPS)

__all__ = sorted(OPS)
