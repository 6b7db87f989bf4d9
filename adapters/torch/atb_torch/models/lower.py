"""A Hugging Face decoder as one core GraphOp (what ``compile()`` runs: :mod:`.core_runner`).

    from atb_torch.models.lower import lower_decoder
    op = lower_decoder(hf_model)                      # atbcore GraphOp: ids -> logits
    cache = atbcore.memory.KVCache(L, batch, max_len, kv_heads, head_dim, dtype="fp32")
    logits, cache = op(input_ids, kv_cache=cache)     # prefill [B, S] -> [B, S, V]
    logits, cache = op(next_ids[:, None], kv_cache=cache)   # one decode step

The model becomes a list of atb layers (embedding; per block RmsNorm, the merged QKV
Linear, RoPE, FlashAttention with a KV cache, the output projection, a residual
add, RmsNorm, the gated FFN, a residual add; final RmsNorm and LM head) lowered and
fused by the one pass pipeline: each norm goes into the matmul that follows it (QKV,
the FFN's gate|up, the LM head), the attention's residual add into the output
projection's GEMM and the FFN's into its down projection, RoPE and the KV cache write
become one kernel writing the paged rows, and q/k/v are views of the QKV output. It
runs with an ``atb.KVCache`` in the in-place cache form (the cache written by the
plan, one bound program per decode step; 58 launches for the default model's step).
``explain()`` shows what it became.

``quantize="w8" | "w8a8" | "w4"`` makes every projection a quantized core Linear
(:mod:`atbcore.models.quant`; the FFN then runs as (gate|)up Linear, activation, down
Linear), fused and bound like the float ones, its packed layout shown by ``explain()``.

Covered: every decoder ``hf_arch`` describes (Llama, Qwen2, Qwen3 with its q/k
norms, Mistral, Mixtral's MoE blocks, GPT-2 with LayerNorm, learned positions and a
biased GELU MLP), scaled RoPE (llama3, linear, yarn, dynamic within its length) and
any registered MLP activation; anything else raises ``CapabilityError`` naming what
is missing (:func:`atbcore.models.decoder.why_not_lowered`). ``compile()`` runs this
GraphOp for every decoder (:class:`.core_runner.CoreRunner`: Hugging Face's padding
masks, positions and cache over it), ``compile(model, tensor_parallel=N)`` its sharded
form (:mod:`.compile_tp`), ``atb_torch.LLM`` its paged form.
"""

from __future__ import annotations

from typing import Any

from atbcore.errors import CapabilityError
from atbcore.graph.graph_op import GraphOp
from atbcore.models.decoder import decoder_layers
from atbcore.models.decoder import why_not_lowered as _why_not

from .arch import resolve_architecture

__all__ = ["lower_decoder", "decoder_layers"]


def lower_decoder(model: Any, last_token: bool = False, quantize: str | None = None,
                  **graph_op_kwargs: Any) -> GraphOp:
    """The Hugging Face causal LM ``model`` as one core GraphOp (ids ``[B, S]`` ->
    logits ``[B, S, V]``, or ``[B, 1, V]`` of each row's last token with
    ``last_token``); call it with ``kv_cache=`` an ``atb.KVCache``. ``quantize``
    (None, "w8", "w8a8", "w4"): every projection quantized (a GPTQ/AWQ checkpoint's
    own 4-bit codes kept: :mod:`atbcore.models.quant`)."""
    arch = resolve_architecture(model.config)
    spec = arch.describe(model.config)
    why = _why_not(spec)
    if why:
        raise CapabilityError("lower_decoder", why, "a decoder atb lowers", spec.arch)
    weights = arch.extract(model, spec)
    if weights.lm_head is None:
        raise CapabilityError("lower_decoder", "a base model (no LM head)", "a causal LM",
                              type(model).__name__)
    return GraphOp(decoder_layers(spec, weights, last_token, quantize), name=spec.arch,
                   **graph_op_kwargs)
