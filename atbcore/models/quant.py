"""Quantized Linears of a lowered model (``decoder_layers(..., quantize=...)``): every
projection (merged QKV, output, gate|up, down, LM head) becomes a core ``Linear`` with
``quant="w8"`` (int8 weights, a scale per output channel; activations read as int8 blocks
of 32 inputs, as llama.cpp's Q8_0), ``"w8a8"`` (int8 weights, the clip of least error per
channel: :func:`~atbcore.ops.linear_quant.quantize_w8a8`; 8-bit activations per row) or ``"w4"`` (4-bit codes, fp16 scales per group of 32
inputs): :mod:`atbcore.ops.linear_quant`. The one pass pipeline then fuses the norms
into them and the residual adds into their epilogues as it does for float Linears, and
the CPU binders pack each into its kernel's layout once.

A weight loaded from a GPTQ/AWQ checkpoint carries its exact 4-bit codes: the loader
registers them in :data:`PREQUANTIZED` under the float tensor they dequantize to, and
``"w4"`` packs those codes as they are instead of quantizing the tensor again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ParamsError
from ..graph import layers as L
from ..graph.layers import Layer, host_array
from ..ops.linear import quantize_w8
from ..ops.linear_quant import W4_GROUP, quantize_w4, quantize_w8a8

if TYPE_CHECKING:
    from ..graph.sequential import LoweringContext

__all__ = ["QUANT_MODES", "W4Codes", "PREQUANTIZED", "QuantLinear", "linear_layer",
           "check_quantize", "quantized_experts"]

QUANT_MODES = (None, "w8", "w8a8", "w4")


def check_quantize(quantize: Any) -> str | None:
    """``quantize`` if it is one of :data:`QUANT_MODES`, else ParamsError."""
    if quantize not in QUANT_MODES:
        raise ParamsError("decoder_layers", "quantize", "None, 'w8', 'w8a8' or 'w4'",
                          repr(quantize))
    return quantize


@dataclass(frozen=True, eq=False)
class W4Codes:
    """A ``[n, k]`` weight's w4 codes as a checkpoint stores them: ``codes`` uint8
    ``[n, K']`` (K' >= k, a multiple of ``group``), ``scales`` fp16 ``[n, K'/group]``,
    ``zeros`` uint8 like scales or None (z = 8); tensors of any framework."""

    codes: Any
    scales: Any
    zeros: Any
    group: int


class _Prequantized:
    """float weight tensor -> its checkpoint's exact codes, held while the tensor lives
    (keyed by identity: tensors compare elementwise)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, W4Codes]] = {}

    def register(self, tensor: Any, codes: W4Codes) -> None:
        key = id(tensor)
        self._by_id[key] = (weakref.ref(tensor, lambda _r, k=key: self._by_id.pop(k, None)),
                            codes)

    def get(self, tensor: object) -> W4Codes | None:
        hit = self._by_id.get(id(tensor))
        return hit[1] if hit is not None and hit[0]() is tensor else None


PREQUANTIZED = _Prequantized()


class QuantLinear(L.Linear):
    """One quantized core ``Linear`` node over given quantized weights (``weight``,
    ``scale``, optional ``bias`` and ``zeros``), which keep their dtypes (int8 / uint8
    codes, fp32 or fp16 scales); ``params``: the Linear's (``quant``, ``group_size``).
    A :class:`~atbcore.graph.layers.Linear` to the layers around it (an attention after
    it reads its output as packed QKV)."""

    _SLOTS = ("weight", "bias", "scale", "residual", "zeros")

    def __init__(self, name: str, params: dict[str, Any], weights: dict[str, Any]) -> None:
        w = host_array(weights["weight"])
        super().__init__(name, out_features=int(w.shape[0]), in_features=int(w.shape[1]),
                         bias="bias" in weights)
        self.params = dict(params, bias=self.bias)
        self._weights = {k: host_array(v) for k, v in weights.items()}

    def _weight_names(self) -> set[str]:
        return set(self._weights)

    def _weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self._weights.items()}

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name = ctx.name_of(self)
        ins = [x] + [ctx.builder.add_weight(f"{name}.{k}", self._weights[k])
                     if k in self._weights else "" for k in self._SLOTS]
        while not ins[-1]:
            ins.pop()
        return ctx.builder.add_node("Linear", ins, self.params, name=name)[0]


def _float32(ws: list) -> np.ndarray:
    return np.concatenate([host_array(w).astype(np.float32) for w in ws])


