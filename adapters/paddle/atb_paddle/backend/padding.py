"""Paddle kernels for Unpad and Pad: a boolean mask of valid positions (right or
left padding) selects or places the tokens, with no Python loop over the batch."""

from __future__ import annotations

import paddle

from . import kernel
from .common import take

__all__: list[str] = []


def _valid_rows(lens, s: int, side: str):
    """Flat indices into [B * S] of the real tokens, in batch order."""
    pos = paddle.arange(s, dtype="int64").unsqueeze(0)              # [1, S]
    n = lens.astype("int64").unsqueeze(1)                           # [B, 1]
    mask = pos < n if side == "right" else pos >= s - n             # [B, S]
    return paddle.nonzero(mask.reshape([-1])).reshape([-1])


@kernel("Unpad", impl="paddle boolean-mask gather + cumsum", launches=3)
def unpad(p, ins):
    x, lens = ins["x"], ins["seq_lens"]
    b, s = x.shape[0], x.shape[1]
    rows = _valid_rows(lens, s, p.padding_side)
    packed = take(x.reshape([b * s, *x.shape[2:]]), rows, 0)        # [T, ...]
    cu = paddle.concat([paddle.zeros([1], dtype="int64"), paddle.cumsum(lens.astype("int64"))])
    return [packed, cu.astype("int32")]


@kernel("Pad", impl="paddle.full + index_put_ of the tokens", launches=2)
def pad(p, ins):
    x, lens = ins["packed"], ins["seq_lens"]
    b = lens.shape[0]
    s = p.max_seq_len if p.max_seq_len is not None else (int(lens.max()) if b else 0)
    y = paddle.full([b * s, *x.shape[1:]], p.pad_value, dtype=x.dtype)
    rows = _valid_rows(lens, s, p.padding_side)
    if rows.shape[0]:
        paddle.index_put_(y, (rows,), x)
    return [y.reshape([b, s, *x.shape[1:]])]
