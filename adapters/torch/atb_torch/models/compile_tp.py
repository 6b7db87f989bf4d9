"""``compile(model, tensor_parallel=N)``: a Hugging Face decoder (Llama, Mistral,
Qwen2, Mixtral) sharded over the N ranks of an initialised process group, each rank
running its share as one core GraphOp (:func:`.lower_tp.lower_decoder_tp`:
column-parallel QKV and gate|up -- of every expert for Mixtral, :mod:`.lower_moe` --
row-parallel output and down projections with one all-reduce each, vocab-parallel
embedding and LM head) with its KV heads' cache written in place. ``LLM(path,
tensor_parallel_size=N)`` (:mod:`atb_torch.llm.tp`) runs the same ShardedDecoder
on ranks it starts itself.

    dist.init_process_group("gloo")                      # torchrun, or atbcore.distributed
    fast = atb.compile(hf_model, tensor_parallel=2)      # on every rank, same model
    ids = fast.generate(input_ids, max_new_tokens=32)    # every rank returns the same ids

Every rank must call ``generate`` / ``forward`` with the same inputs (the collectives
pair them up); each gets the full logits. ``generate`` is the GraphOp models' loop
(:mod:`.graph_model`: greedy, or atb's seeded sampling). The KV cache holds
``max_seq_len`` positions (default: the config's ``max_position_embeddings``, at
most 4096) for the largest batch seen, and is made again for a larger batch.
"""

from __future__ import annotations

from typing import Any

import torch

from atbcore.errors import CapabilityError, ParamsError

__all__ = ["ShardedDecoder", "compile_tensor_parallel"]

_MAX_DEFAULT_LEN = 4096


class ShardedDecoder(torch.nn.Module):
    """This rank's share of a decoder (``.op``, a core GraphOp) and its KV cache:
    ``forward(input_ids [B, S]) -> logits [B, S, V]``, the cache advanced by S.
    ``weights``: this rank's already-sharded weights (:func:`.shard_load.load_shard`;
    ``model`` may then be anything with the ``config``)."""

    def __init__(self, model: Any, tensor_parallel: int, max_seq_len: int | None = None,
                 *, weights: Any = None) -> None:
        super().__init__()
        from .lower_tp import lower_decoder_tp, shard_plan

        cfg = model.config
        self.op = lower_decoder_tp(model, tensor_parallel=tensor_parallel, weights=weights)
        self.plan = shard_plan(cfg, tensor_parallel=tensor_parallel)
        self.layers = cfg.num_hidden_layers
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype = (weights.final_norm.dtype if weights is not None
                      else next(model.parameters()).dtype)
        self.max_seq_len = int(max_seq_len or min(
            getattr(cfg, "max_position_embeddings", _MAX_DEFAULT_LEN), _MAX_DEFAULT_LEN))
        self.kv_cache: Any = None

    def _cache_for(self, batch: int) -> Any:
        from atbcore.dtypes import Dtype
        from atbcore.memory import KVCache

        kv = self.kv_cache
        if kv is None or kv.max_batch < batch:
            if kv is not None:
                kv.free()
            kv = self.kv_cache = KVCache(self.layers, batch, self.max_seq_len,
                                         self.plan.local_kv_heads, self.head_dim,
                                         dtype=Dtype.of(self.dtype).name.lower())
        return kv

    def reset(self) -> None:
        """Empty the KV cache (the next call is a prompt)."""
        if self.kv_cache is not None:
            self.kv_cache.reset()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ParamsError("compile(tensor_parallel)", "input_ids", "a [B, S] tensor of ids",
                              list(input_ids.shape))
        logits, self.kv_cache = self.op(input_ids, kv_cache=self._cache_for(input_ids.shape[0]))
        return logits


def compile_tensor_parallel(model: Any, tensor_parallel: int, options: dict) -> Any:
    """``model`` sharded over ``tensor_parallel`` ranks (see the module docstring)."""
    import torch.distributed as dist

    for name, off in (("quantize", None), ("enable_prefix_caching", False),
                      ("enable_speculative", False), ("dtype", None),
                      ("kv_cache_dtype", None)):
        if options.get(name) != off:
            raise CapabilityError("compile(tensor_parallel)", f"{name} with tensor parallelism",
                                  f"{name}={off!r}", repr(options.get(name)))
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != tensor_parallel:
        raise CapabilityError("compile(tensor_parallel)", "an initialised process group of "
                              "tensor_parallel ranks (torchrun, or init_process_group)",
                              f"{tensor_parallel} ranks", f"world size {world}")
    from .graph_model import compile_graph_model

    return compile_graph_model(ShardedDecoder(model, tensor_parallel), options)
