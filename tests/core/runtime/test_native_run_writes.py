"""A native run's env writes (a call that hands on an object, e.g. the KV cache a
cache-write node outputs in place) survive the call being recorded again: the fast path
makes every recorded write ahead of its check, so a call recorded again writes the same
object into a slot that already holds it (the served paged model lost its caches this
way when a step's table tensors changed: the attention then read None)."""

from atbcore.runtime.native_run import NativeRun, native_call


def test_write_of_same_object_survives_recording_again():
    seen = []

    def write(env):          # reads slots 0 and 3; outputs slot 0's object as slot 1
        env[1] = env[0]

    def read(env):           # reads slots 1 and 4 (runs in Python when recorded)
        seen.append(env[1])

    steps = [(native_call(write), ()), (native_call(read), ())]
    run = NativeRun(steps, given=[((0, 3), (1,)), ((1, 4), (2,))], outputs=[2], filled=set())
    cache, t1, t2 = object(), object(), object()
    # run 0 records; run 1 records step 0 again (its table changed); run 2 has step 0's
    # objects of run 1 but a new one for step 1, which is recorded again
    for table, lens in (("t0", "l0"), (t1, "l0"), (t1, t2)):
        env = [None] * 5
        env[0], env[3], env[4] = cache, table, lens
        run.run(env, 1)
    assert seen == [cache, cache]
