"""What every op is made of: a frozen params dataclass, shape inference and a
NumPy reference implementation (the test oracle). Kernels live in backends.

An op module defines one :class:`OpDef` subclass per op and registers it::

    @register_op
    class RmsNorm(OpDef):
        name = "RmsNorm"
        Params = RmsNormParams
        inputs = ("x", "weight")
        outputs = ("y",)
        def infer_shape(self, p, ins): ...
        def reference(self, p, ins): ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import DtypeError, InputError, ParamsError, ShapeError
from ..tensor import TensorDesc

__all__ = [
    "Params",
    "OpDef",
    "FLOAT_DTYPES",
    "HINT_KEYS",
    "expect_rank",
    "expect_dtype",
    "expect_same_dtype",
    "expect_shape",
    "expect_dim",
    "f64",
]

FLOAT_DTYPES = frozenset({Dtype.FP32, Dtype.FP16, Dtype.BF16})

# Keys the seed articles pass that steer fusion or tuning rather than the math.
# They are accepted (and kept in ``Params.hints``) so that seed code runs; they
# never change results. Any other unknown key is an error.
HINT_KEYS = frozenset({
    "support_flash", "fuse_qkv", "fuse_output", "fuse_rope", "enable_opt", "is_dynamic",
    "fuse_with_attention", "fuse_gate_up", "fuse_activation", "fuse_down", "fuse_add",
    "intermediate_dtype", "elementwise_affine_fused", "memory_optimization",
})

# Names the seeds use, mapped to our field names; applied only where the params
# class has the target field.
COMMON_ALIASES = {
    "head_num": "num_heads",
    "kv_head_num": "num_kv_heads",
    "size_per_head": "head_dim",
    "is_causal": "causal",
    "rotary_base": "base",
    "epsilon": "eps",
    "layer_norm_eps": "eps",
    "rms_norm_eps": "eps",
    "activation": "activation_type",
    "has_bias": "bias",
}


@dataclass(frozen=True)
class Params:
    """Base of every op's params: frozen, hashable, validated on creation.

    Subclasses declare fields with defaults and may override :meth:`validate`;
    ``ALIASES`` maps extra accepted names to field names.
    """

    ALIASES: ClassVar[Mapping[str, str]] = {}
    OP: ClassVar[str] = "op"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "dtype" and v is not None and not isinstance(v, Dtype):
                object.__setattr__(self, f.name, _coerce_dtype(self.OP, v))
            else:
                if isinstance(v, list):
                    v = tuple(v)
                object.__setattr__(self, f.name, _check_type(self.OP, f.name, str(f.type), v))
        try:
            self.validate()
        except (TypeError, ValueError, OverflowError) as e:
            # a value of the right type that a validate() could not read (a list
            # holding a string, ...): still the user's params, still a ParamsError
            raise ParamsError(self.OP, "parameters", "values of the documented types",
                              f"{e}") from None

    def validate(self) -> None:
        """Raise :class:`ParamsError` for values out of range; subclasses override."""

    @classmethod
    def create(cls, op: str, values: Mapping[str, Any] | None = None) -> "Params":
        """Build from a dict of seed-style or canonical names, rejecting unknown keys."""
        values = dict(values or {})
        fields = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        hints: dict[str, Any] = {}
        for key, val in values.items():
            name = cls.ALIASES.get(key, key)
            if name not in fields and COMMON_ALIASES.get(key) in fields:
                name = COMMON_ALIASES[key]
            if name in fields:
                if name in kw and kw[name] != val:
                    raise ParamsError(op, f"parameter {name!r} given twice", "one value",
                                      f"{kw[name]!r} and {val!r}")
                kw[name] = val
            elif key in HINT_KEYS:
                hints[key] = val
            else:
                raise ParamsError(op, f"unknown parameter {key!r}",
                                  f"one of {sorted(fields | set(cls.ALIASES))}", repr(key))
        try:
            p = cls(**kw)
        except TypeError as e:  # missing required field
            raise ParamsError(op, "missing parameter", f"fields {sorted(fields)}", str(e)) from None
        if hints:
            object.__setattr__(p, "_hints", tuple(sorted(hints.items(), key=lambda kv: kv[0])))
        return p

    @property
    def hints(self) -> dict[str, Any]:
        """Advisory keys accepted from seed code (they do not change results)."""
        return dict(getattr(self, "_hints", ()))

    def replace(self, **kw: Any) -> "Params":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.name if isinstance(v, Dtype) else v
        return out

    def fail(self, what: str, expected: Any, given: Any) -> None:
        raise ParamsError(self.OP, what, expected, given)


# Plain scalar annotations checked (and normalised) before ``validate`` runs, so a
# string where an int belongs fails at build time, not deep inside a kernel.
_SCALAR_TYPES = {"int", "float", "bool", "str"}
# Ints beyond this cannot be sizes, dims or positions any kernel takes (int64).
INT_LIMIT = 2 ** 62


def _check_type(op: str, name: str, annotation: str, v: Any) -> Any:
    kinds = {k.strip() for k in annotation.split("|")}
    if v is None and "None" in kinds:
        return v
    scalar = kinds & _SCALAR_TYPES
    if not scalar or not kinds <= _SCALAR_TYPES | {"None"}:
        return v  # Any, Dtype, ...: the params class validates these itself
    is_bool = isinstance(v, (bool, np.bool_))
    if "bool" in scalar and is_bool:
        return bool(v)
    if "int" in scalar and isinstance(v, (int, np.integer)) and not is_bool:
        if abs(int(v)) > INT_LIMIT:
            raise ParamsError(op, f"parameter {name!r}", f"an int of magnitude <= 2**62", repr(v))
        return int(v)
    if "float" in scalar and isinstance(v, (int, float, np.integer, np.floating)) and not is_bool:
        return float(v)
    if "str" in scalar and isinstance(v, str):
        return v
    want = " or ".join(sorted(kinds - {"None"})) + (" or None" if "None" in kinds else "")
    raise ParamsError(op, f"parameter {name!r}", f"{want}", f"{v!r} ({type(v).__name__})")


def _coerce_dtype(op: str, v: Any) -> Dtype:
    try:
        return Dtype.of(v)
    except (ValueError, TypeError):
        raise ParamsError(op, "parameter 'dtype'", "a Dtype", repr(v)) from None


class OpDef:
    """The definition of one op: params type, inputs/outputs, shape inference and
    the NumPy reference. Instances are stateless singletons kept in the registry.

    ``inputs`` lists input names; a trailing ``?`` marks an optional input.
    ``inplace`` maps an output index to the input index it aliases (cache writes).
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    Params: ClassVar[type[Params]] = Params
    inputs: ClassVar[tuple[str, ...]] = ()
    outputs: ClassVar[tuple[str, ...]] = ("y",)
    inplace: ClassVar[Mapping[int, int]] = {}
    # every call must happen (communication between ranks): never merged by CSE
    effectful: ClassVar[bool] = False
    doc: ClassVar[str] = ""

    # ---------------------------------------------------------------- params
    def make_params(self, values: Mapping[str, Any] | Params | None = None, **kw: Any) -> Params:
        if isinstance(values, Params):
            if not isinstance(values, self.Params):
                raise ParamsError(self.name, "params type", self.Params.__name__, type(values).__name__)
            return values.replace(**kw) if kw else values
        merged = dict(values or {})
        merged.update(kw)
        return self.Params.create(self.name, merged)

    # ---------------------------------------------------------------- inputs
    @property
    def required_inputs(self) -> tuple[str, ...]:
        return tuple(n for n in self.inputs if not n.endswith("?"))

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(n.rstrip("?") for n in self.inputs)

    def num_outputs(self, p: Params, ins: Mapping[str, TensorDesc | None]) -> int:
        return len(self.outputs)

    def bind(self, p: Params, items: Sequence[Any]) -> dict[str, Any]:
        """Map positional inputs to names. Optional inputs are filled in order;
        ops with ambiguous optional inputs override this."""
        names = self.input_names
        req = self.required_inputs
        if len(items) < len(req) or len(items) > len(names):
            exp = f"{len(req)}" if len(req) == len(names) else f"{len(req)} to {len(names)}"
            raise InputError(self.name, "number of inputs", f"{exp} ({', '.join(self.inputs)})",
                             len(items))
        bound: dict[str, Any] = {n: None for n in names}
        for n, x in zip(names, items):
            bound[n] = x
        return bound

    # ---------------------------------------------------------------- semantics
    def infer_shape(self, p: Params, ins: Mapping[str, TensorDesc | None]) -> list[TensorDesc]:
        raise NotImplementedError

    def reference(self, p: Params, ins: Mapping[str, np.ndarray | None]) -> list[np.ndarray]:
        raise NotImplementedError

    def check_values(self, p: Params, ins: Mapping[str, Any]) -> None:
        """Data-dependent checks (ids in range, ...) on backend-native tensors;
        they run before any output is written. ``x.min()``/``x.max()`` work on
        both NumPy arrays and torch tensors."""

    def __repr__(self) -> str:
        return f"<op {self.name}>"


