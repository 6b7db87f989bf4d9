"""The Megatron tensor-parallel plan of a decoder, as row ranges: which rows of
each full weight rank ``r`` of ``N`` holds. Framework-free numbers only; the
front-end slices tensors (or safetensors slices) with them.

* q heads: ``num_heads / N`` consecutive heads per rank (column-parallel QKV).
* kv heads: split the same way when ``num_kv_heads >= N``; with fewer KV heads
  than ranks each KV head is replicated on the ``N / num_kv_heads`` ranks whose
  q heads read it (so every rank keeps exactly one).
* gate/up rows and down columns: ``intermediate / N`` per rank (the MLP).
* o columns: the rank's q rows (row-parallel; one all-reduce after o, one after down).
* vocab: ``ceil(V / N)`` rows per rank (the last may hold fewer), for the
  vocab-parallel embedding and LM head.

    plan = ShardPlan.for_model(spec, rank=1, world=2)
    q_rows = plan.q_rows          # (start, stop) rows of q_proj.weight
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CapabilityError, ParamsError

__all__ = ["ShardPlan", "shard_ranges"]


def shard_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive ``(start, stop)`` ranges of ``ceil(total / parts)``
    (the last ones may be shorter or empty)."""
    per = -(-total // parts)
    return [(min(total, i * per), min(total, (i + 1) * per)) for i in range(parts)]


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``world``'s share of a decoder with the given geometry."""

    rank: int
    world: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ParamsError("tensor_parallel", "tensor_parallel size", "an int >= 1",
                              repr(self.world))
        if not 0 <= self.rank < self.world:
            raise ParamsError("tensor_parallel", "rank", f"in [0, {self.world})", self.rank)
        n, h, kv = self.world, self.num_heads, self.num_kv_heads
        checks = [
            (h % n, "attention heads split evenly over the ranks", f"{h} heads"),
            (self.intermediate_size % n, "MLP intermediate size split evenly over the ranks",
             f"intermediate {self.intermediate_size}"),
            (kv % n if kv >= n else n % kv,
             "KV heads split evenly over the ranks, or ranks a multiple of KV heads "
             "(replicated)", f"{kv} KV heads"),
        ]
        for bad, what, given in checks:
            if bad:
                raise CapabilityError("tensor_parallel", what, f"divisible by/into {n} ranks",
                                      given)

    @classmethod
    def for_model(cls, spec: Any, rank: int, world: int) -> "ShardPlan":
        """The plan for a ``ModelSpec``-like object (its geometry attributes)."""
        return cls(rank, world, spec.hidden_size, spec.num_heads, spec.num_kv_heads,
                   spec.head_dim, spec.intermediate_size, spec.vocab_size)

    # ------------------------------------------------------------------ heads
    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world)

    @property
    def kv_replicated(self) -> bool:
        """True when there are fewer KV heads than ranks (each rank keeps a copy)."""
        return self.num_kv_heads < self.world

    @property
    def q_rows(self) -> tuple[int, int]:
        h0 = self.rank * self.local_heads
        return h0 * self.head_dim, (h0 + self.local_heads) * self.head_dim

    @property
    def kv_rows(self) -> tuple[int, int]:
        if self.kv_replicated:
            group = self.num_heads // self.num_kv_heads  # q heads reading one KV head
            k0 = self.rank * self.local_heads // group
        else:
            k0 = self.rank * self.local_kv_heads
        return k0 * self.head_dim, (k0 + self.local_kv_heads) * self.head_dim

    # ------------------------------------------------------------------ MLP, vocab
    @property
    def ffn_rows(self) -> tuple[int, int]:
        per = self.intermediate_size // self.world
        return self.rank * per, (self.rank + 1) * per

    @property
    def vocab_per_rank(self) -> int:
        """Rows each rank's LM head shard has, padded (the logits gather needs
        equal shards)."""
        return -(-self.vocab_size // self.world)

    @property
    def vocab_rows(self) -> tuple[int, int]:
        return shard_ranges(self.vocab_size, self.world)[self.rank]
