"""``atb_torch.LLM``'s serving job on its two possible models, one engine
(:class:`atbcore.serving.engine.Engine`): the core lowered decoder
(:class:`atbcore.serving.paged_model.PagedDecoder`, the plan MindSpore/Paddle ``LLM``
run; ``LLM``'s default on the CPU) with host token selection, against the hand-written
runner's ``forward_paged`` with torch selection (``ATB_ENGINE=runner``). The embedded
default model (fp32), 16 prompts of 16..512 tokens, ``--new`` greedy tokens each (``ignore_eos``), no prefix
caching; interleaved samples, medians, and whether both give the same tokens.

    python benchmarks/serve_engines.py [--repeats 3] [--new 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "adapters", "torch"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    from atb_torch.llm import LLM
    from atb_torch.llm.bench.models import build_default_model

    model = build_default_model(0)
    gen = torch.Generator().manual_seed(1)
    lens = torch.linspace(16, 512, 16).round().long().tolist()
    prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in lens]
    kw = dict(max_batch_size=16, max_prefill_tokens=8192, enable_prefix_caching=False)
    os.environ["ATB_ENGINE"] = "runner"
    runner = LLM(model, **kw)
    del os.environ["ATB_ENGINE"]
    llms = {"runner": runner, "core": LLM(model, **kw)}
    assert llms["core"].runner is None and llms["runner"].runner is not None
    times: dict[str, list[float]] = {k: [] for k in llms}
    toks, stats = {}, {}
    for rep in range(args.repeats + 1):  # the first round builds the plans: not timed
        for name in (list(llms) if rep % 2 else list(llms)[::-1]):
            t0 = time.perf_counter()
            outs = llms[name].generate_outputs(prompts, max_new_tokens=args.new, ignore_eos=True)
            if rep:
                times[name].append(time.perf_counter() - t0)
            toks[name] = [o.token_ids for o in outs]
            stats[name] = llms[name].last_stats
    med = {k: statistics.median(v) for k, v in times.items()}
    same = sum(a == b for a, b in zip(toks["runner"], toks["core"]))
    print(f"16 prompts {lens[0]}..{lens[-1]} tokens, {args.new} new each, fp32, medians of "
          f"{args.repeats}, torch threads {torch.get_num_threads()}")
    for k in llms:
        st = stats[k]
        print(f"  {k:6s} {med[k]:6.2f} s  {16 * args.new / med[k]:6.1f} tok/s  "
              f"(steps {st.steps}, prefill steps {st.prefill_steps})")
    print(f"  core / runner time {med['core'] / med['runner']:.2f}x; {same}/16 rows identical")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
