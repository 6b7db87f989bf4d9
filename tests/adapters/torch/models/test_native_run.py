"""A bound program's recorded C calls made as one native call (atbcore/runtime/
native_run.py, csrc/program.c): decode steps of a compiled decoder give the same bits
as the per-call bound path and as the unbound node-by-node run (fp32, bf16, w8, w4;
1 and 2 threads), and greedy tokens match Hugging Face (the oracle); the native run
really covers the step's C calls; a kernel's error status (an id outside the
embedding) raises as the per-call path does and the next step runs natively again;
a LaunchCounter sees every call."""

import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.backends.cpu_kernels.counting import LaunchCounter
from atbcore.runtime import native_run
from atbcore.runtime.profiler import Profiler
from atb_torch.models.core_runner import CoreRunner
from tiny_models import tiny

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels are not built here")


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


def _runner(llama, precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    quant = precision if precision in ("w8", "w4") else None
    model = llama if dtype == torch.float32 else tiny("llama").to(dtype)
    return CoreRunner.from_hf(model, quantize=quant, dtype=dtype), dtype


def _program(r):
    form = r.op._in_place
    plan, key = form._hot[1], form._hot[2]
    return plan, plan.programs[key]


def _decode(r, ids, steps, native):
    """Greedy decode; per step the logits (cloned) and the program's inputs."""
    keep = native_run.NATIVE[0]
    native_run.NATIVE[0] = native
    try:
        cache = r.new_cache(ids.shape[0], ids.shape[1] + steps + 1)
        tok = r.prefill(ids, cache).argmax(-1)
        out = []
        for _ in range(steps):
            logits = r.decode(tok, cache).clone()
            out.append(logits)
            tok = logits.argmax(-1)
        return torch.stack(out), cache
    finally:
        native_run.NATIVE[0] = keep


@pytest.mark.parametrize("precision", ["fp32", "bf16", "w8", "w4"])
def test_native_steps_equal_per_call_and_unbound(llama, precision):
    r, dtype = _runner(llama, precision)
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(3))
    keep = torch.get_num_threads()
    runs = {}
    try:
        for threads in (1, 2):  # the C pool follows torch's thread count
            torch.set_num_threads(threads)
            for native in (True, False):
                runs[threads, native] = _decode(r, ids, 6, native)[0]
    finally:
        torch.set_num_threads(keep)
    ref = runs[1, False]
    for k, v in runs.items():
        assert torch.equal(v, ref), f"{precision}: threads/native {k} differ from per-call"
    # the native run covers the step: one recorded run of every C call, no Python call
    plan, prog = _program(r)
    ops = prog.native.ops
    assert ops is not None and [type(o) is int for o in ops] == [False], ops
    assert len(ops[0].pairs) >= 2 * 4 + 2  # per layer at least QKV, rope, attention, ...
    # the unbound run (node by node through each kernel's fn) of the last step's inputs
    xs = {}
    orig = type(prog)._run

    def spy(self, inputs, keep_outputs=False):
        xs["in"] = list(inputs)
        return orig(self, inputs, keep_outputs)
    type(prog)._run = spy
    try:
        logits, cache = _decode(r, ids, 3, True)
    finally:
        type(prog)._run = orig
    unbound = plan.run(dict(zip(plan.graph.inputs, xs["in"])), profiler=Profiler("t"))[0]
    assert torch.equal(unbound.reshape(logits[-1].shape), logits[-1])
    # the oracle: greedy tokens of the first steps as Hugging Face picks them
    if precision == "fp32":
        seq = ids
        with torch.no_grad():
            for step in range(3):
                nxt = llama(seq).logits[:, -1].argmax(-1)
                if step:
                    assert torch.equal(nxt, logits[step - 1].argmax(-1))
                seq = torch.cat([seq, nxt[:, None]], 1)


def test_steady_steps_record_nothing_again(llama):
    """The token ids go through the runner's buffer and the logits into the program's
    own: after the first steps a step's native run records no call again (one table
    walk), and every step's logits are the same buffer (read before the next step)."""
    r, _ = _runner(llama, "w4")
    ids = torch.randint(3, 200, (1, 5), generator=torch.Generator().manual_seed(4))
    ref, _ = _decode(r, ids, 6, False)
    cache = r.new_cache(1, 16)
    tok = r.prefill(ids, cache).argmax(-1)
    _, prog = _program(r)
    again, orig = [], type(prog.native)._again

    def spy(self, seg, item, env):
        again.append(item[0])
        return orig(self, seg, item, env)
    type(prog.native)._again = spy
    try:
        outs = []
        for step in range(6):
            logits = r.decode(tok, cache)
            outs.append(logits.data_ptr())
            assert torch.equal(logits, ref[step]), step
            tok = logits.argmax(-1)
            if step == 2:
                again.clear()
    finally:
        type(prog.native)._again = orig
    _, prog = _program(r)
    assert again == [] and len(prog.native.ops) == 1
    assert len(set(outs[2:])) == 1


def test_error_status_raises_and_next_step_runs_natively(llama):
    r, _ = _runner(llama, "w4")
    ids = torch.randint(3, 200, (1, 5), generator=torch.Generator().manual_seed(8))
    ref, _ = _decode(r, ids, 3, False)
    cache = r.new_cache(1, 16)
    tok = r.prefill(ids, cache).argmax(-1)
    r.decode(tok, cache)  # records
    with pytest.raises(Exception, match="(?i)ids|range|rows"):
        r.decode(torch.tensor([10 ** 6]), cache)
    got, _ = _decode(r, ids, 3, True)
    assert torch.equal(got, ref)
    _, prog = _program(r)
    assert prog.native.ops is not None


def test_launch_counter_sees_each_call(llama):
    r, _ = _runner(llama, "fp32")
    ids = torch.randint(3, 200, (1, 5), generator=torch.Generator().manual_seed(9))
    counts = {}
    for native in (True, False):
        native_run.NATIVE[0] = native
        try:
            cache = r.new_cache(1, 16)
            tok = r.prefill(ids, cache).argmax(-1)
            r.decode(tok, cache)
            with LaunchCounter() as c:
                r.decode(tok, cache)
            counts[native] = list(c.ops)
        finally:
            native_run.NATIVE[0] = True
    assert counts[True] == counts[False] and len(counts[True]) > 10
