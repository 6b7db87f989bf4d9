"""Where a decode step's time goes (not a timed test; numbers go into the notes):
the default model (``build_default_model``), prompt 128, 63 greedy decode steps
through ``CoreRunner.decode``, per step: the bound program's native runs
(atbcore/runtime/native_run.py) against the per-call path (``NATIVE[0] = False``),
interleaved in one process, medians; and the step's recorded C calls alone (the
native tables made back to back), so ``step - C alone`` is everything else (Python,
the feeder, argmax, and the kernels' in-step slowdown).

    python benchmarks/decode_split.py [--precision w4] [--threads 2] [--repeats 5]
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
from atbcore.backends.cpu_kernels.bindings import run_steps  # noqa: E402
from atbcore.backends.cpu_kernels.threads import parked_torch_threads  # noqa: E402
from atbcore.runtime import native_run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="w4", choices=("fp32", "bf16", "w8", "w4"))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
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


if __name__ == "__main__":
    main()
