"""Run a function on N real processes joined in a gloo group (test helper).

    results = run_ranks(worker, args, world=2)   # [worker(rank, world, *args) per rank]

``worker`` must be importable by module name (define it at module level in a test
helper module); what it returns is pickled back. A rank that raises fails the
call with its traceback; ranks that do not finish within ``timeout`` seconds are
killed, so a broken collective fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp


def _main(rank: int, world: int, store: str, worker: Callable, args: Sequence[Any],
          results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    try:
        from atbcore.distributed import init_distributed

        init_distributed(rank, world, f"file://{store}", device="cpu")
        try:
            results.put((rank, True, worker(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - sent to the parent, which fails the test
        results.put((rank, False, traceback.format_exc()))


def run_ranks(worker: Callable, args: Sequence[Any] = (), world: int = 2,
              timeout: float = 120.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_main, args=(r, world, os.path.join(tmp, "store"), worker,
                                                 tuple(args), results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        try:
            for _ in range(world):
                try:
                    rank, ok, value = results.get(timeout=timeout)
                except queue.Empty:
                    raise AssertionError(f"ranks {sorted(set(range(world)) - set(got))} did "
                                         f"not finish within {timeout} s") from None
                if not ok:
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                got[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [got[r] for r in range(world)]
