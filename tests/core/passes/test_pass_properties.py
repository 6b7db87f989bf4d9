"""Properties of the passes on random DAGs (hypothesis): results verify, compute
the same outputs, leave nothing for themselves to do (idempotent), and DCE/CSE
leave no dead node / duplicate behind; the whole pipeline keeps every output
within tolerance of the unfused graph."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings

import atbcore as atb
from atbcore.graph.analysis import canonical_op
from atbcore.graph.verify import verify
from atbcore.passes.cse import common_subexpression_elimination as cse
from atbcore.passes.dce import dead_code_elimination as dce
from atbcore.passes.fold_views import fold_views
from atbcore.passes.pipeline import FusionConfig, run_pipeline
from interp import run_graph
from random_dags import dags, inputs_for

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def same_outputs(a, b, exact=True):
    xs = inputs_for(a)
    for u, v in zip(run_graph(a, xs), run_graph(b, xs)):
        if exact:
            np.testing.assert_array_equal(u, v)
        else:
            atb.assert_close(v, u, "fp32", "after passes")


@SETTINGS
@given(dags())
def test_dce_properties(g):
    out = dce(g)
    verify(out)
    same_outputs(g, out)
    assert dce(out) == out
    needed = set(out.outputs)
    for n in reversed(out.nodes):  # every kept node feeds an output
        assert needed & set(n.outputs), n.name
        needed |= set(n.inputs)
    assert {k for k, _ in out.weights} <= {t for n in out.nodes for t in n.inputs}


@SETTINGS
@given(dags())
def test_cse_properties(g):
    out = cse(g)
    verify(out)
    same_outputs(g, out)
    assert cse(out) == out
    keys = [(canonical_op(n.op), n.params, n.inputs) for n in out.nodes
            if not set(n.outputs) & set(out.outputs)]
    assert len(keys) == len(set(keys))


@SETTINGS
@given(dags())
def test_fold_views_properties(g):
    out = dce(fold_views(g))
    verify(out)
    same_outputs(g, out)
    assert dce(fold_views(out)) == out
    # a view pair that cancels never survives unless its result is a graph output
    for n in out.nodes:
        if n.op in ("Transpose", "Reshape") and n.outputs[0] not in out.outputs:
            src = out.producers().get(n.inputs[0])
            assert src is None or src.op != n.op


@SETTINGS
@given(dags())
def test_pipeline_keeps_results_and_is_idempotent(g):
    out, _ = run_pipeline(g, FusionConfig(verify=True))
    same_outputs(g, out, exact=False)
    assert len(out.nodes) <= len(g.nodes)
    again, reports = run_pipeline(out, FusionConfig(verify=True))
    assert again == out
    assert not any(r.changed for r in reports)
