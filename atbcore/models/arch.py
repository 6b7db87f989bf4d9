"""Architecture registry: what ``compile`` needs to know about a model family.

An :class:`ArchSpec` maps a Hugging Face config (``model_type``) to two functions:

* ``describe(config) -> ModelSpec`` — the normalized geometry and options (heads, norm
  kind, activation, RoPE tables, sliding windows, MoE ...). It raises
  :class:`~atbcore.errors.CapabilityError` naming any option atb cannot run exactly
  (an unknown ``rope_type``, ``attn_logit_softcapping``, cross-attention ...).
* ``extract(model, spec) -> ModelWeights`` — the model's tensors in one neutral,
  unfused layout (torch's ``[out, in]`` linear weights). Fusion (merged QKV, gate/up,
  pre-transposed or int8 weights) happens later, in :mod:`.layers`.

Built-in families live in :mod:`.hf_arch` (Llama, Mistral, Qwen2, Qwen3, Mixtral,
GPT-2, BERT). A plugin adds a family through the ``atb_model_architecture(config)``
hook: return an :class:`ArchSpec` for configs you support, ``None`` otherwise. The
built-in table answers first; plugins are asked for model types it does not know::

    from atbcore.plugin import hookimpl
    from atbcore.models.arch import ArchSpec

    @hookimpl
    def atb_model_architecture(config):
        if config.model_type == "my_llama":
            return ArchSpec("my_llama", ("my_llama",), "decoder", describe, extract)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CapabilityError, PluginError

__all__ = ["ModelSpec", "RopeSpec", "MoESpec", "LayerWeights", "ModelWeights", "ArchSpec",
           "ARCHITECTURES", "register_architecture", "resolve_architecture", "unsupported"]


def unsupported(what: str, expected: str, given: Any, op: str = "compile") -> CapabilityError:
    """The error every unsupported model option raises (it names the option)."""
    return CapabilityError(op, what, expected, given)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of the first ``rotary_dim`` dims of each head ("half" /
    neox style). ``inv_freq`` ``[rotary_dim // 2]`` (float64, from the RoPE plugins)
    and ``attention_factor`` (cos/sin are multiplied by it). ``max_len``: positions
    past it change the frequencies (dynamic NTK, LongRoPE); atb refuses them
    instead of running with the wrong tables."""

    rotary_dim: int
    inv_freq: tuple[float, ...]
    attention_factor: float = 1.0
    rope_type: str = "default"
    max_len: int | None = None


@dataclass(frozen=True)
class MoESpec:
    """Top-k routed experts (Mixtral style: softmax over all experts in fp32, top-k,
    renormalised when ``norm_topk_prob``)."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class ModelSpec:
    """Normalized description of a transformer stack.

    ``kind``: "decoder" (causal LM, KV cache) or "encoder" (bidirectional, no cache).
    ``norm``: "rms" or "layer"; ``post_norm``: BERT-style Add+Norm after each block
    (else pre-norm with a final norm). ``activation``: an atb activation name
    (``silu``, ``gelu``, ``gelu_tanh`` ...); ``gated``: act(gate) * up.
    ``position``: "rope" or "learned" (absolute table). ``windows``/``scales``: per
    layer sliding window (None = full) and attention scale.
    """

    arch: str
    kind: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    norm: str
    norm_eps: float
    activation: str
    gated: bool
    position: str
    windows: tuple[int | None, ...]
    scales: tuple[float, ...]
    post_norm: bool = False
    rope: RopeSpec | None = None
    qk_norm: bool = False
    moe: MoESpec | None = None
    max_positions: int | None = None
    type_vocab_size: int = 0
    embed_norm: bool = False
    pooler: bool = False
    extras: dict = field(default_factory=dict, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class LayerWeights:
    """One block's tensors, unfused, linear weights ``[out, in]``; absent = None.

    Pre-norm blocks use ``attn_norm`` before attention and ``mlp_norm`` before the
    MLP; post-norm blocks (BERT) apply ``attn_norm`` after the attention residual and
    ``mlp_norm`` after the MLP residual. Gated MLPs use gate/up/down, plain ones
    up/down. MoE blocks use ``router`` [E, H], ``experts_gate_up`` [E, 2I, H] (gate
    rows first) and ``experts_down`` [E, H, I].
    """

    q: Any
    k: Any
    v: Any
    o: Any
    attn_norm: Any = None
    attn_norm_b: Any = None
    mlp_norm: Any = None
    mlp_norm_b: Any = None
    q_b: Any = None
    k_b: Any = None
    v_b: Any = None
    o_b: Any = None
    q_norm: Any = None
    k_norm: Any = None
    gate: Any = None
    gate_b: Any = None
    up: Any = None
    up_b: Any = None
    down: Any = None
    down_b: Any = None
    router: Any = None
    experts_gate_up: Any = None
    experts_down: Any = None


@dataclass
class ModelWeights:
    """The whole model's tensors (see :class:`LayerWeights`). ``lm_head`` is None for
    base models (they return hidden states)."""

    embed: Any
    layers: list[LayerWeights]
    final_norm: Any = None
    final_norm_b: Any = None
    lm_head: Any = None
    lm_head_b: Any = None
    pos_embed: Any = None
    type_embed: Any = None
    embed_norm: Any = None
    embed_norm_b: Any = None
    pooler: Any = None
    pooler_b: Any = None


@dataclass(frozen=True)
class ArchSpec:
    """A model family: ``describe(config) -> ModelSpec`` and
    ``extract(model, spec) -> ModelWeights`` (see the module docstring).
    ``model_types``: the config ``model_type`` values it answers for."""

    name: str
    model_types: tuple[str, ...]
    kind: str
    describe: Callable[[Any], ModelSpec]
    extract: Callable[[Any, ModelSpec], ModelWeights]


ARCHITECTURES: dict[str, ArchSpec] = {}


def register_architecture(spec: ArchSpec) -> ArchSpec:
    """Add (or replace) a family in the built-in table, keyed by its model types."""
    for t in spec.model_types:
        ARCHITECTURES[t] = spec
    return spec


def resolve_architecture(config: Any) -> ArchSpec:
    """The :class:`ArchSpec` for ``config``: the built-in table first, then the
    plugins' ``atb_model_architecture`` hook. CapabilityError names the model type
    when nobody supports it."""
    from . import hf_arch  # noqa: F401  (registers the built-in families)

    mtype = getattr(config, "model_type", None)
    spec = ARCHITECTURES.get(mtype)
    if spec is not None:
        return spec
    try:
        from atbcore.plugin import model_architecture
    except ImportError:  # pluggy missing: built-ins only
        answer = None
    else:
        answer = model_architecture(config)
    if answer is None:
        raise unsupported("architecture", f"one of {sorted(ARCHITECTURES)} or a plugin "
                          "implementing atb_model_architecture for it", repr(mtype))
    if not isinstance(answer, ArchSpec):
        raise PluginError("compile", f"atb_model_architecture({mtype!r}) returned a "
                          f"{type(answer).__name__}", "ArchSpec", type(answer).__name__)
    return answer
