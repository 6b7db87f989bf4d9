"""A native run's record keeps no per-run object alive (atbcore/runtime/native_held.py).

A recorded call keeps, per slot it read: nothing for a slot it reads by address alone
(its fields are patched every run), a weak reference for any other. So a run's
intermediates (a slot a Python step fills per run: a bf16 encoder's oneDNN GELU
output, read by the next C matmul) are freed when the run drops them, and a freed
object never passes for the one recorded (not even a new object at its ``id``): the
call is then recorded again. Here the "native" calls make no C call (their records
are empty); what they see in Python is logged, and Python runs only when recorded."""

import gc
import weakref

import numpy as np
import pytest

from atbcore.backends.cpu_kernels import available
from atbcore.runtime.native_held import UNHELD, held_is, hold, relocations
from atbcore.runtime.native_run import NativeRun, native_call

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels are not built here")


def _program(log, make, by_address=()):
    """Slot 0: the input; ``fill`` (Python) writes ``make(env[0])`` into slot 1;
    ``read`` (recordable) reads slot 1 -- by address alone when ``by_address``."""
    def fill(env):
        env[1] = make(env[0])

    def read(env):
        log.append(float(env[1].sum()))

    steps = [(fill, ()), (native_call(read, addresses=by_address), ())]
    return NativeRun(steps, given=[((0,), (1,)), ((1,), ())], outputs=[], filled={0})


def _run(run, x):
    env = [x, None]
    run.run(env, 1)
    ref = weakref.ref(env[1])
    del env
    gc.collect()
    return ref


def test_a_fresh_intermediate_is_freed_after_the_run_and_its_call_recorded_again():
    log = []
    run = _program(log, lambda x: x * 2.0)
    refs = [_run(run, np.full(4, float(v))) for v in (1, 2, 3)]
    # the record holds none of them: each run's intermediate is gone once the run is
    assert [r() for r in refs] == [None, None, None]
    # a freed object never matches the new one: recorded again each run, right values
    assert log == [8.0, 16.0, 24.0]


def test_the_same_live_object_matches_without_recording_again():
    log = []
    fixed = np.arange(4.0)
    run = _program(log, lambda x: fixed)
    for _ in range(3):
        _run(run, np.zeros(1))
    assert log == [6.0]                # recorded once; later runs match the live object
    ref = weakref.ref(fixed)
    assert ref() is fixed              # held by this test, not kept by the record alone


def test_an_address_read_slot_is_relocated_and_not_held():
    log = []
    run = _program(log, lambda x: x + 1.0, by_address=(1,))
    refs = [_run(run, np.full(4, float(v))) for v in (1, 2, 3)]
    assert [r() for r in refs] == [None, None, None]
    assert log == [8.0]                # relocated (no C fields here): recorded once
    # another size is no relocation: recorded again (its call's own checks see it)
    _run(run, np.full(6, 1.0))
    assert log == [8.0, 12.0]


def test_hold_entries():
    a = np.zeros(3)
    h = hold(a, False)
    assert held_is(a, h) and not held_is(np.zeros(3), h)
    assert hold(a, True) is UNHELD and not held_is(a, UNHELD)
    assert held_is(None, hold(None, False))    # no weak reference: held as it is
    b = np.zeros(2)
    hb = hold(b, False)
    del b
    gc.collect()
    assert not held_is(None, hb)               # a dead reference matches nothing
    # the fields of an address: whole 8-byte fields only, with the object's bytes
    x = np.zeros(4)
    addr = x.__array_interface__["data"][0]
    block = np.array([7, addr, 9, addr], dtype=np.int64).tobytes()
    assert relocations((0,), [x], [(0, block)]) == {0: (32, [(0, 8), (0, 24)])}
    inside = np.array([addr + 8], dtype=np.int64).tobytes()
    assert relocations((0,), [x], [(0, inside)]) == {}


def test_segment_alive_checks_identity_and_refuses_a_dead_reference_over_none():
    """The one-pass check of a segment's weakly held slots: the very objects pass, any
    other object fails, and a reference that died fails even when its slot now holds
    None (a dead reference reads as None)."""
    from atbcore.runtime.native_run import _Segment

    a, b = np.zeros(3), np.ones(3)
    weak = ((0, 2), (weakref.ref(a), weakref.ref(b)))
    assert _Segment.alive(weak, [a, None, b])
    assert not _Segment.alive(weak, [a, None, np.ones(3)])
    dead = np.zeros(2)
    weak_dead = ((0, 1), (weakref.ref(a), weakref.ref(dead)))
    del dead
    gc.collect()
    assert not _Segment.alive(weak_dead, [a, None])
