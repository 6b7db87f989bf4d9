"""``atb verify``: the accuracy of every op and every fusion rule on this machine's
backends, against the NumPy reference, by the precision standard of DESIGN.md §5.

    atb verify                                # everything: a table, exit 1 on a failure
    atb verify --op RmsNorm --dtype fp16      # filters (repeatable, comma lists)
    atb verify --backend torch --json out.json

Ops: each op's sample call (:mod:`atbcore.ops.samples`) in fp32, fp16, bf16 and,
where the op has one, its int8 form, run on every usable backend other than the
reference and compared output by output with ``numerics.compare`` (relative error
scaled by ``max(|golden|, 1)``; integer outputs exactly, int8 within ±1).

Fusion rules: graphs spelled from primitive ops (:mod:`.verify_graphs`) are fused
by the pipeline and run node by node on the backend; each rule that fired is
measured on its graph against the float32 NumPy run of the unfused graph with the
same (rounded) weights. fp32 must meet §5. A half-type graph rounds at every op,
so a whole layer misses one op's bound before and after fusion alike; there the
rule passes when it meets §5 or loses no accuracy (pass share no lower and max
error no higher than the unfused graph's on the reference, which is what a rule
at ``standard`` promises). ``aggressive`` rules change rounding by design: they
pass within the unfused graph's error plus ``AGGRESSIVE_SLACK`` (gelu_tanh
documents |error| <= 4.8e-4 per element).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable

__all__ = ["add_arguments", "run", "verify_ops", "verify_fusions", "Row", "AGGRESSIVE_SLACK"]

DTYPES = ("fp32", "fp16", "bf16", "int8")
AGGRESSIVE_SLACK = 1e-3
# a rule at standard may not be worse than the unfused graph by more than rounding noise
NO_WORSE = 1.25


@dataclass
class Row:
    """One line of the report."""

    kind: str          # "op" or "fusion"
    name: str
    backend: str
    dtype: str
    max_error: float
    pass_share: float
    verdict: str       # PASS, FAIL or SKIP
    detail: str = ""


def _split(values: Iterable[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for arg in values for v in arg.split(",") if v.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", action="append", help="only these ops or fusion rules (repeatable)")
    p.add_argument("--backend", action="append", help="only these backends (repeatable)")
    p.add_argument("--dtype", action="append", help=f"only these dtypes ({', '.join(DTYPES)})")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument("--no-fusions", action="store_true", help="check ops only")


def _backends(names: list[str] | None) -> list[Any]:
    from ..backends import backends, get_backend

    chosen = [get_backend(n) for n in names] if names else \
        [b for b in backends() if b.name != "numpy"]
    return [b for b in chosen if b.available()]


def _compare(got: Any, ref: Any, dtype: str) -> tuple[float, float, bool]:
    """(max error, pass share, passed) of one output."""
    import numpy as np

    from ..numerics import compare

    r = np.asarray(ref)
    if r.dtype.kind in "biu" and r.dtype != np.int8:  # ids, lengths: exact
        from ..tensor import to_numpy

        g = np.asarray(to_numpy(got)) if not isinstance(got, np.ndarray) else got
        same = g.shape == r.shape and np.array_equal(g, r)
        share = float(np.mean(g == r)) if g.shape == r.shape and r.size else float(same)
        return (0.0 if same else float("inf")), share, same
    res = compare(got, ref)
    return res.max_error, res.pass_ratio, res.passed


def verify_ops(ops: list[str] | None, backend_names: list[str] | None,
               dtypes: list[str] | None) -> list[Row]:
    """One row per (op, backend, dtype) of the sample calls."""
    from ..errors import AtbError
    from ..operation import Builder
    from ..ops.registry import get_op, list_operations
    from ..ops.samples import sample_call, sample_dtypes
    from ..tensor import convert

    rows: list[Row] = []
    names = [get_op(o).name for o in ops] if ops else list_operations()
    for op in names:
        for dt in sample_dtypes(op):
            if dtypes and dt not in dtypes:
                continue
            params, ins = sample_call(op, dt)
            ref = Builder(backend="numpy").build_operation(op, params).execute(
                [x.copy() for x in ins])
            for b in _backends(backend_names):
                params, ins = sample_call(op, dt)
                why = _not_supported(b, op, params, ins)
                if why:  # the backend says so itself: not a failure of accuracy
                    rows.append(Row("op", op, b.name, dt, 0.0, 0.0, "SKIP", why))
                    continue
                try:
                    got = Builder(backend=b.name).build_operation(op, params).execute(
                        [convert(x, b.native) for x in ins])
                except AtbError as e:
                    rows.append(Row("op", op, b.name, dt, float("inf"), 0.0, "FAIL", str(e)))
                    continue
                errs = [_compare(g, r, dt) for g, r in zip(got, ref)]
                ok = len(got) == len(ref) and all(e[2] for e in errs)
                rows.append(Row("op", op, b.name, dt, max(e[0] for e in errs),
                                min(e[1] for e in errs), "PASS" if ok else "FAIL",
                                "" if ok else f"outputs {[i for i, e in enumerate(errs) if not e[2]]}"
                                " outside the §5 bound"))
    return rows


def _not_supported(backend: Any, op: str, params: dict, ins: list) -> str:
    """The backend's own reasons against the sample call ('' when it takes it)."""
    from ..ops.registry import get_op
    from ..tensor import describe

    opdef = get_op(op)
    p = opdef.make_params(params)
    descs = opdef.bind(p, [None if x is None else describe(x) for x in ins])
    return "; ".join(backend.not_supported_reasons(opdef, p, descs))


