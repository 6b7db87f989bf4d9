"""Asking the plugins for model-compile pieces: activations, RoPE frequencies,
architectures and fusion rules. Each wraps one ``firstresult`` hook call and
turns "no plugin answered" into a clear error."""

from __future__ import annotations

from typing import Any

from ..errors import CapabilityError, PluginError
from .manager import get_plugin_manager
from .types import ActivationSpec, RopeFrequencies

__all__ = ["resolve_activation", "rope_frequencies", "model_architecture", "plugin_fusion_rules"]


def resolve_activation(name: str) -> ActivationSpec:
    """The activation ``name`` from the first plugin that knows it.

    Raises CapabilityError when no plugin does."""
    spec = get_plugin_manager().hook.atb_activation(name=name)
    if spec is None:
        raise CapabilityError("activation", f"no plugin provides activation {name!r}",
                              "a plugin implementing atb_activation for it", name)
    if not isinstance(spec, ActivationSpec):
        raise PluginError("activation", f"atb_activation({name!r}) returned a "
                          f"{type(spec).__name__}", "ActivationSpec", type(spec).__name__)
    return spec


def rope_frequencies(config: Any, rope_type: str | None = None,
                     seq_len: int | None = None) -> RopeFrequencies:
    """Inverse RoPE frequencies for ``config`` (a Hugging Face config or dict).

    ``rope_type`` defaults to the config's own (``rope_parameters["rope_type"]``
    or the older ``rope_scaling["type"]``). Raises CapabilityError when no
    plugin supports the type."""
    if rope_type is None:
        from .rope_config import rope_settings

        rope_type = rope_settings(config).rope_type
    out = get_plugin_manager().hook.atb_rope_frequencies(config=config, rope_type=rope_type,
                                                         seq_len=seq_len)
    if out is None:
        raise CapabilityError("rope", f"no plugin supports rope_type {rope_type!r}",
                              "a plugin implementing atb_rope_frequencies for it", rope_type)
    if not isinstance(out, RopeFrequencies):
        raise PluginError("rope", f"atb_rope_frequencies({rope_type!r}) returned a "
                          f"{type(out).__name__}", "RopeFrequencies", type(out).__name__)
    return out


def model_architecture(config: Any) -> Any:
    """What the first plugin supporting ``config``'s architecture returns, or ``None``."""
    return get_plugin_manager().hook.atb_model_architecture(config=config)


def plugin_fusion_rules() -> list[Any]:
    """Fusion rules registered by plugins (``atb_register_fusion_rules``), in load order."""
    return [rule for _, rule in get_plugin_manager().fusion_rules]
