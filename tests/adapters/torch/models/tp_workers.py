"""What each rank runs in test_models_lower_tp (importable by the spawned ranks)."""

from __future__ import annotations

import numpy as np


def graph_weight_bytes(op) -> int:
    """Bytes of the weights in the GraphOp's lowered (unfused) graph."""
    return sum(int(a.nbytes if hasattr(a, "layout") else np.asarray(a).nbytes)  # packed: its bytes
               for a in op.graph_unfused.weight_map.values())


def decode(op, cache, prompt, steps: int, feed=None):
    """Prefill ``prompt`` then ``steps`` one-token calls: the next token is
    ``feed[:, t]`` when given (teacher-forced), else greedy. Returns (all logits
    [B, S + steps, V], the tokens chosen)."""
    import torch

    with torch.no_grad():
        logits, _ = op(prompt, kv_cache=cache)
        out, seq = [logits], prompt
        for t in range(steps):
            nxt = feed[:, t:t + 1] if feed is not None else out[-1][:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            out.append(op(nxt, kv_cache=cache)[0])
    return torch.cat(out, dim=1), seq


def cache_for(config, plan, batch: int, length: int = 32):
    from atbcore.memory import KVCache

    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVCache(config.num_hidden_layers, batch, length, plan.local_kv_heads, hd, dtype="fp32")


def run_model(rank: int, world: int, cases: list) -> list:
    """Each case ``(arch, config overrides, ids [B, S], prompt length, greedy steps,
    checkpoint directory or None)``:
    this rank's logits for the prompt and teacher-forced decode steps, its greedy
    tokens, and the bytes of weights its GraphOp holds."""
    import torch

    from atb_torch.models.lower_tp import lower_decoder_tp, shard_plan
    from tiny_models import tiny

    torch.set_grad_enabled(False)
    out = []
    for arch, over, ids, prompt_len, greedy_steps, checkpoint in cases:
        ids = torch.as_tensor(ids)
        if checkpoint is None:
            hf = tiny(arch, **over)
            plan = shard_plan(hf.config, tensor_parallel=world)
            op = lower_decoder_tp(hf, tensor_parallel=world)
        else:  # only this rank's slices are read from the files
            from transformers import AutoConfig

            from atb_torch.models.shard_load import load_shard

            hf = type("ConfigOnly", (), {"config": AutoConfig.from_pretrained(
                checkpoint, local_files_only=True)})()
            plan = shard_plan(hf.config, tensor_parallel=world)
            op = lower_decoder_tp(hf, weights=load_shard(checkpoint, plan))
        logits, _ = decode(op, cache_for(hf.config, plan, ids.shape[0]), ids[:, :prompt_len],
                           ids.shape[1] - prompt_len, feed=ids[:, prompt_len:])
        nbytes = graph_weight_bytes(op)
        _, seq = decode(op, cache_for(hf.config, plan, 1), ids[:1, :prompt_len], greedy_steps)
        ops = [n.op for n in op._in_place.graph.nodes]  # after the pass pipeline
        out.append({"logits": logits.numpy(), "greedy": seq.numpy(), "bytes": nbytes, "ops": ops,
                    "kv_heads": plan.local_kv_heads, "kv_rows": plan.kv_rows})
    return out


def run_compiled(rank: int, world: int, arch: str, ids, steps: int) -> dict:
    """``atb.compile(tiny(arch), tensor_parallel=world).generate``: this rank's ids, and
    the sampled ids with a seed (every rank must draw the same tokens)."""
    import torch

    import atb_torch as atb
    from tiny_models import tiny

    fast = atb.compile(tiny(arch), tensor_parallel=world)
    ids = torch.as_tensor(ids)
    greedy = fast.generate(ids, max_new_tokens=steps)
    again = fast.generate(ids[:1], max_new_tokens=steps)  # the cache reset, a smaller batch
    sampled = fast.generate(ids, max_new_tokens=steps, do_sample=True, top_k=20, seed=7)
    return {"greedy": greedy.numpy(), "again": again.numpy(), "sampled": sampled.numpy()}