# ------------------------------------------------------------------- validation helpers


def expect_rank(op: str, name: str, d: TensorDesc, ranks: int | Sequence[int]) -> None:
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if d.rank not in ranks:
        exp = " or ".join(str(r) for r in ranks)
        raise ShapeError(op, f"input {name!r} rank", f"rank {exp}", f"shape {list(d.shape)}")


def expect_dtype(op: str, name: str, d: TensorDesc, allowed: Sequence[Dtype] | frozenset) -> None:
    if d.dtype not in allowed:
        exp = "/".join(sorted(x.name for x in allowed))
        raise DtypeError(op, f"input {name!r} dtype", exp, d.dtype.name)


def expect_same_dtype(op: str, a: str, da: TensorDesc, b: str, db: TensorDesc) -> None:
    if da.dtype != db.dtype:
        raise DtypeError(op, f"input {b!r} dtype must equal {a!r}", da.dtype.name, db.dtype.name)


def expect_shape(op: str, name: str, d: TensorDesc, shape: Sequence[int]) -> None:
    if tuple(d.shape) != tuple(shape):
        raise ShapeError(op, f"input {name!r} shape", list(shape), list(d.shape))


def expect_dim(op: str, name: str, d: TensorDesc, axis: int, size: int, what: str = "") -> None:
    got = d.shape[axis]
    if got != size and got != -1 and size != -1:
        label = what or f"dim {axis}"
        raise ShapeError(op, f"input {name!r} {label}", size, f"{got} (shape {list(d.shape)})")


def expect_param_dtype(op: str, p: Params, name: str, d: TensorDesc) -> None:
    """When params carry a ``dtype``, the input must have it."""
    want = getattr(p, "dtype", None)
    if want is not None and d.dtype != want:
        raise DtypeError(op, f"input {name!r} dtype (params dtype)", want.name, d.dtype.name)


def f64(x: np.ndarray | None) -> np.ndarray | None:
    """The reference computes in float64 from the exact input values."""
    return None if x is None else np.asarray(x).astype(np.float64)
