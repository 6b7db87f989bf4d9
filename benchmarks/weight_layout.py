"""Memory and decode speed of the weight-layout pass (atbcore.passes.layout).

    python benchmarks/weight_layout.py [--modes fp32,bf16,w8,w8a8,w4] [--rounds 7]

Memory: per mode, in a fresh subprocess with the pass on and off (``ATB_LAYOUT_PASS``),
the resident-memory growth (after ``malloc_trim``) of ``atb.compile`` + a short
``generate`` on the default ``atb bench`` model (8 layers, hidden 512) over the process with the HF model built,
and the weight bytes the compiled graph holds per layout (``explain()``'s table).
Speed: pass off and on, interleaved in one process: per round a block of decode
steps and a 128-token prefill of two runners on the same weights; the medians of the
per-round time ratios (and of the times).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time


def _trim() -> None:
    """Hand freed heap back to the OS (glibc keeps tens of MiB of freed packing
    temporaries otherwise, which made one-off RSS differ by +-40 MiB between runs)."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS as it is
        pass


def _rss_mib() -> float:
    _trim()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def _model(mode: str):
    import torch

    from atb_torch.llm.bench.models import build_default_model

    return build_default_model(dtype=torch.bfloat16 if mode == "bf16" else torch.float32)


def _quant(mode: str) -> dict:
    return {"quantize": mode} if mode in ("w8", "w4", "w8a8") else {}


def memory(mode: str) -> dict:
    """Run in a child: RSS growth and weight bytes per layout for ``mode``."""
    import torch

    import atb_torch as atb
    from atbcore.passes.layout import weight_table

    m = _model(mode)
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(ids)
    gc.collect()
    r0 = _rss_mib()
    c = atb.compile(m, **_quant(mode))
    c.generate(ids, max_new_tokens=8)
    gc.collect()
    form = c.atb_runner.op._in_place
    by: dict[str, int] = {}
    if form is not None and form.graph is not None:
        for _, layout, nbytes in weight_table(form.graph):
            k = layout.split(" (")[0]
            by[k] = by.get(k, 0) + nbytes
    return {"rss_mib": round(_rss_mib() - r0, 1),
            "weights_mib": {k: round(v / 2**20, 1) for k, v in by.items()}}


def speed(mode: str, rounds: int, steps: int = 24, prompt: int = 128) -> dict:
    """Per round, pass off and on back to back: ``steps`` decode steps and one prefill
    of ``prompt`` tokens; the medians of the (on / off) time ratios and of the times."""
    import torch

    from atb_torch.models.core_runner import CoreRunner

    m = _model(mode)
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
    long = torch.randint(0, 32000, (1, prompt), generator=torch.Generator().manual_seed(1))
    runners = []
    for on in ("0", "1"):
        os.environ["ATB_LAYOUT_PASS"] = on  # read when the GraphOp is lowered
        r = CoreRunner.from_hf(m, **_quant(mode))
        cache = r.new_cache(1, 16 + rounds * steps + 8)
        tok = r.prefill(ids, cache).argmax(-1)
        r.decode(tok, cache)
        r.prefill(long, r.new_cache(1, prompt))
        runners.append((r, cache, tok))
    os.environ.pop("ATB_LAYOUT_PASS")
    dec: list[list[float]] = [[], []]
    pre: list[list[float]] = [[], []]
    for _ in range(rounds):
        for i, (r, cache, tok) in enumerate(runners):
            t0 = time.perf_counter()
            for _ in range(steps):
                r.decode(tok, cache)
            dec[i].append((time.perf_counter() - t0) / steps)
            c = r.new_cache(1, prompt)
            t0 = time.perf_counter()
            r.prefill(long, c)
            pre[i].append(time.perf_counter() - t0)
    med = statistics.median
    return {"decode_on_off": med(b / a for a, b in zip(*dec)),
            "prefill_on_off": med(b / a for a, b in zip(*pre)),
            "decode_ms": [round(1e3 * med(d), 2) for d in dec],
            "prefill_ms": [round(1e3 * med(p), 1) for p in pre]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="fp32,bf16,w8,w8a8,w4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(memory(a.child)))
        return
    print(f"load: {os.getloadavg()}")
    for mode in a.modes.split(","):
        got = {}
        for on in ("0", "1"):
            env = dict(os.environ, ATB_LAYOUT_PASS=on)
            out = subprocess.run([sys.executable, __file__, "--child", mode], env=env,
                                 capture_output=True, text=True, check=True).stdout
            got[on] = json.loads(out.strip().splitlines()[-1])
        sp = speed(mode, a.rounds)
        print(f"{mode}: RSS growth pass off {got['0']['rss_mib']} MiB, on {got['1']['rss_mib']} "
              f"MiB; weights on: {got['1']['weights_mib']}; decode time on/off "
              f"{sp['decode_on_off']:.3f} ({sp['decode_ms'][0]} / {sp['decode_ms'][1]} ms per "
              f"step off/on), prefill 128 on/off {sp['prefill_on_off']:.3f} "
              f"({sp['prefill_ms'][0]} / {sp['prefill_ms'][1]} ms off/on)")


if __name__ == "__main__":
    main()
