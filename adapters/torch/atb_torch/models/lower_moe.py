"""Mixture-of-experts blocks in the lowered decoder (:mod:`.lower`) and their
tensor-parallel shards (:mod:`.lower_tp`, :mod:`.shard_load`).

A Mixtral block's MLP becomes one core ``MoE`` node
(:func:`atbcore.models.decoder.moe_layer`: router ``[E, H]``, experts'
gate|up ``[E, 2I, H]`` gate rows first, down ``[E, H, I]``): fp32 softmax routing
over all experts, top-k renormalised, the chosen experts' SwiGLU FFNs weighted and
summed -- the numerics of the hand-written runner's ``moe_forward`` and of Hugging
Face's ``MixtralSparseMoeBlock``.

Tensor parallelism splits every expert the way the dense FFN is split: rank r of N
holds rows ``[r*I/N, (r+1)*I/N)`` of each expert's gate and up and the same columns
of its down projection; the router is replicated. Each rank routes the same
(replicated) tokens to the same experts, runs its slice of each chosen expert, and
its MoE output is a partial sum over the intermediate dimension, so the one
``AllReduce`` that already follows ``l{i}.mlp`` completes it::

    y = sum_k w_k * down_k(act(gate_k x) * up_k x)
      = sum_r [ sum_k w_k * down_k[:, r] (act(gate_k[r] x) * up_k[r] x) ]   # rank r's part

Why not whole experts per rank (expert parallelism): the routing weights are a
softmax over *all* experts, so a rank holding a subset still needs every router
row, and the per-step work of a rank would follow the routing (with top-2 of 8
on a small decode batch one rank may get every token and the other none). Split
experts give every rank the same work whatever the routing, need no token
exchange (AllToAll) and no change to the MoE op, and cost the same one all-reduce
of ``[T, H]`` per layer as a dense block.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from atbcore.models.decoder import moe_layer

__all__ = ["moe_layer", "shard_experts", "lazy_moe_weights"]


def _t(part: Any) -> torch.Tensor:
    return torch.as_tensor(part)


def shard_experts(gate_up: Any, down: Any, rows: tuple[int, int], inter: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(gate_up [E, 2i, H], down [E, H, i])`` for intermediate rows
    ``rows`` of ``inter``. ``gate_up``/``down`` are the 3-D tensors (or lazy
    safetensors slices of them), or per-expert lists: ``gate_up`` of
    ``(gate [I, H], up [I, H])`` pairs and ``down`` of ``[H, I]`` (the w1, w3, w2
    tensors of a Mixtral checkpoint) -- only the rank's rows are read."""
    a, b = rows
    if isinstance(gate_up, (list, tuple)):
        gu = torch.stack([torch.cat([_t(g[a:b]), _t(u[a:b])]) for g, u in gate_up])
        dn = torch.stack([_t(d[:, a:b]) for d in down])
        return gu, dn
    gu = torch.cat([_t(gate_up[:, a:b]), _t(gate_up[:, inter + a:inter + b])], dim=1)
    return gu, _t(down[:, :, a:b])


def lazy_moe_weights(names: Any, get: Callable[..., Any], prefix: str
                     ) -> dict[str, Any] | None:
    """A checkpoint block's MoE tensors as ``LayerWeights`` fields (lazy slices;
    None for a dense block). ``names``: the checkpoint's tensor names;
    ``get(name, required=True)`` looks a tensor up; ``prefix`` is
    ``model.layers.{i}.``. Both layouts: Mixtral's per-expert
    ``block_sparse_moe.experts.{e}.w1/w2/w3`` and the 3-D
    ``mlp.experts.gate_up_proj`` / ``down_proj`` of newer checkpoints."""
    sparse = prefix + "block_sparse_moe."
    if get(sparse + "gate.weight", False) is not None:
        stem = sparse + "experts."
        count = sum(1 for n in names if n.startswith(stem) and n.endswith(".w1.weight"))
        ex = [f"{stem}{e}." for e in range(count)]
        return {"router": get(sparse + "gate.weight"),
                "experts_gate_up": [(get(p + "w1.weight"), get(p + "w3.weight")) for p in ex],
                "experts_down": [get(p + "w2.weight") for p in ex]}
    mlp = prefix + "mlp."
    if get(mlp + "experts.gate_up_proj", False) is not None:
        return {"router": get(mlp + "gate.weight"),
                "experts_gate_up": get(mlp + "experts.gate_up_proj"),
                "experts_down": get(mlp + "experts.down_proj")}
    return None
