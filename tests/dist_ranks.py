"""Test helper: ``run_ranks(worker, args, world=2)`` runs ``worker`` on real gloo
processes (:func:`atbcore.distributed.launch.spawn_ranks`, one torch thread per
rank on this shared machine)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from atbcore.distributed.launch import spawn_ranks


def run_ranks(worker: Callable, args: Sequence[Any] = (), world: int = 2,
              timeout: float = 120.0) -> list[Any]:
    return spawn_ranks(worker, args, world, device="cpu", timeout=timeout, threads=1)