def verify_fusions(rules: list[str] | None, backend_names: list[str] | None,
                   dtypes: list[str] | None) -> list[Row]:
    """One row per (fusion rule, backend, dtype); see the module docstring."""
    from ..dtypes import Dtype
    from ..numerics import compare
    from ..passes.pipeline import FusionConfig, run_pipeline
    from ..passes.rules import all_fusion_rules
    from .verify_graphs import GRAPHS, build, run_graph

    rows: list[Row] = []
    done: set[tuple[str, str, str]] = set()
    wanted = set(rules) if rules else {r.name for r in all_fusion_rules()}
    for dt in ("fp32", "fp16", "bf16"):
        if dtypes and dt not in dtypes:
            continue
        for gname in GRAPHS:
            graph, twin, x, level = build(gname, dt)
            fused, reports = run_pipeline(graph, FusionConfig(fusion_level=level))
            fired = [r.name.split(":", 1)[1] for r in reports
                     if r.changed and r.name.startswith("fuse:")]
            todo = [r for r in fired if r in wanted]
            if not todo:
                continue
            gold = run_graph(twin, x, "numpy")[0]
            xin = x.astype(Dtype.of(dt).numpy)
            unfused = compare(run_graph(graph, xin, "numpy")[0], gold, dt)
            for b in _backends(backend_names):
                res = compare(run_graph(fused, xin, b.name)[0], gold, dt)
                for rule in todo:
                    if (rule, b.name, dt) in done:
                        continue
                    done.add((rule, b.name, dt))
                    ok, why = _rule_verdict(res, unfused, dt, level)
                    rows.append(Row("fusion", rule, b.name, dt, res.max_error, res.pass_ratio,
                                    "PASS" if ok else "FAIL", f"{gname}: {why}"))
    missing = wanted - {r.name for r in rows}
    for rule in sorted(missing):  # a rule no graph exercises is reported, not hidden
        rows.append(Row("fusion", rule, "-", "-", float("nan"), 0.0, "SKIP",
                        "no verify graph exercises this rule"))
    return rows


def _rule_verdict(res: Any, unfused: Any, dtype: str, level: str) -> tuple[bool, str]:
    if level == "aggressive":
        ok = res.max_error <= max(unfused.max_error, res.tolerance) + AGGRESSIVE_SLACK
        return ok, f"aggressive: max error {res.max_error:.3g} vs unfused {unfused.max_error:.3g}"
    if res.passed:
        return True, "meets §5"
    if dtype == "fp32":
        return False, "fp32 outside §5"
    ok = res.pass_ratio >= unfused.pass_ratio and res.max_error <= unfused.max_error * NO_WORSE
    return ok, (f"whole graph in {dtype}: fused share {res.pass_ratio:.4f} / max "
                f"{res.max_error:.3g}, unfused {unfused.pass_ratio:.4f} / {unfused.max_error:.3g}")


def _print(rows: list[Row], seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"atb verify: {len(rows)} checks in {seconds:.1f} s")
    for col in ("op / fusion rule", "backend", "dtype", "max error", "pass share", "verdict"):
        table.add_column(col, justify="right" if col in ("max error", "pass share") else "left")
    style = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow"}
    for r in rows:
        label = r.name if r.kind == "op" else f"fusion:{r.name}"
        table.add_row(label, r.backend, r.dtype, f"{r.max_error:.3g}", f"{100 * r.pass_share:.2f} %",
                      f"[{style[r.verdict]}]{r.verdict}[/]")
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    from ..errors import AtbError
    from ..passes.rules import all_fusion_rules

    t0 = time.perf_counter()
    from ..plugin.manager import get_plugin_manager

    get_plugin_manager()  # plugins register their backends (MindSpore, Paddle ...) here
    names, backends_, dtypes = _split(args.op), _split(args.backend), _split(args.dtype)
    for d in dtypes or ():
        if d not in DTYPES:
            print(f"atb verify: unknown dtype {d!r}; one of {', '.join(DTYPES)}", file=sys.stderr)
            return 2
    rule_names = {r.name for r in all_fusion_rules()}
    op_names = [n for n in names if n not in rule_names] if names else None
    rules = [n for n in names if n in rule_names] if names else None
    try:
        rows = [] if names and not op_names else verify_ops(op_names, backends_, dtypes)
        if not args.no_fusions and (not names or rules):
            rows += verify_fusions(rules, backends_, dtypes)
    except AtbError as e:
        print(f"atb verify: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - t0
    _print(rows, seconds)
    failed = [r for r in rows if r.verdict == "FAIL"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "passed": not failed,
                       "rows": [asdict(r) for r in rows]}, f, indent=1, default=str)
    if failed:
        names_failed = sorted({(r.kind, r.name) for r in failed})
        print("FAILED: " + ", ".join(n if k == "op" else f"fusion:{n}" for k, n in names_failed),
              file=sys.stderr)
        for r in failed:
            print(f"  {r.name} [{r.backend}, {r.dtype}]: {r.detail}", file=sys.stderr)
        return 1
    return 0
