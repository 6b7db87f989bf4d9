"""Accuracy comparison by DESIGN.md §5: relative error per element, scaled by
``max(|golden|, 1)``, with a per-dtype tolerance and share of elements that must pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import Dtype

__all__ = ["TOLERANCES", "CompareResult", "compare", "assert_close"]

# dtype -> (tolerance, share of elements that must pass)
TOLERANCES: dict[Dtype, tuple[float, float]] = {
    Dtype.FP32: (1e-4, 0.9999),
    Dtype.FP64: (1e-9, 1.0),
    Dtype.FP16: (1e-3, 0.999),
    Dtype.BF16: (4e-3, 0.996),
    Dtype.INT8: (1.0, 0.999),
}


@dataclass(frozen=True)
class CompareResult:
    passed: bool
    dtype: Dtype
    tolerance: float
    pass_ratio: float
    required_ratio: float
    max_error: float
    max_abs_diff: float
    shape_ok: bool = True

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict} [{self.dtype.name}] pass ratio {self.pass_ratio:.6f} "
                f"(need {self.required_ratio}), max rel err {self.max_error:.3g} "
                f"(tol {self.tolerance:g}), max |diff| {self.max_abs_diff:.3g}")


def _as_f64(x: Any) -> np.ndarray:
    from .tensor import is_tensor, to_numpy

    if is_tensor(x) and not isinstance(x, np.ndarray):
        if hasattr(x, "device") and getattr(x.device, "type", "cpu") not in ("cpu",):
            x = x.detach().cpu()  # comparing is a host-side check: copying is fine here
        x = to_numpy(x)
    return np.asarray(x).astype(np.float64)


def compare(actual: Any, golden: Any, dtype: Dtype | str | None = None) -> CompareResult:
    """Compare ``actual`` to ``golden`` under the tolerance of ``dtype`` (by default
    the dtype of ``actual``). Integer and bool results must match exactly."""
    from .tensor import describe, is_tensor

    if dtype is None:
        dtype = describe(actual).dtype if is_tensor(actual) else Dtype.of(np.asarray(actual).dtype)
    dtype = Dtype.of(dtype)
    a, g = _as_f64(actual), _as_f64(golden)
    if a.shape != g.shape:
        return CompareResult(False, dtype, 0.0, 0.0, 1.0, float("inf"), float("inf"), False)
    if a.size == 0:
        return CompareResult(True, dtype, 0.0, 1.0, 1.0, 0.0, 0.0)
    tol, share = TOLERANCES.get(dtype, (0.0, 1.0))
    diff = np.abs(a - g)
    both_nan = np.isnan(a) & np.isnan(g)
    diff = np.where(both_nan, 0.0, diff)
    same_inf = np.isinf(a) & np.isinf(g) & (np.sign(a) == np.sign(g))
    diff = np.where(same_inf, 0.0, diff)
    # a non-finite golden scales by 1 (a NaN golden matched by NaN has diff 0 above)
    err = diff / np.maximum(np.abs(np.where(np.isfinite(g), g, 1.0)), 1.0)
    err = np.where(np.isnan(err), np.inf, err)
    ratio = float(np.mean(err <= tol))
    return CompareResult(ratio >= share, dtype, tol, ratio, share, float(err.max()),
                         float(np.nanmax(diff)))


def assert_close(actual: Any, golden: Any, dtype: Dtype | str | None = None, what: str = "") -> None:
    """Raise AssertionError with the comparison summary unless ``actual`` passes."""
    r = compare(actual, golden, dtype)
    if not r.passed:
        a = _as_f64(actual)
        shape = f" shapes {a.shape} vs {_as_f64(golden).shape}" if not r.shape_ok else ""
        raise AssertionError(f"{what}: {r}{shape}")
