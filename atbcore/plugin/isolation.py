"""Keeping one plugin's failure from looking like atb's (or another plugin's).

* :func:`guarded_hookexec` wraps pluggy's call loop so that an exception raised
  inside any hook implementation is re-raised as :class:`PluginError` naming the
  plugin and the hook (the original is chained as ``__cause__``).
* :func:`check_tensors` validates what a plugin returned at an execution point:
  the same number of tensors, each with the shape, dtype and framework it
  replaces; the error names the plugin.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Mapping, Sequence

from ..errors import DtypeError, PluginError, ShapeError

__all__ = [
    "PluginShapeError",
    "PluginDtypeError",
    "plugin_error",
    "hook_failure",
    "guard",
    "guarded_hookexec",
    "check_tensors",
]


class PluginShapeError(PluginError, ShapeError):
    """A plugin returned a tensor of the wrong shape (both a PluginError and a ShapeError)."""


class PluginDtypeError(PluginError, DtypeError):
    """A plugin returned a tensor of the wrong dtype (both a PluginError and a DtypeError)."""


def plugin_label(name: str) -> str:
    """How errors name a plugin: ``plugin 'name'``."""
    return f"plugin '{name}'"


def plugin_error(plugin: str, what: str, expected: Any = None, given: Any = None, *,
                 hook: str = "", cls: type[PluginError] = PluginError) -> PluginError:
    """A PluginError (or subclass ``cls``) blaming ``plugin``; ``.plugin`` and
    ``.hook`` carry the names for tools."""
    err = cls(plugin_label(plugin), what, expected, given)
    err.plugin = plugin  # type: ignore[attr-defined]
    err.hook = hook  # type: ignore[attr-defined]
    return err


def hook_failure(plugin: str, hook: str, exc: BaseException) -> PluginError:
    """The PluginError for ``exc`` raised by ``plugin`` in ``hook``."""
    return plugin_error(plugin, f"hook {hook} raised {type(exc).__name__}: {exc}", hook=hook)


def _attributed(exc: BaseException) -> bool:
    # An error already blamed on a plugin (nested hook call, or a wrapper seeing an
    # inner plugin's failure) keeps its attribution.
    return isinstance(exc, PluginError) and getattr(exc, "plugin", None) is not None


# What a plugin may still raise through atb: the user's Ctrl-C, and the generator
# protocol's own signal. Everything else (SystemExit from a sys.exit() in a hook
# included) becomes a PluginError naming the plugin.
_PASS_THROUGH = (KeyboardInterrupt, GeneratorExit)


def guard(fn: Callable[..., Any], plugin: str, hook: str) -> Callable[..., Any]:
    """Wrap a hook function so its exceptions (any but KeyboardInterrupt) become
    PluginErrors naming ``plugin``.

    Generator functions (pluggy wrappers) are wrapped as generators so that
    ``yield``/``send``/``throw`` pass straight through."""
    if inspect.isgeneratorfunction(fn):
        def guarded_gen(*args: Any) -> Any:
            try:
                return (yield from fn(*args))
            except _PASS_THROUGH:
                raise
            except BaseException as e:  # noqa: BLE001 - see _PASS_THROUGH
                if _attributed(e):
                    raise
                raise hook_failure(plugin, hook, e) from e

        return guarded_gen

    def guarded(*args: Any) -> Any:
        try:
            return fn(*args)
        except _PASS_THROUGH:
            raise
        except BaseException as e:  # noqa: BLE001 - see _PASS_THROUGH
            if _attributed(e):
                raise
            raise hook_failure(plugin, hook, e) from e

    return guarded


def guarded_hookexec(inner: Callable[..., Any]) -> Callable[..., Any]:
    """A pluggy ``_inner_hookexec`` replacement that runs ``inner`` (pluggy's
    multicall) on guarded copies of the hook implementations."""
    cache: dict[int, tuple[Any, Any]] = {}  # id(impl) -> (impl, guarded copy)

    def _guarded_impl(impl: Any, hook: str) -> Any:
        hit = cache.get(id(impl))
        if hit is not None and hit[0] is impl:
            return hit[1]
        clone = copy.copy(impl)  # HookImpl is slotted; argnames etc. stay those of the original
        clone.function = guard(impl.function, impl.plugin_name, hook)
        cache[id(impl)] = (impl, clone)
        return clone

    def hookexec(hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any],
                 firstresult: bool) -> Any:
        return inner(hook_name, [_guarded_impl(i, hook_name) for i in impls], kwargs, firstresult)

    hookexec.cache = cache  # type: ignore[attr-defined]  # cleared when plugins unregister
    return hookexec


def check_tensors(plugin: str, where: str, before: Sequence[Any], result: Any) -> list:
    """Validate a plugin's replacement for ``before``; return it as a list.

    ``None`` keeps ``before``; a single tensor is accepted where one was given.
    Raises a PluginError subclass naming ``plugin`` and ``where`` otherwise."""
    from ..tensor import describe, framework_of, is_tensor

    if result is None:
        return list(before)
    if len(before) == 1 and is_tensor(result):
        result = [result]
    if not isinstance(result, (list, tuple)):
        raise plugin_error(plugin, f"{where} returned a {type(result).__name__}",
                           "a list of tensors or None", type(result).__name__)
    if len(result) != len(before):
        raise plugin_error(plugin, f"{where} returned the wrong number of tensors",
                           len(before), len(result))
    out = list(result)
    for i, (old, new) in enumerate(zip(before, out)):
        if old is None:
            if new is not None:
                raise plugin_error(plugin, f"{where} filled absent tensor {i}",
                                   "None", type(new).__name__)
            continue
        if not is_tensor(new):
            raise plugin_error(plugin, f"{where} returned a non-tensor at {i}",
                               type(old).__name__, type(new).__name__)
        want, got = describe(old), describe(new)
        if tuple(got.shape) != tuple(want.shape):
            raise plugin_error(plugin, f"{where} tensor {i} shape", list(want.shape),
                               list(got.shape), cls=PluginShapeError)
        if got.dtype != want.dtype:
            raise plugin_error(plugin, f"{where} tensor {i} dtype", want.dtype.name.lower(),
                               got.dtype.name.lower(), cls=PluginDtypeError)
        if framework_of(new) != framework_of(old):
            raise plugin_error(plugin, f"{where} tensor {i} framework", framework_of(old),
                               framework_of(new))
    return out

