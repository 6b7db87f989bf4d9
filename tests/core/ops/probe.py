"""Hostile-input probe of every op through ``Builder().build_operation().execute()``.

Counts, per op, the failures issue 19 lists: exceptions that are not ``AtbError``,
silently wrong results (the torch backend against the NumPy reference, or a result
where the reference refuses the call), ``"successful"`` calls that left a given
output unwritten, failed calls that wrote an output (partial writes), and errors
whose message does not name the op that was built. Each op runs in its own
subprocess so a crash is counted rather than fatal::

    python3 tests/core/ops/probe.py            # table of counts over all ops
    python3 tests/core/ops/probe.py --op RoPE --show   # one op, every finding

The fuzz tests (``test_fuzz_ops.py``) reuse :func:`check_call` as their oracle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from typing import Any, Iterator

import numpy as np

KINDS = ("non_atb", "wrong", "unwritten", "partial", "misnamed")
BAD_PARAM_VALUES = ("x", 1.5, -1, 0, 2 ** 40, float("nan"), [1, "a"])


def _torch(x: Any) -> Any:
    from atbcore.tensor import to_torch

    return None if x is None else to_torch(np.array(x, copy=True))


def _snapshot(outs: list) -> list:
    import torch

    snap = []
    for o in outs:
        if isinstance(o, torch.Tensor):
            snap.append(None if o.device.type == "meta" else o.detach().clone())
        else:
            snap.append(np.array(o, copy=True))
    return snap


def _same(a: Any, b: Any) -> bool:
    import torch

    if b is None:
        return True
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                          and torch.equal(a.nan_to_num(), b.nan_to_num())))
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))


def _close(got: Any, ref: Any) -> bool:
    from atbcore.numerics import compare
    from atbcore.tensor import describe, to_numpy

    if got is None or ref is None:
        return got is ref
    if tuple(describe(got).shape) != tuple(np.shape(ref)):
        return False
    g = to_numpy(got.detach().cpu()) if hasattr(got, "detach") else np.asarray(got)
    r = np.asarray(ref)
    if r.dtype.kind in "biu" or g.dtype.kind in "biu":
        return np.array_equal(g.astype(np.int64), r.astype(np.int64))
    gf, rf = g.astype(np.float64), r.astype(np.float64)
    if not np.array_equal(np.isnan(gf), np.isnan(rf)) or not np.array_equal(
            np.isposinf(gf), np.isposinf(rf)) or not np.array_equal(np.isneginf(gf), np.isneginf(rf)):
        return False
    return compare(g, r).passed


def check_call(op: str, params: Any, inputs: list, outputs_kind: str | None = None
               ) -> list[tuple[str, str]]:
    """Run one call on the torch backend and on the NumPy reference; return the
    findings as ``(kind, detail)`` pairs (empty = behaved)."""
    import torch

    import atbcore as atb
    from atbcore.errors import AtbError

    found: list[tuple[str, str]] = []

    def named(e: AtbError, built: str) -> None:
        if not str(e).startswith(built + ":") and not str(e).startswith(built + " "):
            found.append(("misnamed", f"{type(e).__name__}: {e}"[:200]))

    # the reference
    ref, ref_err = None, None
    try:
        rop = atb.Builder(backend="numpy").build_operation(op, params)
        ref = rop.execute([None if x is None else np.array(x, copy=True) for x in inputs])
    except AtbError as e:
        ref_err = e
        named(e, op if rop_name(op) is None else rop_name(op))
    except Exception as e:  # noqa: BLE001 - counting is the point
        found.append(("non_atb", f"numpy {type(e).__name__}: {e}"[:200]))
        ref_err = e

    # the kernel, optionally writing into given outputs
    outs = None
    try:
        kop = atb.Builder(backend="torch").build_operation(op, params)
    except AtbError as e:
        named(e, rop_name(op) or op)
        return found
    except Exception as e:  # noqa: BLE001
        found.append(("non_atb", f"build {type(e).__name__}: {e}"[:200]))
        return found
    tins = [_torch(x) for x in inputs]
    if outputs_kind is not None and ref is not None:
        outs = _make_outputs(ref, outputs_kind)
    before = None if outs is None else _snapshot(outs)
    try:
        got = kop.execute(tins, outs)
    except AtbError as e:
        named(e, kop.name)
        if outs is not None:
            for i, (o, b) in enumerate(zip(outs, before)):
                if not _same(o, b):
                    found.append(("partial", f"output {i} written by a failed call ({e})"[:200]))
        return found
    except Exception as e:  # noqa: BLE001
        found.append(("non_atb", f"torch {type(e).__name__}: {e}"[:200]))
        if outs is not None:
            for i, (o, b) in enumerate(zip(outs, before)):
                if not _same(o, b):
                    found.append(("partial", f"output {i} written by a failed call"))
        return found
    if ref_err is not None:
        if isinstance(ref_err, AtbError):
            found.append(("wrong", f"torch ran where the reference refused: {ref_err}"[:200]))
        return found
    if outs is None:
        for i, (g, r) in enumerate(zip(got, ref)):
            if not _close(g, r):
                found.append(("wrong", f"output {i} differs from the reference"))
    else:
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and o.device.type == "meta":
                found.append(("unwritten", f"output {i} is a meta tensor, nothing was written"))
            elif i < len(ref) and not _close(o, ref[i]):
                found.append(("unwritten", f"output {i} ({outputs_kind}) not filled"))
    return found


def rop_name(op: str) -> str | None:
    from atbcore.ops.registry import get_op

    try:
        return get_op(op).name
    except Exception:  # noqa: BLE001
        return None


def _make_outputs(ref: list, kind: str) -> list:
    """Output buffers for a call whose reference results are ``ref``."""
    import torch

    from atbcore.tensor import to_torch

    outs = [to_torch(np.zeros_like(r)) for r in ref]
    if kind == "readonly":
        arrs = [np.zeros_like(r) for r in ref]
        for a in arrs:
            a.flags.writeable = False
        return arrs
    if kind == "meta":
        return [torch.empty(tuple(o.shape), dtype=o.dtype, device="meta") for o in outs]
    if kind == "last_bad_dtype" and len(outs) > 1:
        outs[-1] = outs[-1].to(torch.float64 if not outs[-1].dtype.is_floating_point
                               else torch.int64)
    if kind == "last_expanded" and len(outs) > 1:
        last = outs[-1]
        if last.dim() and last.shape[0] > 1:
            outs[-1] = last[:1].expand(last.shape)
    if kind == "last_readonly" and len(outs) > 1:
        a = np.zeros_like(ref[-1])
        a.flags.writeable = False
        return [np.zeros_like(r) for r in ref[:-1]] + [a]
    return outs


# ----------------------------------------------------------------------------- cases


def cases(op: str) -> Iterator[tuple[str, Any, list, str | None]]:
    """(label, params, inputs, outputs kind) of every probe of ``op``."""
    from atbcore.ops.registry import get_op
    from atbcore.ops.samples import sample_call

    params, ins = sample_call(op, "fp32")
    yield "sample", params, ins, None
    for kind in ("given", "readonly", "meta", "last_bad_dtype", "last_readonly", "last_expanded"):
        yield f"outputs {kind}", params, sample_call(op, "fp32")[1], kind
    fields = [f.name for f in dataclasses.fields(get_op(op).Params)]
    for f in fields:
        for v in BAD_PARAM_VALUES:
            yield f"param {f}={v!r}", {**params, f: v}, sample_call(op, "fp32")[1], None
    for i, x in enumerate(ins):
        if x is None:
            continue
        fresh = lambda: sample_call(op, "fp32")[1]  # noqa: E731
        if x.ndim:
            a = fresh()
            a[i] = np.zeros((0,) + x.shape[1:], x.dtype)
            yield f"input {i} zero rows", params, a, None
            a = fresh()
            a[i] = np.array(x.reshape(-1)[0])
            yield f"input {i} 0-d", params, a, None
        if x.dtype.kind == "f":
            for bad, label in ((np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")):
                a = fresh()
                a[i] = a[i].copy()
                a[i].reshape(-1)[:: max(1, a[i].size // 3)] = bad
                yield f"input {i} {label}", params, a, None
        else:
            a = fresh()
            a[i] = a[i].astype(np.float32)
            yield f"input {i} float ids", params, a, None
    for f, v in (("scale", -0.3), ("window", 2 ** 32 + 1), ("head_dim", 0),
                 ("max_seq_len", 2 ** 40)):
        if f in fields:
            yield f"edge {f}={v}", {**params, f: v}, sample_call(op, "fp32")[1], None


def probe_op(op: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {k: [] for k in KINDS}
    for label, params, ins, outs in cases(op):
        for kind, detail in check_call(op, params, ins, outs):
            found[kind].append(f"{label}: {detail}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op")
    ap.add_argument("--show", action="store_true")
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        import warnings

        warnings.simplefilter("ignore")
        print(json.dumps(probe_op(a.op)))
        return
    from atbcore.ops.registry import list_operations

    ops = [a.op] if a.op else list_operations()
    totals = {k: 0 for k in KINDS} | {"crash": 0}
    print(f"{'op':22}" + "".join(f"{k:>10}" for k in (*KINDS, "crash")))
    for op in ops:
        r = subprocess.run([sys.executable, __file__, "--child", "--op", op], capture_output=True,
                           text=True, timeout=600)
        if r.returncode:
            counts = {k: 0 for k in KINDS} | {"crash": 1}
            found = {"crash": [r.stderr[-400:]]}
        else:
            found = json.loads(r.stdout.strip().splitlines()[-1])
            counts = {k: len(v) for k, v in found.items()} | {"crash": 0}
        for k, n in counts.items():
            totals[k] += n
        print(f"{op:22}" + "".join(f"{counts[k]:>10}" for k in (*KINDS, "crash")), flush=True)
        if a.show:
            for k, items in found.items():
                for it in items:
                    print(f"    {k}: {it}")
    print(f"{'TOTAL':22}" + "".join(f"{totals[k]:>10}" for k in (*KINDS, "crash")))


if __name__ == "__main__":
    main()
