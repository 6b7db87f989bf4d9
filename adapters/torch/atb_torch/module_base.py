"""The base of every atb_torch layer: an ``nn.Module`` that can also be a layer of a
``GraphOp``.

* Weights are ``nn.Parameter`` s. A size the seed leaves open
  (``Linear(out_features=...)`` has no ``in_features``) makes the parameter an
  ``UninitializedParameter``: it takes its shape at the first call (standalone, or
  when its GraphOp first sees an input) or from ``load_state_dict`` — as torch's
  lazy modules do — and is then initialised like the matching ``torch.nn`` module.
* Parameter names are the core layer's local weight names (``weight``, ``bias``,
  ``q_proj.weight`` ...), nested through :class:`ParamHolder` children where the
  name has a dot, so a GraphOp's graph weight ``"<layer>.<name>"`` is the module
  path ``layers.<layer>.<name>``.
* :meth:`core_layer` builds the matching ``atbcore.graph.layers`` layer (same
  settings, the given weights loaded) for lowering inside a GraphOp.
* Forward hooks: standalone calls are ordinary ``nn.Module`` calls. Inside a
  GraphOp a layer does not run its own ``forward`` (the whole block is one fused
  graph), so hooks registered on it would never fire; registering one warns and
  says to use the GraphOp's hooks or ``register_plugin`` instead.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from typing import Any, ClassVar, Mapping

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter, is_lazy

from atbcore.errors import AtbError, ParamsError

from . import profiling
from .devices import check_to_args

__all__ = ["AtbModule", "ParamHolder", "lazy_param", "new_param", "split_name",
           "host_weights"]


def split_name(op: str, name_or_size: Any) -> tuple[str | None, Any]:
    """The seed passes a layer name first (``Linear("qkv_proj", ...)``), torch users
    a size (``Linear(64, 128)``); returns ``(name, size)``."""
    if name_or_size is None:
        return None, None
    if isinstance(name_or_size, str):
        if not name_or_size:
            raise ParamsError(op, "layer name", "a non-empty string", repr(name_or_size))
        return name_or_size, None
    if isinstance(name_or_size, bool) or not isinstance(name_or_size, int) or name_or_size <= 0:
        raise ParamsError(op, "first argument", "a layer name (str) or a positive size (int)",
                          repr(name_or_size))
    return None, int(name_or_size)


def new_param(shape: tuple[int, ...] | None, dtype: Any = None, device: Any = None,
              requires_grad: bool = True) -> nn.Parameter:
    """A parameter of ``shape`` (uninitialised values; callers initialise), or an
    ``UninitializedParameter`` when the shape is not known yet."""
    if shape is None:
        return UninitializedParameter(requires_grad=requires_grad, device=device, dtype=dtype)
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=requires_grad)


lazy_param = new_param


def host_weights(params: Mapping[str, nn.Parameter]) -> dict[str, Any]:
    """Initialised parameters as NumPy arrays for the core (zero-copy on CPU)."""
    from atbcore.tensor import to_numpy

    out = {}
    for k, p in params.items():
        if is_lazy(p):
            continue
        t = p.detach()
        out[k] = to_numpy(t if t.device.type == "cpu" else t.cpu())
    return out


def _materialize_from_state(module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                            *args: Any) -> None:
    """load_state_dict pre-hook: give uninitialised parameters the checkpoint's shapes."""
    for n, p in module._parameters.items():
        key = prefix + n
        if p is not None and is_lazy(p) and key in state_dict and not is_lazy(state_dict[key]):
            p.materialize(tuple(state_dict[key].shape))
    after = getattr(module, "_after_materialize", None)
    if after is not None:
        after()


