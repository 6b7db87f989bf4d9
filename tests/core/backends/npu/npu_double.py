"""A conformance double for torch_npu (test-only; never importable as ``torch_npu``).

Each function implements the documented op with torch on the CPU and first checks
every documented constraint on its arguments (``reference/torch_npu.md``: dims,
shapes, dtypes per SoC, keyword names, modes), raising :class:`ContractViolation` on a
breach so a kernel that calls torch_npu wrongly fails loudly here. ``calls`` records
which functions ran. Install it with ``atbcore.backends.npu.use_npu_module``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from npu_double_attention import AttentionOps, ContractViolation, require as _require

__all__ = ["NpuDouble", "ContractViolation", "SOC_VERSIONS"]

SOC_VERSIONS = {"A2": 223, "A3": 253, "310P": 202, "910": 102}
DEVICE_NAMES = {"A2": "Ascend910B1", "A3": "Ascend910_9392", "310P": "Ascend310P3",
                "910": "Ascend910A"}
_ALL = (torch.float16, torch.bfloat16, torch.float32)
_NO_BF16 = (torch.float16, torch.float32)


class NpuDouble(AttentionOps):
    """torch_npu's fused ops on CPU tensors, for SoC family ``soc`` ("A2", "310P", ...);
    ``nnal``: whether the ATB ops (``_npu_*``, NNAL's libatb.so) are there (None:
    let :func:`atbcore.backends.npu.nnal_reason` look at the environment)."""

    def __init__(self, soc: str = "A2", nnal: bool | None = True) -> None:
        self.soc, self.nnal = soc, nnal
        self.calls: list[str] = []
        self.npu = SimpleNamespace(
            get_soc_version=lambda: SOC_VERSIONS[soc], device_count=lambda: 1,
            get_device_name=lambda i=0: DEVICE_NAMES[soc],
            utils=SimpleNamespace(get_cann_version=self._cann_version))

    __version__ = "2.10.0.post4+double"  # the release vllm-ascend pinned (reference)

    @staticmethod
    def _cann_version(module="CANN"):
        _require(module == "CANN", "get_cann_version", f"module {module!r}")
        return "9.1.0"

    def _tensor(self, op: str, name: str, t: object) -> torch.Tensor:
        _require(isinstance(t, torch.Tensor), op, f"{name} must be a tensor, given {type(t)}")
        return t  # type: ignore[return-value]

    def _dtypes(self, op: str, t: torch.Tensor, allowed: tuple) -> None:
        _require(t.dtype in allowed, op, f"dtype {t.dtype} not supported on {self.soc}")

    # ------------------------------------------------------------------ norms

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        op = "npu_rms_norm"
        self.calls.append(op)
        x, gamma = self._tensor(op, "x", x), self._tensor(op, "gamma", gamma)
        _require(2 <= x.dim() <= 8, op, f"x must have 2-8 dims, given {x.dim()}")
        n = gamma.dim()
        _require(tuple(x.shape[x.dim() - n:]) == tuple(gamma.shape), op,
                 f"gamma shape {list(gamma.shape)} must be x's trailing dims {list(x.shape)}")
        _require(gamma.dtype == x.dtype, op, "gamma and x dtypes differ")
        self._dtypes(op, x, _ALL if self.soc in ("A2", "A3") else _NO_BF16)
        if self.soc == "310P":
            _require(x.shape[-1] * x.element_size() >= 32, op, "last axis < 32 bytes on 310P")
        _require(isinstance(epsilon, float) and epsilon > 0, op, f"epsilon {epsilon!r}")
        dims = tuple(range(x.dim() - n, x.dim()))
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_add_rms_norm(self, x1, x2, gamma, epsilon=1e-6):
        op = "npu_add_rms_norm"
        self.calls.append(op)
        x1, x2 = self._tensor(op, "x1", x1), self._tensor(op, "x2", x2)
        gamma = self._tensor(op, "gamma", gamma)
        _require(1 <= x1.dim() <= 8, op, f"x1 must have 1-8 dims, given {x1.dim()}")
        _require(x1.numel() > 0, op, "empty tensors are not supported")
        _require(x1.shape == x2.shape, op, "x1 and x2 shapes differ")
        _require(x1.dtype == x2.dtype == gamma.dtype, op, "x1, x2 and gamma dtypes differ")
        self._dtypes(op, x1, _NO_BF16 if self.soc == "310P" else _ALL)
        s = x1 + x2
        self.calls.pop()  # the inner call is part of this one
        y, rstd = self.npu_rms_norm(s if s.dim() >= 2 else s[None], gamma, epsilon)
        self.calls[-1] = op
        return y.reshape(s.shape), rstd, s

    # ------------------------------------------------------------------ activations

    def npu_swiglu(self, x, dim=-1):
        op = "npu_swiglu"
        self.calls.append(op)
        x = self._tensor(op, "x", x)
        _require(x.is_contiguous(), op, "x must be contiguous")
        _require(x.shape[dim] % 2 == 0, op, f"dim {dim} of {list(x.shape)} must be even")
        self._dtypes(op, x, _ALL)
        a, b = x.float().chunk(2, dim)
        return (F.silu(a) * b).to(x.dtype)

    # ------------------------------------------------------------------ RoPE

    def npu_rotary_mul(self, x, r1, r2, rotary_mode="half"):
        op = "npu_rotary_mul"
        self.calls.append(op)
        x = self._tensor(op, "x", x)
        r1, r2 = self._tensor(op, "r1", r1), self._tensor(op, "r2", r2)
        _require(rotary_mode in ("half", "interleave"), op, f"rotary_mode {rotary_mode!r}")
        _require(x.dim() in (3, 4), op, f"x must have 3-4 dims, given {x.dim()}")
        d = x.shape[-1]
        if self.soc in ("A2", "A3"):
            _require(d < 896 and d % 2 == 0, op, f"D must be even and < 896, given {d}")
            _require(x.shape[0] < 1000 and (x.dim() < 4 or x.shape[2] < 1000 and
                                             x.shape[1] < 1000), op, "B and N must be < 1000")
            self._dtypes(op, x, _ALL)
        else:
            _require(rotary_mode == "half" and x.dim() == 4 and d == 128, op,
                     f"{self.soc} takes half mode, 4-D, D = 128")
            self._dtypes(op, x, _NO_BF16)
        for name, r in (("r1", r1), ("r2", r2)):
            _require(r.dtype == x.dtype, op, f"{name} dtype {r.dtype} differs from x's {x.dtype}")
            _require(r.dim() == x.dim() and r.shape[-1] == d, op,
                     f"{name} shape {list(r.shape)} must be x's rank with last dim {d}")
            try:
                torch.broadcast_shapes(r.shape, x.shape)
            except RuntimeError:
                raise ContractViolation(f"{op}: {name} {list(r.shape)} does not broadcast "
                                        f"to x {list(x.shape)}") from None
        xf = x.float()
        if rotary_mode == "half":
            a, b = xf.chunk(2, -1)
            rot = torch.cat((-b, a), -1)
        else:
            pairs = xf.unflatten(-1, (-1, 2))
            rot = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
        return (xf * r1.float() + rot * r2.float()).to(x.dtype)
