"""Execution points and the seed's ``Plugin`` class.

A GraphOp runs plugins at named points around its attention, MLP and block
sub-graphs and at the model's input and output. ``preprocess`` (and the global
``atb_preprocess``) runs at :data:`PRE_POINTS` only, ``postprocess`` (and
``atb_postprocess``) at :data:`POST_POINTS` only; ``rope`` replaces the RoPE
rotation (:mod:`atbcore.plugin.rope_point`)::

    class MyCustomPlugin(atb.Plugin):
        def preprocess(self, inputs):      # at pre_* points and model_input
            return [x * 2 for x in inputs]
        def postprocess(self, outputs):    # at post_* points and model_output
            return outputs

    block.register_plugin("pre_attention", MyCustomPlugin())

:func:`apply_point` is what the GraphOp calls: its own plugins for the point
first, then every globally registered ``atb_preprocess``/``atb_postprocess``
hook, each seeing the previous one's tensors, each validated (same count,
shapes, dtypes and framework) with the plugin named on failure.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, Iterable, Sequence

from ..errors import ParamsError
from .isolation import check_tensors, hook_failure
from .manager import get_plugin_manager

__all__ = ["POINTS", "PRE_POINTS", "POST_POINTS", "REPLACE_POINTS", "Plugin", "apply_point",
           "is_pre_point", "plugin_name", "check_point", "accepts_payload"]

POINTS = ("pre_attention", "post_attention", "pre_mlp", "post_mlp", "pre_block", "post_block",
          "model_input", "model_output", "rope")
#: points where ``preprocess`` / ``atb_preprocess`` run
PRE_POINTS = frozenset(p for p in POINTS if p.startswith("pre_")) | {"model_input"}
#: points where ``postprocess`` / ``atb_postprocess`` run (never at a pre point)
POST_POINTS = frozenset(p for p in POINTS if p.startswith("post_")) | {"model_output"}
#: points where a plugin replaces a computation (see :mod:`atbcore.plugin.rope_point`)
REPLACE_POINTS = frozenset({"rope"})


class Plugin:
    """Base class of a GraphOp's own plugins (``GraphOp.register_plugin(point, p)``).

    ``preprocess`` runs at ``pre_*`` points and ``model_input``, ``postprocess``
    at ``post_*`` points and ``model_output`` (never at a ``pre_*`` point). Both
    receive a list of the front-end's tensors and return a list (or tuple) of
    tensors with the same shapes and dtypes; returning ``None`` keeps the inputs
    (useful when the plugin wrote into them in place). The defaults pass tensors
    through. A method that names a ``payload`` parameter also gets the point's
    typed payload (:mod:`atbcore.plugin.payloads`: q/k/v head-split, positions,
    layer index, cache state). A plugin registered at the ``rope`` point defines
    ``rope(payload)`` instead (see :mod:`atbcore.plugin.rope_point`).
    ``name`` is how errors refer to the plugin (the class name by default).
    """

    name: str | None = None

    def preprocess(self, inputs: list) -> Any:
        """Transform tensors entering a point; the default returns them unchanged."""
        return inputs

    def postprocess(self, outputs: list) -> Any:
        """Transform tensors leaving a point; the default returns them unchanged."""
        return outputs

    def __repr__(self) -> str:
        return f"<{type(self).__name__} plugin>"


def is_pre_point(point: str) -> bool:
    """True at points where ``preprocess``/``atb_preprocess`` run."""
    return point in PRE_POINTS


def check_point(point: str, node: str = "") -> str:
    """Validate a point name (ParamsError naming ``node`` otherwise)."""
    if point not in POINTS:
        raise ParamsError(node or "plugin point", "unknown plugin point", list(POINTS), repr(point))
    return point


def plugin_name(plugin: Any) -> str:
    """A readable name for a local plugin (its ``name``, else its class or function name)."""
    name = getattr(plugin, "name", None)
    if isinstance(name, str) and name:
        return name
    if callable(plugin) and not isinstance(plugin, Plugin) and hasattr(plugin, "__name__"):
        return plugin.__name__
    return type(plugin).__name__


@lru_cache(maxsize=256)
def _takes_payload(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "payload" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def accepts_payload(method: Any) -> bool:
    """True when ``method`` (a function or bound method) names a ``payload``
    parameter or takes ``**kwargs``."""
    fn = getattr(method, "__func__", method)
    try:
        return _takes_payload(fn)
    except TypeError:  # unhashable callable object
        return _takes_payload.__wrapped__(fn)


def _run_local(plugin: Any, pre: bool, tensors: list, payload: Any) -> Any:
    # A Plugin (or any object with preprocess/postprocess) or a bare callable.
    method = getattr(plugin, "preprocess" if pre else "postprocess", None)
    if method is None:
        if not callable(plugin):
            raise TypeError(f"{type(plugin).__name__} has no "
                            f"{'preprocess' if pre else 'postprocess'} method")
        method = plugin
    if payload is not None and accepts_payload(method):
        return method(tensors, payload=payload)
    return method(tensors)


def apply_point(point: str, tensors: Sequence[Any], local_plugins: Iterable[Any] = (), *,
                node: str = "", payload: Any = None) -> list:
    """Run the plugins of ``point`` over ``tensors`` and return the new list.

    ``local_plugins`` are the GraphOp's own plugins registered at ``point`` (in
    registration order); after them the global ``atb_preprocess`` (pre points) or
    ``atb_postprocess`` (post points) hook implementations run, one plugin at a
    time. ``node`` names the graph node/GraphOp for error messages; ``payload``
    (a :mod:`~atbcore.plugin.payloads` object) goes to every hook and local
    method that asks for it. The ``rope`` point is not a pre/post point: it runs
    through :func:`atbcore.plugin.rope_point.apply_rope`.

    Raises PluginError naming the plugin when one raises or returns tensors of
    another count, shape, dtype or framework."""
    check_point(point, node)
    if point in REPLACE_POINTS:
        raise ParamsError(node or "apply_point", f"point {point!r} replaces a computation",
                          "a pre_*/post_* point (use atbcore.plugin.rope_point.apply_rope)",
                          repr(point))
    pre = is_pre_point(point)
    where_at = f"at {point}" + (f" of {node}" if node else "")
    current = list(tensors)
    for plugin in local_plugins:
        name = plugin_name(plugin)
        method = "preprocess" if pre else "postprocess"
        try:
            result = _run_local(plugin, pre, list(current), payload)
        except Exception as e:
            raise hook_failure(name, method, e) from e
        current = check_tensors(name, f"{method} {where_at}", current, result)
    hook = "atb_preprocess" if pre else "atb_postprocess"
    pm = get_plugin_manager()
    for name, plugin in pm.plugins_in_call_order(hook):
        results = pm.call_plugin(hook, plugin, point=point, tensors=list(current), node=node,
                                 payload=payload)
        for result in results:
            current = check_tensors(name, f"{hook} {where_at}", current, result)
    return current
