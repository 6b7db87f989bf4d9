"""A Hugging Face decoder lowered for tensor parallelism: rank r's share as one core
GraphOp (Megatron-style), built from :func:`.lower.decoder_layers` unchanged.

    import torch.distributed as dist
    from atb_torch.models.lower_tp import lower_decoder_tp
    dist.init_process_group("gloo", ...)             # one process per rank
    op = lower_decoder_tp(hf_model)                   # this rank's GraphOp: ids -> logits
    plan = shard_plan(hf_model.config)                # this rank's heads, rows, vocab
    cache = atbcore.memory.KVCache(L, B, max_len, plan.local_kv_heads, head_dim)
    logits, cache = op(input_ids, kv_cache=cache)     # the full [B, S, V] on every rank

Per rank (:class:`atbcore.distributed.ShardPlan` says which rows): the merged QKV
Linear holds its q heads and KV heads (KV heads replicated when fewer than ranks);
the attention runs on those heads; the output projection is a ``LinearParallel``
(row-parallel + all-reduce); the gated FFN holds ``intermediate / N`` of gate/up
rows and down columns (a MoE block: of every expert's, :mod:`.lower_moe`) and is
followed by one ``AllReduce``; the embedding is a
``VocabParallelEmbedding`` and the LM head a column-parallel Linear whose logits
are all-gathered (padded vocab sliced off). Norms are replicated. Two all-reduces
per layer, one for the embedding, one all-gather for the logits.

How it reuses the single-device lowering: the sharded weights and a spec with the
local head / intermediate / vocab sizes go through ``decoder_layers``; then the
embedding and ``l{i}.o`` layers are swapped for their parallel ops, an AllReduce
is inserted after each ``l{i}.mlp``, and the gather after ``lm_head``.
:func:`shard_weights` slices anything that slices like a tensor (torch tensors,
safetensors ``get_slice`` handles), so a checkpoint loader can read only a shard
(:mod:`.shard_load`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from atbcore.distributed import ShardPlan, group_rank, group_size
from atbcore.errors import CapabilityError
from atbcore.graph.graph_op import GraphOp
from atbcore.models.decoder import decoder_layers
from atbcore.models.decoder import host_weight as _a
from atbcore.models.decoder import why_not_lowered as _why_not

from ..graph_layers import OpLayer
from .arch import LayerWeights, ModelSpec, ModelWeights, resolve_architecture
from .lower_moe import shard_experts

__all__ = ["shard_plan", "plan_for_rank", "shard_weights", "tp_decoder_layers", "lower_decoder_tp",
           "weight_bytes"]


def _spec(config: Any, op: str) -> tuple[Any, ModelSpec]:
    arch = resolve_architecture(config)
    spec = arch.describe(config)
    # what the sharding below splits: RmsNorm, RoPE, gated MLPs without biases
    tp = [(spec.norm != "rms", "LayerNorm blocks"), (spec.position != "rope", "learned positions"),
          (not spec.gated, "ungated MLPs"), (spec.qk_norm, "q/k norms")]
    why = "; ".join([w for w in (_why_not(spec),) if w] + [w for bad, w in tp if bad])
    if why:
        raise CapabilityError(op, why, "a Llama-family decoder", spec.arch)
    return arch, spec


def shard_plan(config: Any, group: Any = None, tensor_parallel: int | None = None
               ) -> ShardPlan:
    """This process's :class:`ShardPlan` for a Hugging Face ``config`` in ``group``
    (None: the default process group); ``tensor_parallel`` must equal its size."""
    world = group_size(group, "tensor_parallel")
    if tensor_parallel is not None and tensor_parallel != world:
        raise CapabilityError("tensor_parallel", "tensor_parallel must equal the processes "
                              "in the group", f"tensor_parallel {tensor_parallel}",
                              f"group of {world}")
    _, spec = _spec(config, "tensor_parallel")
    return ShardPlan.for_model(spec, group_rank(group, "tensor_parallel"), world)


def plan_for_rank(config: Any, rank: int, world: int, op: str = "tensor_parallel"
                  ) -> ShardPlan:
    """Rank ``rank`` of ``world``'s :class:`ShardPlan` for ``config`` without a
    process group: what a launcher checks before it starts any rank (the model must
    lower and its heads, KV heads and MLP must split)."""
    _, spec = _spec(config, op)
    return ShardPlan.for_model(spec, rank, world)


def _rows(t: Any, r: tuple[int, int]) -> Any:
    return None if t is None else t[r[0]:r[1]]


def _cols(t: Any, r: tuple[int, int]) -> Any:
    return None if t is None else t[:, r[0]:r[1]]


def _padded_rows(t: Any, r: tuple[int, int], rows: int) -> Any:
    """Rows ``r`` of ``t`` zero-padded to ``rows`` (the last vocab shard)."""
    if t is None:
        return None
    part = t[r[0]:r[1]]
    if part.shape[0] == rows:
        return part
    pad = torch.zeros((rows - part.shape[0], *part.shape[1:]), dtype=part.dtype)
    return torch.cat([torch.as_tensor(part), pad])


def shard_weights(w: ModelWeights, plan: ShardPlan) -> ModelWeights:
    """This rank's slices of ``w`` (full tensors or lazy slices) per ``plan``."""
    layers = []
    for lw in w.layers:
        if lw.q_norm is not None:
            raise CapabilityError("tensor_parallel", "q/k-norm blocks",
                                  "a Llama-family decoder", "q/k norms")
        if any(b is not None for b in (lw.gate_b, lw.up_b, lw.down_b)):
            raise CapabilityError("tensor_parallel", "MLP biases (not sharded)",
                                  "a Llama-family decoder", "mlp biases")
        q, kv, f = plan.q_rows, plan.kv_rows, plan.ffn_rows
        moe: dict[str, Any] = {}
        if lw.router is not None:  # every expert split like the dense FFN (.lower_moe)
            gu, dn = shard_experts(lw.experts_gate_up, lw.experts_down, f,
                                   plan.intermediate_size)
            moe = {"router": lw.router[:], "experts_gate_up": gu, "experts_down": dn}
        layers.append(LayerWeights(**moe,
            q=_rows(lw.q, q), k=_rows(lw.k, kv), v=_rows(lw.v, kv), o=_cols(lw.o, q),
            q_b=_rows(lw.q_b, q), k_b=_rows(lw.k_b, kv), v_b=_rows(lw.v_b, kv),
            o_b=None if lw.o_b is None else lw.o_b[:],   # added once, after the reduce
            attn_norm=lw.attn_norm[:], mlp_norm=lw.mlp_norm[:],
            gate=_rows(lw.gate, f), up=_rows(lw.up, f), down=_cols(lw.down, f)))
    v, per = plan.vocab_rows, plan.vocab_per_rank
    return ModelWeights(embed=_padded_rows(w.embed, v, per), layers=layers,
                        final_norm=w.final_norm[:], lm_head=_padded_rows(w.lm_head, v, per),
                        lm_head_b=_padded_rows(w.lm_head_b, v, per))


