"""Beyond one device: process groups, the collective backend per device and the
Megatron sharding plan. torch.distributed is the transport underneath (gloo on CPU,
nccl on CUDA, hccl on Ascend); atb never ships its own.

:func:`.launch.spawn_ranks` starts N local processes in one group (tests, benchmarks).
The collective ops themselves (AllReduce, AllGather, ReduceScatter, Broadcast,
AllToAll, LinearParallel) live in :mod:`atbcore.ops.collective`.
"""

from .groups import (BACKEND_BY_DEVICE, backend_for_device, group_rank, group_size,
                     init_distributed, register_group, resolve_group, unregister_group)
from .sharding import ShardPlan, shard_ranges

__all__ = ["BACKEND_BY_DEVICE", "backend_for_device", "group_rank", "group_size",
           "init_distributed", "register_group", "resolve_group", "unregister_group",
           "ShardPlan", "shard_ranges"]
