"""One decode step of 16 sequences over a paged KV cache (block size 16): the core
lowered decoder (``atbcore.graph.graph_op_kv.run_paged``, the plan the serving engine
runs) against the hand-written runner's ``forward_paged``, on the embedded default
model (fp32). Both caches hold the same 16 prompts of 16..512 tokens; each timed call
is one step (``prepare_decode`` outside the timing), interleaved, medians.

    python benchmarks/paged_decode.py [--steps 40] [--prompt-max 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "adapters", "torch"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()

    from atb_torch.llm.bench.models import build_default_model
    from atb_torch.llm.llm import build_runner
    from atb_torch.models.lower import lower_decoder
    from atbcore.graph.graph_op_kv import run_paged
    from atbcore.memory import PagedKVCache

    model = build_default_model(0)
    cfg = model.config
    runner = build_runner(model, None, None, 2)  # the hand-written runner
    op = lower_decoder(model, last_token=True)
    hd = cfg.hidden_size // cfg.num_attention_heads
    n = args.batch
    lens = np.linspace(16, args.prompt_max, n).round().astype(int).tolist()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (k,), generator=gen).tolist() for k in lens]
    blocks = sum(-(-(k + args.steps + 8) // 16) for k in lens) + 8
    caches, last = {}, {}

    def forward(which, ids, batch, cache):
        if which == "runner":
            return runner.forward_paged(ids, batch, cache)
        return run_paged(op, ids, cache, batch)

    # no_grad, not inference_mode: weights the plan prepares under inference_mode are
    # inference tensors, which the C matmuls refuse (no version counter)
    with torch.no_grad():
        for which in ("runner", "core"):
            c = caches[which] = PagedKVCache(cfg.num_hidden_layers, blocks, 16,
                                             cfg.num_key_value_heads, hd, dtype="fp32")
            ids = [f"s{i}" for i in range(n)]
            batch = c.prepare_prefill(ids, prompts)
            logits = forward(which, torch.tensor(sum(prompts, [])), batch, c)
            last[which] = logits.argmax(-1).tolist()
        assert last["runner"] == last["core"], "the two paths chose different first tokens"
        times: dict[str, list[float]] = {"runner": [], "core": []}
        diffs = []
        for step in range(args.steps):
            outs = {}
            for which in (("runner", "core") if step % 2 else ("core", "runner")):
                c = caches[which]
                seq = [f"s{i}" for i in range(n)]
                batch = c.prepare_decode(seq, [[t] for t in last[which]])
                x = torch.tensor(last["runner"])  # the same tokens into both
                t0 = time.perf_counter()
                out = forward(which, x, batch, c)
                times[which].append(time.perf_counter() - t0)
                outs[which] = out
            diffs.append(float((outs["runner"].float() - outs["core"].float()).abs().max()))
            last = {w: outs["runner"].argmax(-1).tolist() for w in outs}
    warm = args.steps // 4
    med = {w: float(np.median(t[warm:])) for w, t in times.items()}
    print(f"decode step, {n} sequences of {lens[0]}..{lens[-1]} tokens (+{args.steps}), fp32, "
          f"block 16, torch threads {torch.get_num_threads()}")
    for w in ("runner", "core"):
        print(f"  {w:6s} median {med[w] * 1e3:7.2f} ms  ({n / med[w]:7.1f} tok/s)")
    print(f"  core / runner time: {med['core'] / med['runner']:.2f}x   "
          f"max |d logits| {max(diffs):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
