"""Where a decode step's time goes (not a timed test; numbers go into the notes):
the default model (``build_default_model``), prompt 128, 63 greedy decode steps
through ``CoreRunner.decode``, per step: the bound program's native runs
(atbcore/runtime/native_run.py) against the per-call path (``NATIVE[0] = False``),
interleaved in one process, medians; and the step's recorded C calls alone (the
native tables made back to back), so ``step - C alone`` is everything else (Python,
the feeder, argmax, and the kernels' in-step slowdown).

    python benchmarks/decode_split.py [--precision w4] [--threads 2] [--repeats 5]
                                      [--per-kernel] [--python]

``--python``: the step's Python alone (its C calls skipped), and the greedy pick's.

``--per-kernel``: each recorded C call's time inside decode steps against its time in
the same tables made back to back (``atb_run_steps_timed``), per entry point: the
in-step slowdown that is neither Python nor the pool's hand-off; then the attention
calls' cache bytes and FLOPs per step (their floor: the read at the memory's rate, the
multiply-adds at the FMA rate).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "adapters", "torch"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from atb_torch.llm.bench.decoder import AtbDecoder, DecoderSettings, _argmax  # noqa: E402
from atb_torch.llm.bench.models import build_default_model  # noqa: E402
from atbcore.backends.cpu_kernels.bindings import (entry_names, run_steps,  # noqa: E402
                                                   run_steps_timed)
from atbcore.backends.cpu_kernels.threads import parked_torch_threads  # noqa: E402
from atbcore.runtime import native_run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="w4", choices=("fp32", "bf16", "w8", "w4"))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--per-kernel", action="store_true")
    ap.add_argument("--python", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    quant = a.precision if a.precision in ("w8", "w4") else None
    model = build_default_model(0, dtype)
    d = AtbDecoder(model.eval(), DecoderSettings(prompt_len=128, new_tokens=64, dtype=dtype,
                                                 quantize=quant, repeats=1))
    ids = torch.randint(0, model.config.vocab_size, (1, 128),
                        generator=torch.Generator().manual_seed(0))
    r, cache = d.runner, d.cache

    def steps(n: int = 64) -> float:
        with torch.inference_mode():
            cache.reset()
            nxt = _argmax(r.prefill(ids, cache))
            t = time.perf_counter()
            for _ in range(1, n):
                nxt = _argmax(r.decode(nxt, cache))
            return (time.perf_counter() - t) / (n - 1)

    steps()
    form = r.op._in_place
    prog = form._hot[1].programs[form._hot[2]]
    segs = [o for o in prog.native.ops if type(o) is not int]
    got: dict[str, list[float]] = {"native": [], "per-call": [], "C alone": []}
    for _ in range(a.repeats):
        for name, on in (("native", True), ("per-call", False)):
            native_run.NATIVE[0] = on
            got[name].append(steps())
        native_run.NATIVE[0] = True
        steps(8)
        with parked_torch_threads():
            t = time.perf_counter()
            for _ in range(30):
                for s in segs:
                    s.table[0], s.table[1] = 0, len(s.pairs)
                    run_steps(s.table)
            got["C alone"].append((time.perf_counter() - t) / 30)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in got.items()}
    c = med["C alone"]
    print(f"{a.precision}, {a.threads} threads, ms per step: native {med['native']:.3f}, "
          f"per-call {med['per-call']:.3f} ({med['native'] / med['per-call']:.3f}x); "
          f"C calls alone {c:.3f}; everything else: native {med['native'] - c:.3f}, "
          f"per-call {med['per-call'] - c:.3f}; python steps between native runs: "
          f"{sum(type(o) is int for o in prog.native.ops)}")
    if a.per_kernel:
        per_kernel(prog.native, segs, steps)
    if a.python:
        python_only(prog.native, r, cache, ids)


def per_kernel(native: object, segs: list, steps: object) -> None:
    """Median time per C call inside decode steps vs back to back, summed per entry."""
    import ctypes

    import numpy as np

    ns = {id(s): (ctypes.c_int64 * len(s.pairs))() for s in segs}
    got: dict[int, list[list[int]]] = {id(s): [] for s in segs}

    def timed(table: object) -> int:
        seg = next(s for s in segs if s.table is table)
        buf = ns[id(seg)]
        for i in range(len(seg.pairs)):
            buf[i] = -1
        rc = run_steps_timed(table, buf)
        got[id(seg)].append(list(buf))
        return rc

    native._run_steps = timed
    for _ in range(3):
        steps()
    native._run_steps = run_steps
    alone: dict[int, list[list[int]]] = {id(s): [] for s in segs}
    with parked_torch_threads():
        for _ in range(60):
            for s in segs:
                s.table[0], s.table[1] = 0, len(s.pairs)
                run_steps_timed(s.table, ns[id(s)])
                alone[id(s)].append(list(ns[id(s)]))
    names = entry_names()
    rows: dict[str, list[float]] = {}
    for s in segs:
        a = np.array(got[id(s)], dtype=float)
        a[a < 0] = np.nan  # pairs a run did not make (recorded again through Python)
        step = np.full(a.shape[1], np.nan)
        made = ~np.isnan(a).all(axis=0)
        step[made] = np.nanmedian(a[:, made], axis=0)
        back = np.median(np.array(alone[id(s)], dtype=float), axis=0)
        for p, (addr, _) in enumerate(s.pairs):
            name = names.get(addr, hex(addr))
            if np.isnan(step[p]):
                name += " (recorded again)"
            r = rows.setdefault(name, [0, 0.0, 0.0])
            r[0] += 1
            r[1] += 0.0 if np.isnan(step[p]) else step[p]
            r[2] += back[p]
    print(f"{'entry':28s} calls  in-step us  back-to-back us  diff us")
    for name, (n, st, bk) in sorted(rows.items(), key=lambda kv: kv[1][1] - kv[1][2], reverse=True):
        print(f"{name:28s} {n:5d}  {st / 1e3:10.1f}  {bk / 1e3:15.1f}  {(st - bk) / 1e3:7.1f}")
    attention_work(segs, names)


def python_only(native: object, r: object, cache: object, ids: torch.Tensor) -> None:
    """A decode step's Python alone: ``CoreRunner.decode`` with its program's native runs
    making no C call (the feeding, the hot-call dispatch, the record's checks), and
    the greedy pick on its logits (its one C call included), in thread CPU time (so
    another process on the cores adds little), the best of 21 rounds of 40 steps."""
    def best(f: object) -> float:
        got = []
        for _ in range(21):
            cache.reset()
            nxt = _argmax(r.prefill(ids, cache))
            logits = r.decode(nxt, cache)
            t = time.thread_time_ns()
            for _ in range(40):
                f(nxt, logits)
            got.append((time.thread_time_ns() - t) / 40 / 1e3)
        return min(got)

    with torch.inference_mode():
        pick = best(lambda nxt, logits: _argmax(logits))
        native._run_steps = lambda table: 0
        try:
            step = best(lambda nxt, logits: r.decode(nxt, cache))
        finally:
            native._run_steps = run_steps
    print(f"python per decode step (thread CPU time, best of 21 x 40): decode {step:.1f} us "
          f"(C calls skipped), greedy pick {pick:.1f} us")


def attention_work(segs: list, names: dict) -> None:
    """The attention calls' cache bytes and FLOPs at the last step's key range (their
    argument blocks, DecAttnArgs): what their floor is measured against."""
    from atbcore.backends.cpu_kernels.native_attention import ATTN

    calls = [ATTN.unpack(s.keep[p].raw[:ATTN.size]) for s in segs
             for p, (addr, _) in enumerate(s.pairs) if names.get(addr) == "atb_decode_attention"]
    if not calls:
        return
    kv_bytes = flops = 0
    for f in calls:  # B, H, KV, D at 8..11, kv dtype at 6, keys [lo, n) last
        b, h, kv, d, keys = f[8], f[9], f[10], f[11], f[-1] - f[-2]
        kv_bytes += b * kv * keys * d * 2 * (4 if f[6] == 0 else 2)
        flops += 4 * b * h * keys * d   # q.k and p.v: 2 FLOPs per multiply-add each
    print(f"attention, {len(calls)} calls at the last step's {keys} keys: cache read "
          f"{kv_bytes / 1e6:.2f} MB, {flops / 1e6:.2f} MFLOP per step")


if __name__ == "__main__":
    main()
