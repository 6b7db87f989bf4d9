"""Memory planner: liveness, reuse, aliases, in-place, alignment; a property test
that simultaneously-live tensors never share bytes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from atbcore.dtypes import Dtype
from atbcore.graph.ir import Graph, Node
from atbcore.runtime.planner import ALIGNMENT, _best_fit, plan_memory
from atbcore.runtime.scheduler import flatten, schedule
from atbcore.tensor import TensorDesc
from dags import PLAIN, random_dag


def _n(name, op, ins, outs):
    return Node(name, op, PLAIN, tuple(ins), tuple(outs))


def _plan(g, sizes):
    descs = {t: TensorDesc((n,), Dtype.FP32) for t, n in sizes.items()}
    return plan_memory(g, schedule(g), descs)


def test_chain_reuses_dead_buffers():
    # x -> a -> b -> c -> y: a dies when c is made, so c takes a's bytes.
    g = Graph("chain", ("x",), ("y",), (
        _n("A", "RmsNorm", ["x"], ["a"]), _n("B", "RmsNorm", ["a"], ["b"]),
        _n("C", "RmsNorm", ["b"], ["c"]), _n("D", "RmsNorm", ["c"], ["y"])))
    p = _plan(g, {"x": 256, "a": 256, "b": 256, "c": 256, "y": 256})
    assert set(p.offsets) == {"a", "b", "c"}  # x input, y output: not in the arena
    assert p.offsets["c"] == p.offsets["a"] != p.offsets["b"]
    assert p.arena_bytes == 2 * 1024 and p.total_intermediate_bytes == 3 * 1024
    assert p.reuse_ratio == 1.5
    assert p.intervals["a"] == (0, 1) and p.intervals["c"] == (2, 3)


def test_inputs_of_a_node_and_its_outputs_never_share():
    g = Graph("pair", ("x",), ("y",), (
        _n("A", "RmsNorm", ["x"], ["a"]), _n("B", "RmsNorm", ["a"], ["b"]),
        _n("C", "RmsNorm", ["b"], ["y"])))
    p = _plan(g, {"x": 16, "a": 16, "b": 16, "y": 16})
    assert p.offsets["a"] != p.offsets["b"]


def test_best_fit_picks_the_smallest_hole_and_offsets_are_aligned():
    # big (1000 floats) and small (10) die early; late (10) fits in small's hole.
    g = Graph("fit", ("x",), ("y",), (
        _n("A", "RmsNorm", ["x"], ["big"]), _n("B", "RmsNorm", ["x"], ["small"]),
        _n("C", "RmsNorm", ["x"], ["keep"]),
        _n("D", "AddRmsNorm", ["big", "small"], ["u", "v"]),
        _n("E", "AddRmsNorm", ["u", "keep"], ["late", "v2"]),
        _n("F", "AddRmsNorm", ["late", "v2"], ["y", "v3"])))
    p = _plan(g, {"x": 8, "big": 1000, "small": 10, "keep": 1000, "u": 10, "v": 10,
                  "late": 10, "v2": 10, "v3": 10, "y": 8})
    assert all(o % ALIGNMENT == 0 for o in p.offsets.values())
    assert all(s % ALIGNMENT == 0 for s in p.sizes.values())
    assert p.sizes["big"] == 4032  # 4000 B rounded up to 64
    assert p.arena_bytes < p.total_intermediate_bytes


def test_best_fit_prefers_the_smaller_of_two_holes():
    # Placed largest first: A@0, B@2048, D@3072, G@4096, H@4864. When E (live 3..9)
    # comes, A and G are dead: holes [0, 2048) and [4096, 4864); E fits both and
    # best fit takes the smaller one (first fit would take 0).
    sizes = {"A": 2048, "B": 1024, "D": 1024, "G": 768, "H": 640, "E": 512}
    span = {"A": (0, 2), "B": (0, 9), "D": (0, 9), "G": (0, 2), "H": (0, 9), "E": (3, 9)}
    off = _best_fit(sizes, span)
    assert [off[k] for k in "ABDGH"] == [0, 2048, 3072, 4096, 4864]
    assert off["E"] == 4096


def test_reshape_aliases_its_input_and_extends_its_life():
    g = Graph("view", ("x",), ("y",), (
        _n("A", "RmsNorm", ["x"], ["a"]), _n("R", "Reshape", ["a"], ["a2"]),
        _n("B", "RmsNorm", ["x"], ["b"]), _n("C", "AddRmsNorm", ["a2", "b"], ["y", "s"])))
    p = _plan(g, {"x": 64, "a": 64, "a2": 64, "b": 64, "y": 64, "s": 64})
    assert "a2" not in p.offsets and p.aliases["a2"] == "a" and p.root("a2") == "a"
    assert p.offset_of("a2") == p.offsets["a"]
    assert p.intervals["a"] == (0, 3)  # alive until the view's reader
    assert p.offsets["a"] != p.offsets["b"]


def test_reshape_of_an_input_or_to_an_output_is_not_placed():
    g = Graph("io", ("x",), ("r2",), (
        _n("R", "Reshape", ["x"], ["r"]), _n("A", "RmsNorm", ["r"], ["a"]),
        _n("R2", "Reshape", ["a"], ["r2"])))
    p = _plan(g, {"x": 16, "r": 16, "a": 16, "r2": 16})
    assert p.offsets == {} and p.arena_bytes == 0
    assert {"r", "a", "r2"} <= p.external  # a is the output's memory: allocated fresh


def test_inplace_op_output_uses_its_input():
    # ReshapeAndCache declares outputs 0, 1 in place of inputs 2, 3.
    g = Graph("cache", ("k", "v", "slots"), ("y",), (
        _n("KC", "RmsNorm", ["k"], ["kc"]), _n("VC", "RmsNorm", ["v"], ["vc"]),
        _n("W", "ReshapeAndCache", ["k", "v", "kc", "vc", "slots"], ["kc2", "vc2"]),
        _n("Y", "AddRmsNorm", ["kc2", "vc2"], ["y", "s"])))
    p = _plan(g, {t: 32 for t in ["k", "v", "slots", "kc", "vc", "kc2", "vc2", "y", "s"]})
    assert p.aliases == {"kc2": "kc", "vc2": "vc"}
    assert "kc2" not in p.offsets and p.intervals["kc"][1] == 3


def test_dynamic_sized_tensors_are_left_to_run_time():
    g = Graph("dyn", ("x",), ("y",), (
        _n("A", "RmsNorm", ["x"], ["a"]), _n("B", "RmsNorm", ["a"], ["y"])))
    descs = {"x": TensorDesc((4,)), "a": TensorDesc((-1, 4)), "y": TensorDesc((4,))}
    p = plan_memory(g, schedule(g), descs)
    assert "a" in p.external and p.offsets == {}


def _roots(g):
    alias = {n.outputs[0]: n.inputs[0] for n in g.nodes if n.op == "Reshape"}

    def root(t):
        while t in alias:
            t = alias[t]
        return t
    return root


@settings(max_examples=80, deadline=None)
@given(random_dag(), st.data())
def test_simultaneously_live_tensors_never_overlap(g, data):
    order = flatten(schedule(g))
    root = _roots(g)
    produced = [t for n in order for t in n.outputs]
    sizes = {t: data.draw(st.integers(1, 5000)) for t in produced}
    descs = {t: TensorDesc((s,), Dtype.FP16) for t, s in sizes.items()}
    p = plan_memory(g, schedule(g), descs)
    # Liveness computed here, independently: [producer step, last step any alias is read].
    live: dict[str, list[int]] = {}
    for step, n in enumerate(order):
        for t in n.outputs:
            r = root(t)
            live.setdefault(r, [step, step])
        for t in n.inputs:
            if t in sizes:
                live[root(t)][1] = max(live[root(t)][1], step)
    pinned = {root(t) for t in g.outputs}
    for t in produced:  # placed exactly when it owns memory the graph does not export
        assert (t in p.offsets) == (root(t) == t and t not in pinned), t
    bufs = sorted(p.offsets)
    for i, a in enumerate(bufs):
        assert p.offsets[a] % ALIGNMENT == 0
        assert p.offsets[a] + 2 * sizes[a] <= p.arena_bytes
        for b in bufs[i + 1:]:
            (la, ha), (lb, hb) = live[a], live[b]
            if la <= hb and lb <= ha:
                sa, sb = p.offsets[a], p.offsets[b]
                assert sa + 2 * sizes[a] <= sb or sb + 2 * sizes[b] <= sa, (a, b)
    assert p.arena_bytes <= p.total_intermediate_bytes
