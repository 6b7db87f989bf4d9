"""Start N processes joined in one process group and run a function on each.

    from atbcore.distributed.launch import spawn_ranks
    results = spawn_ranks(worker, (arg,), world=2)   # [worker(rank, world, arg) per rank]

``worker`` must be importable by module name (a module-level function): the ranks
are fresh interpreters (the ``spawn`` start method), so nothing is inherited but
``sys.path``. Each rank initialises the default group with the backend its
``device`` needs (:func:`.groups.init_distributed`; a file store in a temporary
directory, so no port is opened) and destroys it afterwards. What ``worker``
returns is pickled back as bytes (plain ``pickle``: a tensor's data is copied into
them; the queue's own pickler would pass a tensor as a shared-memory file
descriptor, which is gone when the rank exits before the parent has read it). A rank that raises fails the call with its traceback;
ranks that do not answer within ``timeout`` seconds are killed, so a broken
collective raises instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import traceback
from typing import Any, Callable, Sequence

from ..errors import AtbError

__all__ = ["spawn_ranks", "start_ranks"]


def _rank_main(rank: int, world: int, store: str, device: str, threads: int | None,
               worker: Callable, args: Sequence[Any], results: Any, settle: bool) -> None:
    import torch
    import torch.distributed as dist

    if threads is not None:
        torch.set_num_threads(threads)
    from .groups import init_distributed

    try:
        init_distributed(rank, world, f"file://{store}", device=device)
        results.put((rank, True, pickle.dumps(worker(rank, world, *args))))
        if settle:  # no rank leaves before every rank's group is up: one whose worker
            dist.barrier()  # made no collective could close its connections while a
            # peer still connected to it (that peer's init failed: "closed by peer")
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        # reported before the group goes down, so the first error the parent reads is
        # this rank's own, not the "connection reset" its peers get afterwards
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # the answer is in the pipe before peers can see us go
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(worker: Callable, args: Sequence[Any], world: int, ranks: Sequence[int],
                store: str, *, device: str = "cpu", threads: int | None = 1,
                settle: bool = False) -> tuple[list, Any]:
    """Start ``worker(rank, world, *args)`` for each of ``ranks`` in its own process
    (joining the group of ``world`` at the file ``store``) and return at once:
    ``(processes, results)``, where ``results`` (a queue) gets ``(rank, ok, pickled
    value or traceback)`` from each. The ranks not started here (an ``LLM``'s rank 0, the
    caller itself) join with ``init_distributed(rank, world, f"file://{store}")``.
    ``settle``: each rank waits at a barrier after sending its result (every rank
    started here, none leaving while a peer still joins)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, store, device, threads, worker, tuple(args), results,
                               settle))
             for r in ranks]
    for p in procs:
        p.start()
    return procs, results


def spawn_ranks(worker: Callable, args: Sequence[Any] = (), world: int = 2, *,
                device: str = "cpu", timeout: float = 300.0, threads: int | None = 1
                ) -> list[Any]:
    """``[worker(rank, world, *args) for each rank]``, each in its own process
    (module docstring). ``threads``: torch threads per rank (None: torch's default)."""
    if not isinstance(world, int) or world < 1:
        raise AtbError("spawn_ranks", "world", "an int >= 1", repr(world))
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs, results = start_ranks(worker, args, world, range(world), store, device=device,
                                     threads=threads, settle=True)
        got: dict[int, Any] = {}
        failed = True
        try:
            while len(got) < world:
                try:
                    rank, ok, value = results.get(timeout=timeout)
                except queue.Empty:
                    missing = sorted(set(range(world)) - set(got))
                    raise AtbError("spawn_ranks", f"ranks {missing} did not finish",
                                   f"an answer within {timeout} s", "none") from None
                if not ok:
                    raise AtbError("spawn_ranks", f"rank {rank} failed", "a result",
                                   f"\n{value}")
                got[rank] = pickle.loads(value)
            failed = False
        finally:
            for p in procs:  # after a failure the others may wait on it forever: kill them
                p.join(timeout=0 if failed else 10)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [got[r] for r in range(world)]
