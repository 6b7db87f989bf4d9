"""The plan cache: compiled plans keyed by input signature, with dynamic-shape ranges
and power-of-two size buckets so varying sequence lengths reuse a plan.

How dims are named. A graph input's dims get names from, in order:
1. ``dim_names={"x": ("batch_size", "seq_len", "hidden_size")}`` given to the cache
   (``GraphOp(..., dim_names=...)``), ``None`` for an unnamed dim;
2. the convention: a rank-3 float input is ``[batch_size, seq_len, hidden_size]``
   (the seed's ``[B, S, H]``), a rank-2 integer input (token ids) is
   ``[batch_size, seq_len]``; other inputs have no named dims unless declared.

``set_dynamic_shape({"seq_len": (1, 8192), "batch_size": (1, 64)})`` declares ranges
(an int fixes a dim; names no input carries are kept and reported, not errors, so
the seed's ``{"num_heads": 32, "head_dim": 128}`` entries are accepted). A value
outside its range raises :class:`ShapeError` naming the dim, the range and the value.
``batch_size``, ``seq_len`` and ``kv_len`` (a KV cache's past length, see
``atbcore.graph.graph_op_kv``) are bucketed even when undeclared (range 1..inf).

Buckets. A named dynamic dim of value ``v`` falls in bucket ``min(hi, 2**ceil(log2 v))``;
the plan of a bucket is compiled for the bucket's upper bound (so its memory plan
holds any shape in the bucket) and reused for every shape in it. The first time an
exact signature is seen, its descriptors are inferred along the plan (real shape
errors surface here) and every node's backend choice is re-checked; if a kernel
would not accept the exact shape, or the bucket's upper bound is not a valid shape
for the graph (a dim pinned by weights), that signature gets an exact plan instead.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence

from ..backends import select_backend
from ..dtypes import Dtype
from ..errors import AtbError, ParamsError, PoolExhaustedError, ShapeError
from ..memory.plan_arena import PlanArena
from ..tensor import TensorDesc
from .executor import ExecPlan, _descs_of, infer_descs

__all__ = ["PlanCache", "bucket", "DEFAULT_BUCKETED"]

UNBOUNDED = None
DEFAULT_BUCKETED = {"batch_size": (1, UNBOUNDED), "seq_len": (1, UNBOUNDED),
                    "kv_len": (0, UNBOUNDED)}
_INT = {Dtype.INT8, Dtype.UINT8, Dtype.INT32, Dtype.INT64}


def bucket(v: int, hi: int | None) -> int:
    """The bucket's upper bound for value ``v``: the next power of two, capped at ``hi``."""
    b = 1 << max(0, int(v) - 1).bit_length()
    return b if hi is None else min(b, hi)


def _convention(d: TensorDesc) -> tuple[str | None, ...]:
    if d.rank == 3 and d.dtype not in _INT:
        return ("batch_size", "seq_len", "hidden_size")
    if d.rank == 2 and d.dtype in _INT:
        return ("batch_size", "seq_len")
    return (None,) * d.rank


