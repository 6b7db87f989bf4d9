"""Torch kernels for the norms: torch's fused layer_norm / rms_norm, computed in
fp32 for half types so results round once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernel


def _shape(p, x, w):
    if p.normalized_shape:
        return list(p.normalized_shape)
    return list(w.shape) if w is not None else [x.shape[-1]]


def _f32(t):
    return None if t is None else t.float()


def _layer_norm(p, x, w, b):
    return F.layer_norm(_f32(x), _shape(p, x, w), _f32(w), _f32(b), p.eps).to(x.dtype)


def _rms_norm(p, x, w):
    wf = _f32(w)
    if wf is not None and p.weight_offset:
        wf = wf + p.weight_offset
    return F.rms_norm(_f32(x), _shape(p, x, w), wf, p.eps).to(x.dtype)


@kernel("LayerNorm", impl="torch.nn.functional.layer_norm (fp32 compute)")
def layer_norm(p, ins):
    return [_layer_norm(p, ins["x"], ins["weight"], ins["bias"])]


@kernel("RmsNorm", impl="torch.nn.functional.rms_norm (fp32 compute)")
def rms_norm(p, ins):
    return [_rms_norm(p, ins["x"], ins["weight"])]


@kernel("AddLayerNorm", impl="add + torch layer_norm", launches=2)
def add_layer_norm(p, ins):
    s = torch.add(ins["x"], ins["residual"])
    return [_layer_norm(p, s, ins["weight"], ins["bias"]), s]


@kernel("AddRmsNorm", impl="add + torch rms_norm", launches=2)
def add_rms_norm(p, ins):
    s = torch.add(ins["x"], ins["residual"])
    return [_rms_norm(p, s, ins["weight"]), s]
