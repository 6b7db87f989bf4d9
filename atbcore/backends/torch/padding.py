"""Torch kernels for Unpad and Pad: one boolean mask of valid positions
(right or left padding) selects or scatters the tokens, with no Python loop
over the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernel

__all__ = ["unpad", "pad"]


def _mask(lens: torch.Tensor, s: int, side: str) -> torch.Tensor:
    # mask: [B, S], True where the position holds a real token
    pos = torch.arange(s, device=lens.device)[None, :]
    lens = lens.long()[:, None]
    return pos < lens if side == "right" else pos >= s - lens


@kernel("Unpad", impl="torch boolean-mask select + cumsum", launches=6)
def unpad(p, ins):
    x, lens = ins["x"], ins["seq_lens"]
    packed = x[_mask(lens, x.shape[1], p.padding_side)]  # [T, ...]
    cu = F.pad(torch.cumsum(lens.long(), 0), (1, 0)).to(torch.int32)
    return [packed, cu]


@kernel("Pad", impl="torch.full + boolean-mask scatter", launches=5)
def pad(p, ins):
    x, lens = ins["packed"], ins["seq_lens"]
    b = lens.shape[0]
    s = p.max_seq_len if p.max_seq_len is not None else (int(lens.max()) if b else 0)
    y = torch.full((b, s) + tuple(x.shape[1:]), p.pad_value, dtype=x.dtype, device=x.device)
    y[_mask(lens, s, p.padding_side)] = x
    return [y]