def _local_spec(spec: ModelSpec, plan: ShardPlan) -> ModelSpec:
    return dataclasses.replace(spec, num_heads=plan.local_heads,
                               num_kv_heads=plan.local_kv_heads,
                               intermediate_size=spec.intermediate_size // plan.world,
                               vocab_size=plan.vocab_per_rank)


def tp_decoder_layers(spec: ModelSpec, shard: ModelWeights, plan: ShardPlan,
                      group: Any = None) -> list[Any]:
    """Rank ``plan.rank``'s atb layers from its sharded weights (module docstring)."""
    collective = {"group": group, "rank_size": plan.world}
    out: list[Any] = []
    for layer in decoder_layers(_local_spec(spec, plan), shard):
        name = layer.name
        if name == "embed":
            layer = OpLayer("embed", op="VocabParallelEmbedding", kind="embedding",
                            params=collective, weights={"weight": _a(shard.embed)}, x_index=1)
        elif name.endswith(".o"):
            i = int(name[1:-2])
            o = {"weight": _a(shard.layers[i].o)}
            if shard.layers[i].o_b is not None:
                o["bias"] = _a(shard.layers[i].o_b)
            layer = OpLayer(name, op="LinearParallel", kind="linear_parallel",
                            params={**collective, "type": "linear_all_reduce"}, weights=o)
        out.append(layer)
        if name.endswith(".mlp"):
            out.append(OpLayer(f"{name}_reduce", op="AllReduce", kind="all_reduce",
                               params=collective))
        elif name == "lm_head":
            out.append(OpLayer("logits_gather", op="AllGather", kind="all_gather",
                               params={**collective, "axis": -1}))
            if plan.vocab_per_rank * plan.world != spec.vocab_size:
                pad = plan.vocab_per_rank * plan.world - spec.vocab_size
                # the first part (the real vocab) is the layer's output; any rank of logits
                out.append(OpLayer("logits", op="Split", kind="split",
                                   params={"dim": -1, "sizes": (spec.vocab_size, pad)}))
    return out


def weight_bytes(layers: list[Any]) -> int:
    """Bytes of every weight the layers hold (what a rank keeps in memory)."""
    return sum(int(a.nbytes if hasattr(a, "layout") else np.asarray(a).nbytes)  # packed: its bytes
               for layer in layers for a in layer.weights().values())


def lower_decoder_tp(model: Any, tensor_parallel: int | None = None, *, group: Any = None,
                     weights: ModelWeights | None = None, **graph_op_kwargs: Any) -> GraphOp:
    """This rank's share of the Hugging Face causal LM ``model`` as one GraphOp
    (ids ``[B, S]`` -> full logits ``[B, S, V]`` on every rank). Call it inside an
    initialised process group (``group``: None = the default one) of
    ``tensor_parallel`` processes. ``weights``: this rank's already-sharded
    weights (e.g. from :func:`.shard_load.load_shard`); ``model`` may then be just
    a config. :func:`shard_plan` says what this rank holds."""
    config = getattr(model, "config", model)
    arch, spec = _spec(config, "lower_decoder_tp")
    plan = shard_plan(config, group, tensor_parallel)
    if weights is None:
        full = arch.extract(model, spec)
        if full.lm_head is None:
            raise CapabilityError("lower_decoder_tp", "a base model (no LM head)",
                                  "a causal LM", type(model).__name__)
        weights = shard_weights(full, plan)
    return GraphOp(tp_decoder_layers(spec, weights, plan, group),
                   name=f"{spec.arch}.tp{plan.rank}of{plan.world}", **graph_op_kwargs)
