"""Built-in plugin: activations by name — the GELU family, squared ReLU, GeGLU/ReGLU.

Answers ``atb_activation(name)`` with an :class:`~atbcore.plugin.ActivationSpec`
(NumPy reference in float64 + torch implementation) and, in ``atb_register_ops``,
adds the same activations to the core's registry
(``atbcore.ops.activation.register_activation``) so ops can use them by name.

Names (Hugging Face ``ACT2FN`` spellings are accepted as aliases):

=================  ===========================================================
``gelu``           ``x * Phi(x)`` (erf form)
``gelu_tanh``      tanh approximation (``gelu_new``, ``gelu_fast``,
                   ``gelu_pytorch_tanh``, ``gelu_accurate``)
``quick_gelu``     ``x * sigmoid(1.702 x)``
``gelu_10``        erf GELU clipped to [-10, 10]
``relu2``          squared ReLU (``squared_relu``, ``relu_squared``)
``geglu``          gated: ``gelu(a) * b`` for ``[a | b]`` on the last axis
``geglu_tanh``     gated with the tanh GELU
``reglu``          gated: ``relu(a) * b``
=================  ===========================================================
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from atbcore.ops.activation_fns import _t_gelu, _t_gelu_tanh, _t_quick_gelu  # the core's formulas
from atbcore.plugin import ActivationSpec, hookimpl

__all__ = ["ACTIVATIONS", "ALIASES", "lookup", "atb_activation", "atb_register_ops"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_erf = np.vectorize(math.erf, otypes=[np.float64])  # numpy has no erf; math.erf is exact in f64


# --------------------------------------------------------------------------- NumPy (float64)
def _np_gelu(x: Any) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _np_gelu_tanh(x: Any) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))


def _np_quick_gelu(x: Any) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / (1.0 + np.exp(-1.702 * x))


def _np_gelu_10(x: Any) -> np.ndarray:
    return np.clip(_np_gelu(x), -10.0, 10.0)


def _np_relu2(x: Any) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return np.square(np.maximum(x, 0.0))


def _np_relu(x: Any) -> np.ndarray:
    return np.maximum(np.asarray(x, dtype=np.float64), 0.0)


def _np_gated(act: Callable[[Any], np.ndarray]) -> Callable[[Any], np.ndarray]:
    def gated(x: Any) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        n = x.shape[-1] // 2
        return act(x[..., :n]) * x[..., n:]  # x: [..., 2n] = [gate | up]

    return gated


# --------------------------------------------------------------------------- torch
# torch is imported inside the functions: importing this plugin must not import a framework.
def _in_fp32(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    # half types are computed in fp32 and rounded once, like the core's kernels
    def run(x: Any) -> Any:
        return fn(x.float()).to(x.dtype)

    return run


def _t_gelu_10(x: Any) -> Any:
    return _t_gelu(x).clamp(-10.0, 10.0)


def _t_relu2(x: Any) -> Any:
    import torch

    return torch.square(torch.relu(x))


def _t_relu(x: Any) -> Any:
    import torch

    return torch.relu(x)


def _t_gated(act: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def gated(x: Any) -> Any:
        gate, up = x.chunk(2, dim=-1)  # x: [..., 2n] -> [..., n] twice
        return act(gate) * up

    return gated


def _spec(name: str, np_fn: Callable, t_fn: Callable, gated: bool = False) -> ActivationSpec:
    return ActivationSpec(name, _np_gated(np_fn) if gated else np_fn,
                          _in_fp32(_t_gated(t_fn) if gated else t_fn), gated)


ACTIVATIONS: dict[str, ActivationSpec] = {s.name: s for s in (
    _spec("gelu", _np_gelu, _t_gelu),
    _spec("gelu_tanh", _np_gelu_tanh, _t_gelu_tanh),
    _spec("quick_gelu", _np_quick_gelu, _t_quick_gelu),
    _spec("gelu_10", _np_gelu_10, _t_gelu_10),
    _spec("relu2", _np_relu2, _t_relu2),
    _spec("geglu", _np_gelu, _t_gelu, gated=True),
    _spec("geglu_tanh", _np_gelu_tanh, _t_gelu_tanh, gated=True),
    _spec("reglu", _np_relu, _t_relu, gated=True),
)}

ALIASES: dict[str, str] = {
    "gelu_erf": "gelu", "gelu_python": "gelu",
    "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_accurate": "gelu_tanh", "gelu_python_tanh": "gelu_tanh",
    "squared_relu": "relu2", "relu_squared": "relu2",
}


def lookup(name: str) -> ActivationSpec | None:
    """The activation called ``name`` (case-insensitive, aliases allowed), or ``None``."""
    key = name.lower()
    return ACTIVATIONS.get(ALIASES.get(key, key))


@hookimpl(trylast=True)
def atb_activation(name: str) -> ActivationSpec | None:
    """Built-in activations; ``trylast`` so third-party plugins can override a name."""
    return lookup(name)


def _core_registry() -> Any | None:
    import importlib

    try:
        return importlib.import_module("atbcore.ops.activation")
    except ModuleNotFoundError as e:  # the core registry is optional for this plugin
        if e.name != "atbcore.ops.activation":
            raise
        return None


@hookimpl
def atb_register_ops() -> None:
    """Add the activations (and aliases) the core's registry lacks; names the core
    already has (its own gelu, geglu ...) are left alone, so this plugin extends
    the core rather than replacing its kernels."""
    registry = _core_registry()
    if registry is None:
        return
    have = set(registry.list_activations())
    entries = [(n, s) for n, s in ACTIVATIONS.items()]
    entries += [(alias, ACTIVATIONS[target]) for alias, target in ALIASES.items()]
    for name, spec in entries:
        if name not in have:
            registry.register_activation(name, spec.numpy_fn, spec.torch_fn, gated=spec.gated)
