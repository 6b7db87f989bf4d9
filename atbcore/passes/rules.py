"""The fusion rules, as data: ``FUSION_RULES`` in the order the pipeline runs them.

Each :class:`FusionRule` is ``(name, switch, pattern, rewrite)`` (+ ``level``,
``requires``, ``doc``). Rules run top to bottom, each until it matches nowhere;
later rules see what earlier ones produced (attention fusion makes the
FlashAttention that ``rope_attention`` and ``packed_qkv`` then refine).

Plugins add rules through the ``atb_register_fusion_rules`` hook (they run after
the built-in ones, in plugin load order); :func:`register_fusion_rule` adds one
in-process. Any rule can be turned off by name with
``FusionConfig(disable=("rule_name",))``.
"""

from __future__ import annotations

from ..errors import GraphError
from . import rules_aggressive as agg
from . import rules_attention as att
from . import rules_cache as cache
from . import rules_ffn as ffn
from . import rules_linear as lin
from . import rules_norm as norm
from .rewrite import FusionRule

__all__ = ["FusionRule", "FUSION_RULES", "register_fusion_rule", "unregister_fusion_rule",
           "all_fusion_rules"]

FUSION_RULES: list[FusionRule] = [
    FusionRule("linear_bias", "enable_linear_act_fusion", lin.LINEAR_BIAS_PATTERN,
               lin.linear_bias_rewrite, doc="Linear + bias add -> Linear with bias"),
    FusionRule("rmsnorm", "enable_norm_fusion", norm.RMSNORM_PRIMITIVES, norm.rmsnorm_rewrite,
               doc="x * rsqrt(mean(x*x) + eps) * w -> RmsNorm"),
    FusionRule("ffn", "enable_ffn_fusion", ffn.FFN_PATTERN, ffn.ffn_rewrite,
               requires=("FusedFeedForward",),
               doc="gate/up Linears + act + mul + down Linear -> FusedFeedForward (gate|up merged)"),
    FusionRule("ffn_gate_up", "enable_ffn_fusion", ffn.FFN_GATE_UP_PATTERN,
               ffn.ffn_gate_up_rewrite, requires=("FusedFeedForward",),
               doc="gated FusedFeedForward on separate gate/up weights -> one gate|up weight"),
    FusionRule("ffn_residual", "enable_ffn_fusion", ffn.FFN_RESIDUAL_PATTERN,
               ffn.ffn_residual_rewrite, requires=("FusedFeedForward",),
               doc="FusedFeedForward + residual add -> FusedFeedForward(has_residual)"),
    FusionRule("linear_residual", "enable_linear_act_fusion", lin.LINEAR_RESIDUAL_PATTERN,
               lin.linear_residual_rewrite,
               doc="Linear + same-shape residual add -> Linear(residual) (add in the GEMM)"),
    FusionRule("norm_ffn", "enable_norm_fusion", ffn.NORM_FFN_PATTERN, ffn.norm_ffn_rewrite,
               requires=("FusedFeedForward",),
               doc="RmsNorm read only by a FusedFeedForward -> the FFN RmsNorming its input"),
    FusionRule("add_rmsnorm", "enable_add_ln_fusion", norm.ADD_RMSNORM_PATTERN,
               norm.add_rmsnorm_rewrite, doc="Add + RmsNorm -> AddRmsNorm"),
    FusionRule("add_layernorm", "enable_add_ln_fusion", norm.ADD_LAYERNORM_PATTERN,
               norm.add_layernorm_rewrite, doc="Add + LayerNorm -> AddLayerNorm"),
    FusionRule("attention", "enable_mha_fusion", att.ATTENTION_PATTERN, att.attention_rewrite,
               doc="MatMul(q, kT) [* scale] [+ mask] -> Softmax -> MatMul(p, v) -> FlashAttention"),
    FusionRule("attention_bsnd", "enable_mha_fusion", att.BSND_PATTERN, att.bsnd_rewrite,
               doc="transposes around BNSD attention -> BSND attention"),
    FusionRule("attention_bsh", "enable_mha_fusion", att.BSH_PATTERN, att.bsh_rewrite,
               doc="head reshapes around BSND attention -> BSH attention"),
    FusionRule("qkv", "enable_qkv_fusion", lin.QKV_PATTERN, lin.qkv_rewrite,
               doc="three Linears on one input -> merged Linear + Split"),
    FusionRule("norm_linear", "enable_norm_fusion", norm.NORM_LINEAR_PATTERN,
               norm.norm_linear_rewrite, requires=("RmsNormLinear",),
               doc="RmsNorm read only by a Linear -> RmsNormLinear (the norm inside the matmul)"),
    FusionRule("rope_attention", "enable_rope_fusion", att.ROPE_ATTENTION_PATTERN,
               att.rope_attention_rewrite, requires=("RopeFlashAttention",),
               doc="RoPE(q, k) -> FlashAttention -> RopeFlashAttention"),
    FusionRule("packed_qkv", "enable_qkv_fusion", att.PACKED_QKV_PATTERN, att.packed_qkv_rewrite,
               doc="Split -> attention(q, k, v) -> attention(packed qkv)"),
    FusionRule("rope_cache", "enable_rope_fusion", cache.ROPE_CACHE_PATTERN,
               cache.rope_cache_rewrite, requires=("RopeKVCache",),
               doc="RoPE(q, k) -> ReshapeAndCache(k, v) -> RopeKVCache (one kernel, paged rows)"),
    FusionRule("linear_activation", "enable_linear_act_fusion", lin.LINEAR_ACT_PATTERN,
               lin.linear_activation_rewrite, requires=("LinearActivation",),
               doc="Linear + activation -> LinearActivation"),
    FusionRule("gelu_tanh", None, agg.GELU_PATTERN, agg.gelu_tanh_rewrite, level="aggressive",
               doc="exact GELU -> tanh approximation (|error| <= 4.8e-4)"),
]


def register_fusion_rule(rule: FusionRule) -> FusionRule:
    """Add a rule after the built-in ones (in-process; plugins use the hook)."""
    if not isinstance(rule, FusionRule):
        raise GraphError("register_fusion_rule", "rule type", "a FusionRule", type(rule).__name__)
    if any(r.name == rule.name for r in FUSION_RULES):
        raise GraphError("register_fusion_rule", f"rule {rule.name!r} already registered",
                         "a new name", rule.name)
    FUSION_RULES.append(rule)
    return rule


def unregister_fusion_rule(name: str) -> None:
    """Remove the rule called ``name`` (no error when absent)."""
    FUSION_RULES[:] = [r for r in FUSION_RULES if r.name != name]


def all_fusion_rules() -> list[FusionRule]:
    """The built-in and in-process rules, then the plugins' rules (load order)."""
    from ..plugin import plugin_fusion_rules

    out = list(FUSION_RULES)
    for r in plugin_fusion_rules():
        if not isinstance(r, FusionRule):
            from ..errors import PluginError

            raise PluginError("atb_register_fusion_rules", "a plugin returned a fusion rule of "
                              f"type {type(r).__name__}", "FusionRule", type(r).__name__)
        out.append(r)
    return out