def _w4_parts(tensors: list, arrays: list) -> tuple[dict[str, np.ndarray], int]:
    """Codes, scales and zero points of the weights merged along outputs (a
    checkpoint's own codes where :data:`PREQUANTIZED` has them)."""
    known = [PREQUANTIZED.get(t) for t in tensors]
    group = next((c.group for c in known if c is not None), W4_GROUP)
    parts = []
    for c, a in zip(known, arrays):
        k = a.shape[1]
        if c is not None and c.group == group:
            parts.append((host_array(c.codes)[:, :k], host_array(c.scales).astype(np.float16),
                          None if c.zeros is None else host_array(c.zeros)))
        else:
            parts.append(quantize_w4(a, group, symmetric=True))
    out = {"weight": np.ascontiguousarray(np.concatenate([p[0] for p in parts])),
           "scale": np.ascontiguousarray(np.concatenate([p[1] for p in parts]))}
    if any(p[2] is not None for p in parts):
        out["zeros"] = np.ascontiguousarray(np.concatenate(
            [p[2] if p[2] is not None else np.full(p[1].shape, 8, np.uint8) for p in parts]))
    return out, group


# per-channel scales of fp16 / bf16 weights are values of that dtype: (smallest normal, max)
_SCALE_RANGE = {"float16": (2.0 ** -14, 65504.0), "bfloat16": (2.0 ** -126, 3.3895e38)}


def _quantize_w8(arrays: list) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes and fp32 per-output-channel scales of the weights merged along
    outputs (:func:`~atbcore.ops.linear.quantize_w8`). For fp16 / bf16 weights each
    scale is rounded to that dtype first and the codes are quantized against it: a
    kernel that takes its scales in the activations' dtype (torch_npu's
    ``npu_weight_quant_batchmatmul``, bf16 int8pack matmuls) then reads exactly the
    reference's scales instead of rounding them away from it."""
    w = _float32(arrays)
    limits = _SCALE_RANGE.get(str(arrays[0].dtype))
    if limits is None:
        return quantize_w8(w)
    amax = np.abs(w).max(axis=1)
    exact = (amax / np.float32(127.0)).astype(arrays[0].dtype).astype(np.float32)
    scale = np.where(amax > 0, np.clip(exact, *limits), 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def linear_layer(name: str, weights: list, biases: list, quantize: str | None,
                 to_array: Any = host_array, w8a8_levels: int = 127) -> Layer:
    """The Linear over ``weights`` (``[out, in]`` each, merged along outputs) and their
    ``biases`` (None entries: zeros where another part has one), float or quantized by
    ``quantize``; ``to_array`` turns a framework tensor into a host array;
    ``w8a8_levels``: the largest w8a8 weight code (:func:`~atbcore.ops.linear_quant.
    quantize_w8a8`)."""
    arrays = [to_array(w) for w in weights]
    bias = None
    if any(b is not None for b in biases):
        bias = np.concatenate([to_array(b) if b is not None else
                               np.zeros(a.shape[0], arrays[0].dtype)
                               for a, b in zip(arrays, biases)])
    if quantize is None:
        w = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        lin = L.Linear(name, out_features=w.shape[0], bias=bias is not None)
        return lin.load_weights({"weight": w, **({"bias": bias} if bias is not None else {})})
    params: dict[str, Any] = {"quant": quantize}
    if quantize == "w4":
        qw, params["group_size"] = _w4_parts(weights, arrays)
    elif quantize == "w8a8":
        scale_dtype = arrays[0].dtype if str(arrays[0].dtype) in _SCALE_RANGE else None
        wq, scale = quantize_w8a8(_float32(arrays), w8a8_levels, scale_dtype=scale_dtype)
        qw = {"weight": wq, "scale": scale}
    else:
        wq, scale = _quantize_w8(arrays)
        qw = {"weight": wq, "scale": scale}
    if bias is not None:
        qw["bias"] = bias
    return QuantLinear(name, params, qw)


def quantized_experts(stacked: Any, quantize: str, part: str) -> dict[str, np.ndarray]:
    """A MoE node's weights ``w_<part>`` ``[E, rows, in]`` quantized per expert as
    :func:`linear_layer` quantizes one Linear: ``{"w_<part>", "<part>_scale"[,
    "<part>_zeros"]}`` (``part``: "gate_up" or "down")."""
    experts = [host_array(w) for w in stacked]
    layers = [linear_layer("expert", [w], [None], quantize) for w in experts]
    out = {f"w_{part}": np.stack([q.weights()["weight"] for q in layers]),
           f"{part}_scale": np.stack([q.weights()["scale"] for q in layers])}
    if all("zeros" in q.weights() for q in layers):
        out[f"{part}_zeros"] = np.stack([q.weights()["zeros"] for q in layers])
    return out