class _LazyStateMixin:
    """state_dict / load_state_dict that work with uninitialised parameters."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: D401
        for n, p in self._parameters.items():
            if p is not None:
                destination[prefix + n] = p if (keep_vars or is_lazy(p)) else p.detach()
        for n, b in self._buffers.items():
            if b is not None and n not in self._non_persistent_buffers_set:
                destination[prefix + n] = b if keep_vars else b.detach()


class ParamHolder(_LazyStateMixin, nn.Module):
    """A child that only holds parameters, so names like ``q_proj.weight`` nest."""

    def __init__(self, **params: nn.Parameter) -> None:
        super().__init__()
        for k, v in params.items():
            self.register_parameter(k, v)
        self.register_load_state_dict_pre_hook(_materialize_from_state)

    def forward(self, *a: Any) -> Any:  # pragma: no cover - never called
        raise AtbError("ParamHolder", "not callable", "its parent layer", "a call")


class AtbModule(_LazyStateMixin, nn.Module):
    """Base class; see the module docstring.

    Subclasses set ``op_name`` (for profiles and errors), ``kind`` (the GraphOp
    auto-name stem, as the core layer's) and ``graph_layer`` (True when it can sit
    in a ``GraphOp([...])``), and implement ``forward`` and, for graph layers,
    :meth:`core_layer`. ``_init_param(key, p)`` initialises a parameter that
    just got its shape.
    """

    op_name: ClassVar[str] = ""
    kind: ClassVar[str] = "layer"
    graph_layer: ClassVar[bool] = False

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.name = name
        self._graph_owners: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.register_load_state_dict_pre_hook(_materialize_from_state)

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict:
        # Weak sets and private GraphOps do not travel (deepcopy, pickle/torch.save).
        state = dict(super().__getstate__())
        state["_graph_owners"] = None
        if "_solo_op" in state:
            state["_solo_op"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._graph_owners = weakref.WeakSet()

    # ------------------------------------------------------------------ weights
    def core_weights(self) -> dict[str, nn.Parameter]:
        """Parameters by the core layer's local names (``q_proj.weight`` ...)."""
        return dict(self.named_parameters())

    def has_lazy(self) -> bool:
        """Whether a parameter still waits for its shape (isinstance, which
        torch.compile can trace, unlike ``is_lazy``)."""
        return any(isinstance(p, UninitializedParameter) for p in self.parameters())

    def materialize(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Give uninitialised parameters these shapes and initialise them."""
        params = self.core_weights()
        fresh = []
        for k, shape in shapes.items():
            p = params.get(k)
            if p is not None and is_lazy(p):
                p.materialize(tuple(shape))
                fresh.append((k, p))
        # initialise after every shape is known (a bias's bound needs the weight's)
        with torch.no_grad():
            for k, p in fresh:
                self._init_param(k, p)
        self._after_materialize()

    def _init_param(self, key: str, p: nn.Parameter) -> None:
        """Default: nn.Linear's rule for matrices/vectors, U(-1/sqrt(fan_in), ...)."""
        fan_in = p.shape[-1] if p.dim() > 1 else max(int(getattr(self, "_fan_in", 1)), 1)
        bound = 1.0 / math.sqrt(fan_in)
        nn.init.uniform_(p, -bound, bound)

    def _after_materialize(self) -> None:
        """Update sizes inferred from parameter shapes."""

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> Any:
        """The ``atbcore.graph.layers`` layer for lowering (weights loaded)."""
        raise ParamsError(name, f"{type(self).__name__} cannot be a GraphOp layer",
                          "a graph layer (Linear, LayerNorm, RmsNorm, FlashAttention, RoPE, "
                          "ResidualAdd, activations, FusedFeedForward, ...)", type(self).__name__)

    # ------------------------------------------------------------------ devices
    def to(self, *args: Any, **kwargs: Any) -> "AtbModule":
        """``nn.Module.to``, refusing devices atb cannot use with an AtbError."""
        check_to_args(args, kwargs, self.op_name or type(self).__name__)
        return super().to(*args, **kwargs)

    def npu(self, device: Any = None) -> "AtbModule":
        """Move to an Ascend NPU (needs torch_npu)."""
        return self.to(f"npu:{device}" if isinstance(device, int) else (device or "npu"))

    # ------------------------------------------------------------------ hooks, profiling
    def register_forward_hook(self, hook: Any, *args: Any, **kwargs: Any) -> Any:
        self._warn_inside_graph("forward hook")
        return super().register_forward_hook(hook, *args, **kwargs)

    def register_forward_pre_hook(self, hook: Any, *args: Any, **kwargs: Any) -> Any:
        self._warn_inside_graph("forward pre-hook")
        return super().register_forward_pre_hook(hook, *args, **kwargs)

    def _warn_inside_graph(self, what: str) -> None:
        owners = [g.name for g in list(self._graph_owners)]
        if owners:
            warnings.warn(f"{type(self).__name__}: a {what} on a layer inside GraphOp "
                          f"{owners[0]!r} fires only on standalone calls; the GraphOp runs its "
                          "layers as one fused graph. Hook the GraphOp module, or use "
                          "GraphOp.register_plugin(point, plugin).", UserWarning, stacklevel=3)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        prof = profiling.module_profiler()
        if prof is None:
            return super().__call__(*args, **kwargs)
        t0 = time.perf_counter_ns()
        out = super().__call__(*args, **kwargs)
        profiling.record_module_call(prof, self, t0, out)
        return out
