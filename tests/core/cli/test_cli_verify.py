"""``atb verify``: every op and fusion rule checked here against the reference; a
deliberately broken kernel makes it exit 1 naming the op (or the fusion rule)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from atbcore.cli.main import main
from atbcore.ops.registry import list_operations
from atbcore.ops.samples import sample_dtypes
from atbcore.passes.rules import all_fusion_rules


def test_verify_passes_for_every_op_and_rule(tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert main(["verify", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["passed"] and not [r for r in rows if r["verdict"] == "FAIL"]
    # a backend may decline a call (its own reasons, named) but torch takes every one
    assert all(r["detail"] for r in rows if r["verdict"] == "SKIP")
    assert all(r["verdict"] == "PASS" for r in rows if r["backend"] == "torch")
    ops = {(r["name"], r["dtype"]) for r in rows if r["kind"] == "op" and r["backend"] == "torch"}
    assert ops == {(op, dt) for op in list_operations() for dt in sample_dtypes(op)}
    fusions = {(r["name"], r["dtype"]) for r in rows if r["kind"] == "fusion"
               and r["backend"] == "torch"}
    assert fusions == {(rule.name, dt) for rule in all_fusion_rules()
                       for dt in ("fp32", "fp16", "bf16")}
    for r in rows:
        assert 0.0 <= r["pass_share"] <= 1.0 and r["max_error"] >= 0.0
    table = capsys.readouterr().out
    assert "max error" in table and "fusion:rope_attention" in table and "RmsNorm" in table


def test_filters_select_rows(tmp_path):
    out = tmp_path / "v.json"
    assert main(["verify", "--op", "RmsNorm,ffn", "--dtype", "fp16", "--backend", "torch",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["kind"], r["name"], r["backend"], r["dtype"]) for r in rows} == {
        ("op", "RmsNorm", "torch", "fp16"), ("fusion", "ffn", "torch", "fp16")}


def test_int8_forms_are_checked(tmp_path):
    out = tmp_path / "v.json"
    assert main(["verify", "--dtype", "int8", "--no-fusions", "--json", str(out)]) == 0
    assert {r["name"] for r in json.loads(out.read_text())["rows"]} == {
        "Linear", "LinearActivation", "RmsNormLinear", "ReshapeAndCache"}


def test_unknown_filter_values_are_usage_errors(capsys):
    assert main(["verify", "--dtype", "fp8"]) == 2
    assert main(["verify", "--op", "NoSuchOp"]) == 2
    assert "NoSuchOp" in capsys.readouterr().err


BROKEN = textwrap.dedent("""
    import dataclasses, sys
    from atbcore.backends import get_backend
    from atbcore.backends.torch import TORCH_KERNELS
    from atbcore.cli.main import main

    get_backend("torch").load()
    op = sys.argv[1]
    good = TORCH_KERNELS[op]

    def broken(p, ins, **kw):   # a kernel off by 1 %: a silent wrong answer
        return [y * 1.01 if y.is_floating_point() else y for y in good.fn(p, ins)]

    TORCH_KERNELS[op] = dataclasses.replace(good, fn=broken, writes_out=False)
    sys.exit(main(["verify", *sys.argv[2:]]))
""")


@pytest.mark.parametrize("op, args, named", [
    ("RmsNorm", ["--op", "RmsNorm"], "RmsNorm"),
    ("FusedFeedForward", ["--op", "ffn,ffn_residual", "--dtype", "fp32"], "fusion:ffn"),
])
def test_a_broken_kernel_fails_naming_the_op(op, args, named):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", BROKEN, op, *args], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "FAILED: " in r.stderr and named in r.stderr.split("FAILED: ")[1].splitlines()[0]
    assert "FAIL" in r.stdout
