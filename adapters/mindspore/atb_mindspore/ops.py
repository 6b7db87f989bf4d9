"""Every core op as a MindSpore Cell called on all its tensors (no weights of its own):

    import atb_mindspore as atb
    attn = atb.ops.FlashAttention(num_heads=32, num_kv_heads=8, causal=True)
    out = attn(q, k, v)                      # mindspore tensors in, mindspore tensor out
    y, s = atb.ops.AddRmsNorm(eps=1e-6)(x, residual, weight)

Imports MindSpore. The top-level ``atb_mindspore.<Name>`` is the seed-style layer
(with its own Parameters) where the core has one, else this op Cell.
"""

from .cells.op_cell import OP_CELLS

globals().update(OP_CELLS)

__all__ = sorted(OP_CELLS)