class PlanCache:
    """Plans of one graph keyed by (bucketed) input signature.

    ``build(input_descs, framework) -> ExecPlan`` compiles a plan (a builder that
    passes :attr:`arena` to ``build_plan`` gives all plans one arena, sized for the
    largest, and one lock: see :mod:`atbcore.memory.plan_arena`);
    ``get(input_descs, framework=None)`` returns ``(plan, exact_descs)``; the
    caller's framework is part of the key (it can change which backend runs).
    ``stats()`` reports hits, misses and plans held; ``arena.stats()`` the arena.
    """

    def __init__(self, build: Callable[[Mapping[str, TensorDesc], str | None], ExecPlan], *,
                 name: str = "graph", inputs: Sequence[str] = (),
                 dim_names: Mapping[str, Sequence[str | None]] | None = None,
                 dynamic_shape: Mapping[str, Any] | None = None, max_plans: int = 32,
                 backend: str | None = None) -> None:
        self.build = build
        self.name = name
        self.inputs = tuple(inputs)
        self.dim_names = {k: tuple(v) for k, v in (dim_names or {}).items()}
        self.backend = backend
        self.max_plans = max_plans
        self.ranges: dict[str, tuple[int, int | None]] = dict(DEFAULT_BUCKETED)
        self.declared: dict[str, tuple[int, int | None]] = {}
        self._plans: OrderedDict[Any, ExecPlan] = OrderedDict()
        self._exact: dict[tuple, tuple[Any, dict[str, TensorDesc]]] = {}
        self._unbucketable: set[Any] = set()
        self._raw: dict[tuple, tuple] = {}  # raw tensor signature -> exact signature
        self.hits = self.misses = self.evictions = 0
        self.arena = PlanArena(name)
        if dynamic_shape:
            self.set_dynamic_shape(dynamic_shape)

    # ------------------------------------------------------------------ config
    def set_dynamic_shape(self, ranges: Mapping[str, Any]) -> None:
        """Declare dim ranges: ``{"seq_len": (1, 8192), "num_heads": 32}``. Clears plans."""
        parsed: dict[str, tuple[int, int | None]] = {}
        for name, r in ranges.items():
            if isinstance(r, (int,)) and not isinstance(r, bool):
                lo = hi = int(r)
            elif isinstance(r, (tuple, list)) and len(r) == 2:
                lo, hi = int(r[0]), (None if r[1] is None else int(r[1]))
            else:
                raise ParamsError(self.name, f"dynamic shape {name!r}", "(min, max) or an int",
                                  repr(r))
            if lo < 0 or (hi is not None and hi < lo):
                raise ParamsError(self.name, f"dynamic shape {name!r}", "0 <= min <= max",
                                  repr(r))
            parsed[str(name)] = (lo, hi)
        self.declared = parsed
        self.ranges = {**DEFAULT_BUCKETED, **parsed}
        self.clear()

    def names_of(self, tid: str, d: TensorDesc) -> tuple[str | None, ...]:
        names = self.dim_names.get(tid)
        if names is None:
            return _convention(d)
        if len(names) != d.rank:
            raise ShapeError(self.name, f"input {tid!r} rank (dim_names declares {names})",
                             len(names), f"shape {list(d.shape)}")
        return names

    def unused_dims(self, input_descs: Mapping[str, TensorDesc]) -> list[str]:
        """Declared dim names that no input carries (accepted, without effect)."""
        seen = {n for t, d in input_descs.items() for n in self.names_of(t, d) if n}
        return sorted(n for n in self.declared if n not in seen)

    # ------------------------------------------------------------------ keys
    def check(self, descs: Mapping[str, TensorDesc]) -> None:
        """Raise :class:`ShapeError` for a named dim outside its declared range."""
        for tid, d in descs.items():
            for axis, (n, v) in enumerate(zip(self.names_of(tid, d), d.shape)):
                if n is None or n not in self.declared:
                    continue
                lo, hi = self.declared[n]
                if v < lo or (hi is not None and v > hi):
                    rng = f"{lo}" if lo == hi else f"[{lo}, {'inf' if hi is None else hi}]"
                    raise ShapeError(self.name, f"dynamic dim {n!r} (input {tid!r} dim {axis})",
                                     f"{rng} (set_dynamic_shape)", v)

    def bucketed(self, descs: Mapping[str, TensorDesc]) -> dict[str, TensorDesc]:
        """The representative descriptors: named dynamic dims at their bucket's bound."""
        out = {}
        for tid, d in descs.items():
            shape = list(d.shape)
            for axis, n in enumerate(self.names_of(tid, d)):
                if n in self.ranges and shape[axis] >= 1:
                    lo, hi = self.ranges[n]
                    if lo != hi:
                        shape[axis] = max(lo, bucket(shape[axis], hi))
            out[tid] = d.replace(shape=tuple(shape))
        return out

    @staticmethod
    def _sig(descs: Mapping[str, TensorDesc]) -> tuple:
        return tuple(sorted(descs.items()))

    # ------------------------------------------------------------------ lookup
    def get_raw(self, raw: tuple) -> tuple[ExecPlan, dict[str, TensorDesc]] | None:
        """The plan a previous :meth:`get` with this ``raw`` key found (a signature
        the caller reads off its tensors without describing them), or None."""
        exact_sig = self._raw.get(raw)
        hit = None if exact_sig is None else self._exact.get(exact_sig)
        if hit is None or hit[0] not in self._plans:
            return None
        self.hits += 1
        self._plans.move_to_end(hit[0])
        return self._plans[hit[0]], hit[1]

    def get(self, descs: Mapping[str, TensorDesc], framework: str | None = None,
            raw: tuple | None = None) -> tuple[ExecPlan, dict[str, TensorDesc]]:
        """The plan for these input descriptors (of ``framework``'s tensors) and the
        exact descriptors of every tensor; ``raw`` (see :meth:`get_raw`) is
        remembered as another key of this signature."""
        exact_sig = (framework, self._sig(descs))
        if raw is not None:
            if len(self._raw) >= 4 * self.max_plans:
                self._raw.pop(next(iter(self._raw)))
            self._raw[raw] = exact_sig
        hit = self._exact.get(exact_sig)
        if hit is not None and hit[0] in self._plans:
            self.hits += 1
            self._plans.move_to_end(hit[0])
            return self._plans[hit[0]], hit[1]
        self.check(descs)
        rep = self.bucketed(descs)
        key = ("bucket", framework, self._sig(rep))
        if key in self._unbucketable:
            key = ("exact", *exact_sig)
        plan = self._plans.get(key)
        if plan is not None:
            all_descs = self._validate(plan, descs)
            if all_descs is not None:
                self.hits += 1
                self._plans.move_to_end(key)
                self._exact[exact_sig] = (key, all_descs)
                return plan, all_descs
            key = ("exact", *exact_sig)  # a kernel refuses the exact shape: own plan
        self.misses += 1
        try:
            plan = self.build(rep if key[0] == "bucket" else descs, framework)
        except AtbError as e:
            if key[0] != "bucket" or isinstance(e, PoolExhaustedError):
                raise
            # The bucket bound is not a valid shape for this graph: plan exactly.
            self._unbucketable.add(key)
            key = ("exact", *exact_sig)
            plan = self.build(descs, framework)
        all_descs = self._validate(plan, descs) if key[0] == "bucket" else plan.descs
        if all_descs is None:  # built for the bound, but a kernel refuses the exact shape
            plan.release()
            self._unbucketable.add(key)
            key = ("exact", *exact_sig)
            plan = self.build(descs, framework)
            all_descs = plan.descs
        self._store(key, plan)
        self._exact[exact_sig] = (key, all_descs)
        return plan, all_descs

    def _validate(self, plan: ExecPlan, descs: Mapping[str, TensorDesc]
                  ) -> dict[str, TensorDesc] | None:
        """Exact descriptors along ``plan`` (raises real shape errors), or None when
        some node would dispatch to another backend at this exact shape."""
        all_descs, bindings = infer_descs(plan.graph, plan.levels, descs)
        for c in plan.calls:
            b = bindings[c.node]
            bd = {k: _descs_of(v, all_descs) for k, v in b.items()}
            try:
                be, _ = select_backend(c.opdef, c.params, bd, self.backend, plan.framework)
            except AtbError:
                return None
            if be.name != c.backend:
                return None
        return all_descs

    def _store(self, key: Any, plan: ExecPlan) -> None:
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > self.max_plans:
            old_key, old = self._plans.popitem(last=False)
            old.release()
            self.evictions += 1
            for s in [s for s, (k, _) in self._exact.items() if k == old_key]:
                del self._exact[s]

    # ------------------------------------------------------------------ state
    @property
    def plans(self) -> list[ExecPlan]:
        return list(self._plans.values())

    def last_plan(self) -> ExecPlan | None:
        return next(reversed(self._plans.values()), None)

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "plans": len(self._plans),
                "evictions": self.evictions, "signatures": len(self._exact)}

    def clear(self) -> None:
        """Release every plan (their arenas go back to the pool)."""
        for p in self._plans.values():
            p.release()
        self._plans.clear()
        self._exact.clear()
        self._raw.clear()
        self._unbucketable.clear()
