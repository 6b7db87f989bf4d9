"""The activation registry: names (``"gelu"``, ``"swiglu"`` ...) mapped to a NumPy
function (the float64 oracle) and a torch function, with the built-ins registered
on import. The activation ops (:mod:`.activation`) and the fused ops look their
formulas up here; plugins add names with :func:`register_activation`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ParamsError

__all__ = ["ActivationFn", "register_activation", "unregister_activation", "get_activation",
           "list_activations", "gated_activation", "Fn", "PairFn"]

Fn = Callable[[Any], Any]
PairFn = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class ActivationFn:
    """One activation: ``numpy_fn`` (float64 in, float64 out) and ``torch_fn``
    (kernels pass fp32 tensors and round the result once). For gated entries both
    take ``[..., 2n]`` and return ``[..., n]``; ``numpy_pair``/``torch_pair``
    (``fn(gate, up)``) are set when the entry was built from an elementwise one,
    which saves concatenating gate and up when they arrive apart."""

    name: str
    numpy_fn: Fn
    torch_fn: Fn
    gated: bool = False
    numpy_pair: PairFn | None = None
    torch_pair: PairFn | None = None

    def numpy(self, x: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
        """Apply to float64 arrays (``up`` only for gated entries)."""
        if up is None:
            return self.numpy_fn(x)
        if self.numpy_pair is not None:
            return self.numpy_pair(x, up)
        return self.numpy_fn(np.concatenate([x, up], axis=-1))

    def torch(self, x: Any, up: Any = None) -> Any:
        """Apply to torch tensors (``up`` only for gated entries)."""
        if up is None:
            return self.torch_fn(x)
        if self.torch_pair is not None:
            return self.torch_pair(x, up)
        import torch

        return self.torch_fn(torch.cat([x, up], dim=-1))


_REGISTRY: dict[str, ActivationFn] = {}
_LOCK = threading.Lock()


def _key(name: Any) -> str:
    return str(name).strip().lower()


def register_activation(name: str, numpy_fn: Fn, torch_fn: Fn, gated: bool = False) -> ActivationFn:
    """Add (or replace) the activation ``name`` (case-insensitive).

    ``numpy_fn(x: float64 ndarray) -> ndarray`` is the reference; ``torch_fn(x)``
    the kernel (given fp32 tensors, imports torch itself). ``gated=True``: both take
    ``[..., 2n]`` (gate first) and return ``[..., n]``. A later registration of a
    name replaces the earlier one, so a plugin can override a built-in."""
    if not isinstance(name, str) or not name.strip():
        raise ParamsError("register_activation", "activation name", "a non-empty string", repr(name))
    for what, fn in (("numpy_fn", numpy_fn), ("torch_fn", torch_fn)):
        if not callable(fn):
            raise ParamsError("register_activation", f"{what} of {name!r}", "a callable",
                              type(fn).__name__)
    entry = ActivationFn(_key(name), numpy_fn, torch_fn, bool(gated))
    with _LOCK:
        _REGISTRY[entry.name] = entry
    return entry


def unregister_activation(name: str) -> None:
    """Remove ``name`` from the registry (no error when absent)."""
    with _LOCK:
        _REGISTRY.pop(_key(name), None)


def list_activations() -> list[str]:
    """Every registered activation name, sorted."""
    return sorted(_REGISTRY)


def get_activation(name: Any, op: str = "activation") -> ActivationFn:
    """The activation ``name``; ParamsError naming ``op`` when nobody registered it.

    On a miss the plugin manager is started once (a no-op when it already runs),
    so activations that entry-point plugins register are found without setup;
    then the ``atb_activation`` hook is asked, and its answer registered: a
    plugin implementing that hook alone is enough."""
    entry = _REGISTRY.get(_key(name))
    if entry is None:
        try:
            from ..plugin import get_plugin_manager
        except ImportError:  # pluggy missing: only built-ins
            pass
        else:
            pm = get_plugin_manager()
            entry = _REGISTRY.get(_key(name)) or _from_hook(pm, name)
    if entry is None:
        raise ParamsError(op, f"unknown activation {name!r}", f"one of {list_activations()}",
                          repr(name))
    return entry


def _from_hook(pm: Any, name: Any) -> ActivationFn | None:
    """Register what ``atb_activation(name)`` answers (None when nobody does)."""
    from ..plugin.resolve import resolve_activation
    from ..errors import CapabilityError

    if not pm.hook.atb_activation.get_hookimpls():
        return None
    try:
        spec = resolve_activation(str(name))
    except CapabilityError:
        return None
    torch_fn = spec.torch_fn or _torch_via_numpy(spec.numpy_fn)
    return register_activation(str(name), spec.numpy_fn, torch_fn, gated=spec.gated)


def _torch_via_numpy(numpy_fn: Fn) -> Fn:
    # a plugin gave only the NumPy form: torch kernels round-trip through it
    def torch_fn(x: Any) -> Any:
        import torch

        y = np.asarray(numpy_fn(x.detach().to("cpu", torch.float64).numpy()))
        return torch.from_numpy(np.ascontiguousarray(y)).to(x.device, x.dtype)

    return torch_fn


# --------------------------------------------------------------------------- built-ins
# NumPy has no erf; math.erf is correctly rounded in float64, which an oracle wants.
_erf = np.frompyfunc(math.erf, 1, 1)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _np_gelu(x: np.ndarray) -> np.ndarray:
    # asarray: on a 0-d input frompyfunc returns a plain float
    return 0.5 * x * (1.0 + np.asarray(_erf(x / math.sqrt(2.0)), dtype=np.float64))


def _np_gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))


def _np_sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive argument only: no overflow warnings for large |x|
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _np_quick_gelu(x: np.ndarray) -> np.ndarray:
    return x * _np_sigmoid(1.702 * x)


def _np_silu(x: np.ndarray) -> np.ndarray:
    return x * _np_sigmoid(x)


def _np_relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


# torch is imported inside the functions: this module must not import a framework.
def _t_gelu(x: Any) -> Any:
    import torch.nn.functional as F

    return F.gelu(x)


def _t_gelu_tanh(x: Any) -> Any:
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


def _t_quick_gelu(x: Any) -> Any:
    import torch

    return x * torch.sigmoid(1.702 * x)


def _t_silu(x: Any) -> Any:
    import torch.nn.functional as F

    return F.silu(x)


def _t_relu(x: Any) -> Any:
    import torch

    return torch.relu(x)


def _register_gated(name: str, base: ActivationFn) -> None:
    """``name``: ``base(gate) * up`` over ``[..., 2n] = [gate | up]``."""
    np_pair = lambda g, u: base.numpy_fn(g) * u  # noqa: E731
    t_pair = lambda g, u: base.torch_fn(g) * u  # noqa: E731

    def np_fn(x: np.ndarray) -> np.ndarray:
        n = x.shape[-1] // 2
        return np_pair(x[..., :n], x[..., n:])  # x: [..., 2n] -> [..., n]

    def t_fn(x: Any) -> Any:
        gate, up = x.chunk(2, dim=-1)  # x: [..., 2n] -> [..., n] twice
        return t_pair(gate, up)

    _REGISTRY[name] = ActivationFn(name, np_fn, t_fn, True, np_pair, t_pair)


_GATED_NAMES = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}


def gated_activation(name: str, op: str = "activation") -> str:
    """The gated form ``act(gate) * up`` of the elementwise activation ``name``: the
    built-in name where there is one (``silu`` -> ``swiglu``), else ``<name>_glu``,
    registered on first use (plugins' activations included); ParamsError naming
    ``op`` when ``name`` is unknown or itself gated."""
    base = get_activation(name, op)
    if base.gated:
        raise ParamsError(op, f"activation {name!r} to gate", "an elementwise activation",
                          f"{base.name!r} (already gated)")
    gated = _GATED_NAMES.get(base.name, f"{base.name}_glu")
    if _REGISTRY.get(gated) is None:
        with _LOCK:
            _register_gated(gated, base)
    return gated


def _register_builtins() -> None:
    for name, np_fn, t_fn in (("gelu", _np_gelu, _t_gelu), ("gelu_tanh", _np_gelu_tanh, _t_gelu_tanh),
                              ("quick_gelu", _np_quick_gelu, _t_quick_gelu),
                              ("silu", _np_silu, _t_silu), ("swish", _np_silu, _t_silu),
                              ("relu", _np_relu, _t_relu)):
        register_activation(name, np_fn, t_fn)
    for name, base in (("swiglu", "silu"), ("geglu", "gelu"), ("geglu_tanh", "gelu_tanh")):
        _register_gated(name, _REGISTRY[base])


_register_builtins()
