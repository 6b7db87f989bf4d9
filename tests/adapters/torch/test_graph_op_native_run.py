"""A GraphOp call's C calls as one native run (atbcore/runtime/native_run.py): the
seed MLP (LayerNorm, Linear, SiLU, Linear, ResidualAdd) records its four C calls once;
each later call with a new input and a fresh output relocates their addresses in the
recorded blocks instead of recording again. Checked against a NumPy float64
reference per call, against the per-call bound path (bit for bit, 1 and 2 threads),
with earlier outputs left intact, and with inputs that cannot be relocated (not
contiguous) running correctly through Python."""

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.backends.cpu_kernels.counting import LaunchCounter
from atbcore.runtime import native_run
from seed_mlp import HIDDEN, mlp_reference, seed_mlp

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels are not built here")

_mlp, _reference = seed_mlp, mlp_reference


def _program(mlp):
    core = mlp.core
    return core.last_plan.programs[core._hot[2]]


@pytest.mark.parametrize("rows", [1, 3])
def test_calls_relocate_and_match_reference_and_per_call(rows):
    mlp, w = _mlp()
    xs = [torch.randn(1, rows, HIDDEN, generator=torch.Generator().manual_seed(s))
          for s in range(6)]
    keep = torch.get_num_threads()
    got = {}
    try:
        with torch.no_grad():
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for native in (True, False):
                    native_run.NATIVE[0] = native
                    got[threads, native] = [mlp(x) for x in xs]
    finally:
        native_run.NATIVE[0] = True
        torch.set_num_threads(keep)
    ref = got[1, False]
    for k, outs in got.items():
        for i, (o, r) in enumerate(zip(outs, ref)):
            assert torch.equal(o, r), f"threads/native {k}, call {i}"
    # every output is its own tensor, intact after the later calls
    assert len({o.data_ptr() for o in got[2, True]}) == len(xs)
    for x, o in zip(xs, got[2, True]):
        np.testing.assert_allclose(o.double().numpy(), _reference(x, w), rtol=1e-4,
                                   atol=1e-4)
    # one native run of the four C calls, and no call recorded again once it runs
    prog = _program(mlp)
    ops = prog.native.ops
    assert [type(o) is int for o in ops] == [False] and len(ops[0].pairs) == 4
    again, orig = [], type(prog.native)._again

    def spy(self, seg, item, env):
        again.append(item[0])
        return orig(self, seg, item, env)
    type(prog.native)._again = spy
    try:
        with torch.no_grad():
            outs = [mlp(x.clone()) for x in xs]
    finally:
        type(prog.native)._again = orig
    assert again == []
    for o, r in zip(outs, ref):
        assert torch.equal(o, r)


def test_input_not_contiguous_runs_through_python_and_matches():
    mlp, w = _mlp(1)
    with torch.no_grad():
        x = torch.randn(1, 2, HIDDEN, generator=torch.Generator().manual_seed(5))
        mlp(x), mlp(x.clone())  # recorded, then relocated
        wide = torch.randn(1, 2, 2 * HIDDEN, generator=torch.Generator().manual_seed(6))
        y = wide[..., ::2]  # same shape, not contiguous
        for _ in range(2):  # the same object twice: no recorded copy's address reused
            np.testing.assert_allclose(mlp(y).double().numpy(), _reference(y, w),
                                       rtol=1e-4, atol=1e-4)
        out = mlp(x)
    np.testing.assert_allclose(out.double().numpy(), _reference(x, w), rtol=1e-4, atol=1e-4)


def test_launch_counter_sees_the_four_calls():
    mlp, _ = _mlp(2)
    x = torch.randn(1, 1, HIDDEN)
    with torch.no_grad():
        mlp(x), mlp(x.clone())
        x2 = x.clone()
        with LaunchCounter() as c:
            mlp(x2)
    assert c.ops == ["layer_norm", "linear_rows", "activation", "linear_rows"]
    assert len(c.ops) == 4 and mlp.core.last_plan.launches == 4


def test_outputs_and_inputs_are_not_kept_by_the_record():
    """The record patches the addresses of a call's fresh output and of its input (read
    by address) each run and keeps neither: dropped by the caller, both are freed
    (a bf16 MiniLM held a batch's intermediates per bound program this way: 600+ MiB);
    the next call still relocates into its own output and matches the reference."""
    import gc
    import weakref

    mlp, w = _mlp(2)
    with torch.no_grad():
        for s in range(3):  # recorded, relocated, relocated
            x = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(s))
            out = mlp(x)
            np.testing.assert_allclose(out.double().numpy(), _reference(x, w), rtol=1e-4,
                                       atol=1e-4)
            refs = [weakref.ref(out), weakref.ref(x)]
            del out, x
            gc.collect()
            assert [r() for r in refs] == [None, None], f"call {s}"
    assert [type(o) is int for o in _program(mlp).native.ops] == [False]
