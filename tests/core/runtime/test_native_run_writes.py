"""A native run's recorded env writes survive a call recorded again
(atbcore/runtime/native_run.py).

A run makes every segment's recorded env writes first, then checks the recorded
calls' slots. A call recorded again in that run (one of its inputs changed) finds
its own earlier writes already in env; its record must still note them, or later
runs leave those slots empty and the next reader recorded again reads nothing. (A
paged decode step lost its KV cache aliases this way under 64 concurrent clients.)
Here: ``write`` aliases slot 1 into slot 2 (as an in-place cache update hands its
cache on), ``read`` reads slot 2 and slot 3."""

import pytest

from atbcore.backends.cpu_kernels import available
from atbcore.runtime.native_run import NativeRun, native_call

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels are not built here")


def _program(log):
    def write(env):
        env[2] = env[1]

    def read(env):
        assert env[2] is not None, "slot 2 (written by the first call) is empty"
        log.append((env[2], env[3]))

    steps = [(native_call(write), ()), (native_call(read), ())]
    # inputs (slots 0, 1, 3) are filled before each run; slot 2 is written by `write`
    return NativeRun(steps, given=[((0, 1), (2,)), ((2, 3), ())], outputs=[],
                     filled={0, 1, 3})


def _env(p, cache, q):
    return [p, cache, None, q]


def test_writes_of_a_call_recorded_again_are_kept_for_later_runs():
    log = []
    run = _program(log)
    cache = object()
    p0, p1, q0, q1 = object(), object(), object(), object()
    run.run(_env(p0, cache, q0), 1)   # records both calls
    run.run(_env(p1, cache, q0), 1)   # `write` recorded again (its p changed)
    run.run(_env(p1, cache, q1), 1)   # `read` recorded again (its q changed)
    run.run(_env(p1, cache, q1), 1)   # as recorded: the writes alone fill slot 2
    # `read` runs its Python only when recorded (runs 1 and 3); it saw the cache then
    assert len(log) == 2 and log[0][0] is cache and log[1][0] is cache
    assert log[0][1] is q0 and log[1][1] is q1
