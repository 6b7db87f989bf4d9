"""Tensor parallel on 2 gloo processes (``atb_torch.models.lower_tp``) against one
process (``lower_decoder``): decode tokens/s, per-layer communication volume and the
weight bytes each rank holds.

The embedded default model's sizes (hidden 512, 8 layers, 8 heads, 2 KV heads, inter
1376, vocab 32000) as a Llama and as a Mixtral (8 experts of inter 344, top-2, every
expert split over the ranks), fp32, batch 1, a 32-token prompt. Rank 0 runs the TP 1 engine
too, interleaved with the TP 2 pair (rank 1 waits at a barrier meanwhile), so both
are timed in one process, taking turns; best and median per-step times of
``--samples`` samples of ``--steps`` decode steps. Communication is counted by
wrapping the torch.distributed calls the kernels make during one decode step.
Each rank and the TP 1 engine use ``--threads`` threads (default 1).

    python benchmarks/tp_bench.py [--arch llama|mixtral|all] [--samples 9] [--steps 8]

Design note for nccl/hccl: the kernels call torch.distributed with whatever backend
the group was created with (``atbcore.distributed.backend_for_device``: gloo on CPU,
nccl on CUDA, hccl through torch_npu on Ascend); the graph and the sharding are the
same. What changes there is the cost model, not the code: on a device the two
all-reduces per layer are ``2 * tokens * hidden * bytes`` each and overlap nothing
yet (the plan runs them in order on one stream), so the next steps are running them
on a side stream and reducing in bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

H, L, NH, KV, V = 512, 8, 8, 2, 32000
# arch -> (MLP intermediate size, experts, experts per token); Mixtral's experts are a
# quarter of the dense MLP each, 8 of them, top-2
ARCHS = {"llama": (1376, 0, 0), "mixtral": (344, 8, 2)}
PROMPT = 32


def _model(arch: str):
    import torch
    import transformers as tf

    inter, experts, top_k = ARCHS[arch]
    kw = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
              num_key_value_heads=KV, intermediate_size=inter, vocab_size=V)
    torch.manual_seed(0)
    if arch == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            num_local_experts=experts, num_experts_per_tok=top_k, **kw)).eval()
    return tf.LlamaForCausalLM(tf.LlamaConfig(**kw)).eval()


def _count_comm(step) -> list[tuple[str, int]]:
    """(call, payload bytes) of every torch.distributed call during ``step()``."""
    import torch.distributed as dist

    import atbcore.backends.torch.collective as coll

    calls: list[tuple[str, int]] = []

    def spy(name, real):
        def wrapped(*args, **kw):
            t = args[1] if name == "all_gather" else args[0]
            calls.append((name, t.numel() * t.element_size()))
            return real(*args, **kw)
        return wrapped

    saved = dist.all_reduce, coll._ALL_GATHER
    dist.all_reduce, coll._ALL_GATHER = spy("all_reduce", saved[0]), spy("all_gather", saved[1])
    try:
        step()
    finally:
        dist.all_reduce, coll._ALL_GATHER = saved
    return calls


def rank_main(rank: int, world: int, arch: str, samples: int, steps: int, threads: int) -> dict:
    import torch
    import torch.distributed as dist

    from atb_torch.models.lower import lower_decoder
    from atb_torch.models.lower_tp import lower_decoder_tp, shard_plan
    from atbcore.memory import KVCache

    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    hf = _model(arch)
    plan = shard_plan(hf.config)
    cap = PROMPT + (samples + 2) * steps + 8
    ids = torch.randint(3, V, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    tp = lower_decoder_tp(hf)
    cache = KVCache(L, 1, cap, plan.local_kv_heads, H // NH, dtype="fp32")
    tp(ids, kv_cache=cache)
    tok = ids[:, -1:]
    engines = {"tp2": lambda: tp(tok, kv_cache=cache)}
    if rank == 0:
        one = lower_decoder(hf)
        cache1 = KVCache(L, 1, cap, KV, H // NH, dtype="fp32")
        one(ids, kv_cache=cache1)
        engines["tp1"] = lambda: one(tok, kv_cache=cache1)
    comm = _count_comm(engines["tp2"])
    for f in engines.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in ("tp2", "tp1")}
    for _ in range(samples):
        for name in ("tp2", "tp1"):
            dist.barrier()
            if name in engines:
                t0 = time.perf_counter()
                for _ in range(steps):
                    engines[name]()
                times[name].append((time.perf_counter() - t0) / steps)
    nbytes = sum(a.nbytes for a in tp._in_place.graph_unfused.weight_map.values())
    out = {"comm": comm, "times": times, "bytes": nbytes}
    if rank == 0:
        out["bytes_tp1"] = sum(a.nbytes for a in one._in_place.graph_unfused.weight_map.values())
    return out


def report(arch: str, r0: dict, r1: dict, threads: int) -> None:
    inter, experts, top_k = ARCHS[arch]
    comm = r0["comm"]
    reduces = [b for n, b in comm if n == "all_reduce"]
    gathers = [b for n, b in comm if n == "all_gather"]
    per_layer = (sum(reduces) - reduces[0]) / L  # the first all-reduce is the embedding's
    mlp = (f"{experts} experts (inter {inter} each, top-{top_k}), every expert split"
           if experts else f"inter {inter}")
    print(f"== {arch}: hidden {H}, {L} layers, {NH} heads / {KV} KV heads, {mlp}, vocab {V}, "
          f"fp32, batch 1, prompt {PROMPT}; {threads} thread(s) per engine; shared machine")
    print(f"comm per decode token (rank 0): {len(reduces)} all-reduces "
          f"({L} layers x 2 + embedding), {sum(reduces)} B; {len(gathers)} all-gather "
          f"(logits) {sum(gathers)} B in, {sum(gathers) * 2} B out")
    print(f"per layer: 2 all-reduces of {H * 4} B each = {per_layer:.0f} B payload "
          f"(ring wire bytes per rank 2*(N-1)/N * payload = {per_layer:.0f} B at N=2)"
          + ("; the MoE block's is the same [T, H] as a dense MLP's" if experts else ""))
    full = r0["bytes_tp1"]
    print(f"weight bytes: TP1 {full}, TP2 rank 0 {r0['bytes']} ({r0['bytes'] / full:.3f}x), "
          f"rank 1 {r1['bytes']} ({r1['bytes'] / full:.3f}x)")
    t1, t2 = r0["times"]["tp1"], r0["times"]["tp2"]
    for name, ts in (("TP1", t1), ("TP2", t2)):
        print(f"{name} decode: median {1 / statistics.median(ts):.1f} tok/s, "
              f"best {1 / min(ts):.1f} tok/s")
    print(f"TP2 / TP1 tok/s: median {statistics.median(t1) / statistics.median(t2):.3f}, "
          f"best {min(t1) / min(t2):.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=(*ARCHS, "all"), default="all")
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    from atbcore.distributed.launch import spawn_ranks

    for arch in ARCHS if a.arch == "all" else (a.arch,):
        r0, r1 = spawn_ranks(rank_main, (arch, a.samples, a.steps, a.threads), world=2,
                             timeout=1800, threads=a.threads)
        report(arch, r0, r1, a.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
