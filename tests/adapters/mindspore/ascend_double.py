"""A conformance double of MindSpore's Ascend-only fused ops (test-only): ``ops.rms_norm``,
``ops.add_rms_norm``, ``ops.rotary_position_embedding`` and ``ops.flash_attention_score``
implemented in float64 NumPy on CPU tensors, each first checking the documented
constraints of its arguments (MindSpore API docs) and raising ``ContractViolation``.
Every other name is forwarded to ``mindspore.ops``. Install it with
``atb_mindspore._env.use_ascend_ops``; ``calls`` records what ran."""

from __future__ import annotations

import mindspore
import numpy as np

from atbcore.tensor import from_numpy, to_numpy

__all__ = ["AscendOpsDouble", "ContractViolation"]

_FLOATS = ("Float16", "BFloat16", "Float32")
_HALF = ("Float16", "BFloat16")


class ContractViolation(AssertionError):
    """A call MindSpore documents as invalid."""


def _require(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise ContractViolation(f"{op}: {what}")


def _np(t) -> np.ndarray:
    return to_numpy(t).astype(np.float64)


def _like(a: np.ndarray, t) -> mindspore.Tensor:
    """``a`` as a MindSpore tensor of ``t``'s dtype (rounded once)."""
    return from_numpy(a.astype(to_numpy(t).dtype), "mindspore")


class AscendOpsDouble:
    """``mindspore.ops`` with its Ascend fused ops replaced by checked CPU versions."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        return getattr(mindspore.ops, name)

    def _tensor(self, op, name, t, dtypes=_FLOATS):
        _require(isinstance(t, mindspore.Tensor), op, f"{name} must be a Tensor, given {type(t)}")
        _require(str(t.dtype) in dtypes, op, f"{name} dtype {t.dtype} not in {dtypes}")

    def rms_norm(self, x, gamma, epsilon=1e-6):
        op = "rms_norm"
        self.calls.append(op)
        self._tensor(op, "x", x)
        self._tensor(op, "gamma", gamma)
        _require(isinstance(epsilon, float) and epsilon > 0, op, f"epsilon {epsilon!r}")
        n = gamma.ndim
        _require(tuple(x.shape[x.ndim - n:]) == tuple(gamma.shape), op,
                 f"gamma {gamma.shape} must be x's trailing dims {x.shape}")
        xf = _np(x)
        axes = tuple(range(x.ndim - n, x.ndim))
        rstd = 1.0 / np.sqrt((xf ** 2).mean(axes, keepdims=True) + epsilon)
        return _like(xf * rstd * _np(gamma), x), from_numpy(rstd.astype(np.float32), "mindspore")

    def add_rms_norm(self, x1, x2, gamma, epsilon=1e-6):
        op = "add_rms_norm"
        self._tensor(op, "x1", x1)
        self._tensor(op, "x2", x2)
        _require(x1.shape == x2.shape and x1.dtype == x2.dtype == gamma.dtype, op,
                 "x1, x2 shapes / x1, x2, gamma dtypes differ")
        s = _like(_np(x1) + _np(x2), x1)  # the sum, in x's dtype
        y, rstd = self.rms_norm(s, gamma, epsilon)
        self.calls[-1] = op
        return y, rstd, s

    def rotary_position_embedding(self, x, cos, sin, mode=0):
        op = "rotary_position_embedding"
        self.calls.append(op)
        self._tensor(op, "x", x)
        _require(isinstance(mode, int) and mode in (0, 1), op, f"mode {mode!r}")
        _require(x.ndim == 4, op, f"x must be 4-D, given {x.shape}")
        d = x.shape[-1]
        _require(d % 2 == 0 and d < 896, op, f"D {d} must be even and < 896")
        for name, t in (("cos", cos), ("sin", sin)):
            _require(t.dtype == x.dtype, op, f"{name} dtype {t.dtype} differs from x's {x.dtype}")
            _require(t.ndim == 4 and t.shape[-1] == d, op, f"{name} must be 4-D with D {d}")
            ok = all(c in (1, s) for c, s in zip(t.shape, x.shape))
            _require(ok, op, f"{name} {t.shape} does not broadcast to x {x.shape}")
        b, a1, a2 = x.shape[0], x.shape[1], x.shape[2]  # BNSD: N, S; BSND: S, N
        if mode == 0:
            _require(b < 1000 and min(a1, a2) < 1000, op, "B and N must be < 1000")
        else:
            _require(cos.shape[0] == 1, op, "interleaved mode: cos/sin 11SD or 1S1D only")
        xf, c, s = _np(x), _np(cos), _np(sin)
        if mode == 0:
            h = d // 2
            rot = np.concatenate([-xf[..., h:], xf[..., :h]], -1)
        else:
            rot = np.stack([-xf[..., 1::2], xf[..., 0::2]], -1).reshape(xf.shape)
        return _like(xf * c + rot * s, x)

    def flash_attention_score(self, query, key, value, head_num, real_shift=None,
                              drop_mask=None, padding_mask=None, attn_mask=None, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, keep_prob=1.0,
                              scalar_value=1.0, pre_tokens=2147483647, next_tokens=2147483647,
                              inner_precise=0, input_layout="BSH", sparse_mode=0):
        op = "flash_attention_score"
        self.calls.append(op)
        for name, t in (("query", query), ("key", key), ("value", value)):
            self._tensor(op, name, t, _HALF)
        _require(query.dtype == key.dtype == value.dtype, op, "q/k/v dtypes differ")
        _require(input_layout == "BNSD", op, f"the double models BNSD; given {input_layout!r}")
        _require(real_shift is None and drop_mask is None and padding_mask is None
                 and prefix is None and keep_prob == 1.0, op, "inference arguments only")
        _require(isinstance(scalar_value, float), op, f"scalar_value {scalar_value!r}")
        b, n, sq, d = query.shape
        _require(head_num == n and n % key.shape[1] == 0, op, f"head_num {head_num} / kv heads")
        _require(d % 16 == 0, op, f"D {d} must be a multiple of 16")
        skv = key.shape[2]
        masked = None
        if sparse_mode == 3:
            _require(attn_mask is not None and tuple(attn_mask.shape) == (2048, 2048)
                     and str(attn_mask.dtype) in ("UInt8", "Bool"), op,
                     "sparse_mode 3 needs the 2048x2048 uint8/bool compressed mask")
            _require(np.array_equal(to_numpy(attn_mask).astype(bool),
                                    np.triu(np.ones((2048, 2048), bool), 1)), op,
                     "the compressed mask must be the strict upper triangle")
            masked = np.arange(skv)[None] > np.arange(sq)[:, None] + (skv - sq)
        else:
            _require(sparse_mode == 0 and attn_mask is None, op, "not modelled by the double")
        g = n // key.shape[1]
        q, k, v = _np(query), np.repeat(_np(key), g, 1), np.repeat(_np(value), g, 1)
        s = q @ k.swapaxes(-1, -2) * scalar_value
        if masked is not None:
            s = np.where(masked, -np.inf, s)
        e = np.exp(s - s.max(-1, keepdims=True))
        return _like(e / e.sum(-1, keepdims=True) @ v, query)
