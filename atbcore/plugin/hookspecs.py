"""The plugin contract: every hook a plugin may implement, grouped by phase.

Specs are docstring-only. atb calls every hook with keyword arguments; an
implementation may accept any subset of a spec's arguments (pluggy passes only
the ones it names). Hooks marked ``firstresult`` stop at the first plugin that
returns something other than ``None``; order is pluggy's: ``tryfirst`` first,
``trylast`` last, otherwise the most recently registered plugin first.

A plugin is a module or object with functions marked ``@hookimpl``, found
through the entry-point group ``atb``::

    # pyproject.toml of a plugin package
    [project.entry-points.atb]
    my_plugin = "my_package.atb_plugin"

A hook that raises is re-raised as :class:`~atbcore.errors.PluginError` naming the
plugin and the hook; a value of the wrong kind (a tensor with another shape or
dtype, something that is not a Graph) is rejected with the plugin named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from .markers import hookspec

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ..graph.ir import Graph
    from .manager import AtbPluginManager
    from .payloads import AttentionPayload, PointPayload, RopePayload
    from .types import ActivationSpec, RopeFrequencies

__all__ = [
    "atb_configure",
    "atb_register_ops",
    "atb_register_backends",
    "atb_register_fusion_rules",
    "atb_register_adapters",
    "atb_graph_after_build",
    "atb_graph_before_plan",
    "atb_preprocess",
    "atb_postprocess",
    "atb_rope",
    "atb_model_architecture",
    "atb_rope_frequencies",
    "atb_activation",
]


# --------------------------------------------------------------------------- set-up
# Called once per plugin, right after it is registered (entry-point loading or
# ``get_plugin_manager().register(plugin)``).


@hookspec
def atb_configure(manager: "AtbPluginManager") -> None:
    """The plugin was registered with ``manager``; keep a reference or install
    hook-call monitoring (the built-in tracing plugin does)."""


@hookspec
def atb_register_ops() -> None:
    """Register new ops (``@register_op`` OpDefs) or activations
    (``atbcore.ops.activation.register_activation``)."""


@hookspec
def atb_register_backends() -> None:
    """Register kernels (``@kernel`` in a torch-backend module) or whole backends."""


@hookspec
def atb_register_fusion_rules() -> "Sequence[Any] | None":
    """Return fusion rules (``atbcore.passes.rules.FusionRule``) to add to the
    pass pipeline; they are collected in ``manager.fusion_rules``."""


@hookspec
def atb_register_adapters() -> None:
    """Register framework adapters / tensor bridges
    (``atbcore.tensor.register_bridge``)."""


# --------------------------------------------------------------------------- graph lifecycle


@hookspec
def atb_graph_after_build(graph: "Graph") -> "Graph | None":
    """A graph was built (before the fusion passes). Return a rewritten Graph,
    or ``None`` to keep it. Plugins run one after another, each seeing the
    previous rewrite; every rewrite is verified before it is accepted."""


@hookspec
def atb_graph_before_plan(graph: "Graph") -> "Graph | None":
    """The passes ran; the graph is about to be scheduled and memory-planned.
    Return a rewritten Graph or ``None``; rewrites are verified."""


# --------------------------------------------------------------------------- execution


@hookspec
def atb_preprocess(point: str, tensors: list, node: str,
                   payload: "AttentionPayload | PointPayload | None") -> "list | None":
    """Tensors about to enter ``point`` of graph node ``node``; runs at the pre
    points only: ``pre_attention``, ``pre_mlp``, ``pre_block`` and
    ``model_input``. The tensors are the front-end's own (torch, MindSpore,
    Paddle or NumPy). Return replacements of the same shapes and dtypes, or
    ``None`` to leave them.

    ``payload`` (name it to receive it; older plugins that do not keep working)
    is an :class:`~atbcore.plugin.payloads.AttentionPayload` at
    ``pre_attention`` (q, k, v head-split ``[B, S, heads, head_dim]``, per-token
    ``positions`` after the cache offset, ``layer``, the node's ``rope``
    parameters, the ``cache`` state) and a
    :class:`~atbcore.plugin.payloads.PointPayload` (node, layer, cache) at the
    other points. Example, at ``pre_attention``: scale the queries of layer 0::

        @hookimpl
        def atb_preprocess(point, tensors, payload):
            if point == "pre_attention" and payload.layer == 0:
                return [tensors[0] * 0.5] + tensors[1:]   # q (or packed qkv) first

    Example, at ``pre_mlp``: clamp the MLP input::

        @hookimpl
        def atb_preprocess(point, tensors):
            if point == "pre_mlp":
                return [t.clamp(-50, 50) for t in tensors]    # torch tensors

    Example, at ``pre_block``: the GraphOp's own inputs, before anything runs
    (``payload.node`` is the GraphOp's name, ``payload.layer`` is ``None``)::

        @hookimpl
        def atb_preprocess(point, tensors, payload):
            if point == "pre_block" and payload.cache.form == "in_place":
                log.info("%s: %d inputs", payload.node, len(tensors))

    ``model_input`` / ``model_output`` are part of the contract for whole-model
    runners; GraphOps (and models lowered to them) do not call them.
    """


@hookspec
def atb_postprocess(point: str, tensors: list, node: str,
                    payload: "AttentionPayload | PointPayload | None") -> "list | None":
    """Tensors leaving ``point``; runs at the post points only:
    ``post_attention``, ``post_mlp``, ``post_block`` and ``model_output``
    (never at a ``pre_*`` point). Same contract as ``atb_preprocess``; at
    ``post_attention`` the payload also carries the attention's ``output``
    ``[B, S, H, D]`` next to the q, k, v it read. Example, at ``post_attention``:
    record what each layer's queries attended to::

        @hookimpl
        def atb_postprocess(point, tensors, payload):
            if point == "post_attention":
                seen[payload.layer] = payload.positions
            # None: the outputs stay as they are

    Example, at ``post_mlp`` / ``post_block``: scale the MLP output of layer 1,
    round the block's outputs::

        @hookimpl
        def atb_postprocess(point, tensors, payload):
            if point == "post_mlp" and payload.layer == 1:
                return [t * 0.5 for t in tensors]
            if point == "post_block":
                return [t.round(decimals=4) for t in tensors]   # torch tensors
    """


@hookspec(firstresult=True)
def atb_rope(payload: "RopePayload") -> "list | None":
    """The ``rope`` point: rotate ``payload.q`` ``[B, S, H, D]`` and
    ``payload.k`` ``[B, S, Hkv, D]`` (``None`` for a RoPE of q alone) at
    ``payload.positions`` ``[B | 1, S]`` (absolute: the cache offset is in
    them, so incremental decoding equals a full recompute). Return
    ``[q_rot, k_rot]`` of the same shapes and dtypes, or ``None`` to leave the
    rotation to the next plugin and finally to the built-in RoPE
    (:func:`atbcore.plugin.rope_point.builtin_rope` computes that one). Runs
    in GraphOps, in both KV-cache forms, and in models lowered to GraphOps.
    Example: linear position scaling by 4::

        from dataclasses import replace
        from atbcore.plugin.rope_point import builtin_rope

        @hookimpl
        def atb_rope(payload):
            return builtin_rope(replace(payload, positions=payload.positions / 4))
    """


# --------------------------------------------------------------------------- model compile


@hookspec(firstresult=True)
def atb_model_architecture(config: Any) -> Any:
    """Support a Hugging Face architecture atb does not know: given the model's
    config, return a description/builder for it (or ``None`` to pass)."""


@hookspec(firstresult=True)
def atb_rope_frequencies(config: Any, rope_type: str, seq_len: "int | None") -> "RopeFrequencies | None":
    """Inverse RoPE frequencies for ``rope_type`` (``"linear"``, ``"yarn"`` ...)
    under ``config`` (a Hugging Face config or a plain dict with the same keys);
    ``seq_len`` is the current length for schedules that depend on it. Return
    :class:`~atbcore.plugin.types.RopeFrequencies` or ``None`` to pass."""


@hookspec(firstresult=True)
def atb_activation(name: str) -> "ActivationSpec | None":
    """An activation by name (``"gelu_tanh"``, ``"relu2"``, ``"geglu"`` ...):
    return an :class:`~atbcore.plugin.types.ActivationSpec` or ``None`` to pass.
    This hook alone is enough: an op or layer naming an activation nobody
    registered asks it and registers the answer (no ``register_activation``
    call needed). Example::

        @hookimpl
        def atb_activation(name):
            if name == "squareplus":
                return ActivationSpec("squareplus", lambda x: (x + np.sqrt(x * x + 4)) / 2)
    """
