"""``LLM(path, tensor_parallel_size=N)``: a local checkpoint sharded over N ranks.

    llm = LLM("ckpt", tensor_parallel_size=2)     # starts rank 1 itself; this process is rank 0
    llm.generate(["Hello", "Once upon"], max_new_tokens=32)       # same API as one process
    llm.close()                                   # stops the other ranks

Each rank reads only its slices of the safetensors files
(:func:`~atb_torch.models.shard_load.load_shard`: its q/KV heads, ``1/N`` of the
MLP or of every expert, ``1/N`` of the vocabulary) and runs them as one core GraphOp
(:class:`~atb_torch.models.compile_tp.ShardedDecoder`). Rank 0 tokenizes, schedules
and samples (:class:`.tp_engine.TensorParallelEngine`, driven by the same engine
thread as a one-process ``LLM``); before each forward it broadcasts the step's
token ids and the other ranks run the same forward (:func:`.tp_engine.follow`).

How the ranks start:

* in a plain process, the ``LLM`` starts ranks ``1..N-1`` as fresh processes
  (``atbcore.distributed.launch.start_ranks``, the ``spawn`` method: guard your
  script with ``if __name__ == "__main__":``) and becomes rank 0 of a new gloo
  group; :meth:`close` (or garbage collection) stops them;
* under ``torchrun --nproc-per-node N`` (``RANK`` / ``WORLD_SIZE`` set), or in a
  process group already initialised with N ranks, every process constructs the
  ``LLM``: on rank 0 it returns the driver, on the others the constructor follows
  rank 0 until rank 0 closes its ``LLM`` and returns a closed one
  (``llm.is_driver`` is False)::

      llm = LLM("ckpt", tensor_parallel_size=2)
      if llm.is_driver:
          print(llm.generate("Hello"))
          llm.close()

Greedy and seeded sampling give the text a one-process ``LLM`` gives. Not in this
path (refused by name): ``quantize``, ``enable_speculative``, devices other than
the CPU, an in-memory model; prefix caching is ignored and batches are static (see
:mod:`.tp_engine`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import traceback
import weakref
from typing import Any

import torch

from atbcore.errors import AtbError, CapabilityError, ParamsError

from .checkpoint import check_checkpoint_dir, load_tokenizer
from .llm import LLM
from .loop import EngineLoop
from .outputs import GenerationStats
from .tp_engine import TensorParallelEngine, broadcast_step, follow

__all__ = ["TensorParallelLLM", "check_tensor_parallel_size", "load_rank"]

_WHO = "LLM(tensor_parallel_size)"
_TIMEOUT_S = 600.0  # a collective waiting longer than this for a peer raises
_ACTIVE: list[Any] = [None]  # weakref to the driver holding the process group, if any


def check_tensor_parallel_size(n: Any) -> int:
    """``n`` when it is an int >= 1; ParamsError otherwise."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ParamsError(_WHO, "tensor_parallel_size", "an int >= 1", repr(n))
    return n


def _cast(w: Any, dtype: torch.dtype | None) -> Any:
    """``w`` (ModelWeights / LayerWeights) with every float tensor in ``dtype``."""
    if dtype is None:
        return w
    out = {}
    for f in dataclasses.fields(w):
        v = getattr(w, f.name)
        if isinstance(v, list):
            v = [_cast(x, dtype) for x in v]
        elif isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.to(dtype)
        out[f.name] = v
    return type(w)(**out)


class _ConfigOnly:
    def __init__(self, config: Any) -> None:
        self.config = config


def load_rank(path: str, world: int, dtype: torch.dtype | None = None,
              max_seq_len: int | None = None) -> Any:
    """This rank's ShardedDecoder, its weights read from the checkpoint's files (in
    an initialised process group of ``world``)."""
    from transformers import AutoConfig

    from ..models.compile_tp import ShardedDecoder
    from ..models.lower_tp import shard_plan
    from ..models.shard_load import load_shard

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    weights = _cast(load_shard(path, shard_plan(config, tensor_parallel=world)), dtype)
    return ShardedDecoder(_ConfigOnly(config), world, max_seq_len, weights=weights)


def _agree(error: str | None) -> list[str | None]:
    """Every rank's load error (None: loaded), gathered on every rank."""
    import torch.distributed as dist

    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def _load_and_agree(path: str, world: int, dtype: Any, max_seq_len: Any) -> tuple[Any, list]:
    decoder, error = None, None
    try:
        decoder = load_rank(path, world, dtype, max_seq_len)
    except Exception:  # noqa: BLE001 - told to every rank, raised on rank 0
        error = traceback.format_exc()
    return decoder, _agree(error)


def follower_main(rank: int, world: int, path: str, dtype: Any, max_seq_len: Any) -> int:
    """A started rank (``start_ranks`` worker): load the shard, follow rank 0."""
    decoder, errors = _load_and_agree(path, world, dtype, max_seq_len)
    if any(errors):
        return 0
    try:
        return follow(decoder)
    finally:
        _stop(None, decoder, [], None, False)


def _join_group(world: int, device: str) -> tuple[int, str | None, str | None, bool]:
    """``(rank, store, its directory, group made here)``: a running group of ``world``
    or torchrun's (joined here; no store), else rank 0 of a group still to start
    at a new file store."""
    import torch.distributed as dist

    from atbcore.distributed import backend_for_device

    other = _ACTIVE[0]() if _ACTIVE[0] is not None else None
    if other is not None and other.is_driver and not other._finalizer_done():
        raise CapabilityError(_WHO, "another tensor-parallel LLM is running in this process",
                              "one at a time (close() it first)", repr(other))
    if dist.is_available() and dist.is_initialized():
        given = dist.get_world_size()
        if given != world:
            raise CapabilityError(_WHO, "the running process group's size",
                                  f"{world} ranks", f"world size {given}")
        return dist.get_rank(), None, None, False
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is not None and "RANK" in os.environ:  # torchrun
        if int(env_world) != world:
            raise ParamsError(_WHO, "tensor_parallel_size", f"WORLD_SIZE {env_world} "
                              "(torchrun's --nproc-per-node)", world)
        dist.init_process_group(backend_for_device(device), init_method="env://")
        return dist.get_rank(), None, None, True
    tmp = tempfile.mkdtemp(prefix="atb-tp-")
    return 0, os.path.join(tmp, "store"), tmp, True


class TensorParallelLLM(LLM):
    """What ``LLM(path, tensor_parallel_size=N > 1)`` returns (module docstring);
    the methods of :class:`LLM`."""

    def __init__(self, model: Any, device: str = "cpu", dtype: Any = None,
                 quantize: str | None = None, enable_prefix_caching: bool = True,
                 enable_speculative: bool = False, *, tokenizer: Any = None,
                 max_batch_size: int = 32, max_model_len: int | None = None,
                 tensor_parallel_size: int = 2, **_serving: Any) -> None:
        from ..models.lower_tp import plan_for_rank
        from .llm import _dtype

        world = check_tensor_parallel_size(tensor_parallel_size)
        for name, value, off in (("quantize", quantize, None),
                                 ("enable_speculative", enable_speculative, False)):
            if value != off:
                raise CapabilityError(_WHO, f"{name} with tensor parallelism", f"{name}={off!r}",
                                      repr(value))
        if str(device) != "cpu":
            raise CapabilityError(_WHO, "device", "cpu (gloo ranks)", repr(device))
        if not isinstance(model, (str, os.PathLike)):
            raise CapabilityError(_WHO, "model", "a checkpoint directory (each rank reads "
                                  "its shard of the files)", type(model).__name__)
        path = check_checkpoint_dir(model, _WHO)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        plan_for_rank(config, 0, world, _WHO)  # refuses what does not split, before any start
        tdtype = _dtype(dtype)
        self.path, self.config, self.is_driver = str(path), config, True
        self.tensor_parallel_size = world
        self._results: Any = None
        self._finalizer: Any = None
        self.rank, self._procs, self._tmp, owns = self._start(world, str(path), tdtype,
                                                              max_model_len)
        decoder, errors = _load_and_agree(str(path), world, tdtype, max_model_len)
        if any(errors):
            _stop(None, None, self._procs, self._tmp, owns)
            rank, why = next((r, e) for r, e in enumerate(errors) if e)
            raise AtbError(_WHO, f"rank {rank} could not load its shard", "every rank loaded",
                           f"\n{why}")
        if self.rank != 0:  # torchrun / an existing group: serve rank 0, then return closed
            self.is_driver = False
            try:
                follow(decoder)
            finally:
                _stop(None, decoder, [], None, owns)
            return
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path, _WHO)
        self.device, self.dtype = torch.device("cpu"), decoder.dtype
        self.vocab_size = config.vocab_size
        self.max_model_len = min(max_model_len or decoder.max_seq_len, decoder.max_seq_len)
        self.eos_ids = self._eos_ids(_checkpoint_eos(config, path))
        self.enable_speculative, self.cache = False, None
        self.engine = TensorParallelEngine(decoder, max_batch_size, self.max_model_len)
        self.loop = EngineLoop(self.engine)
        self._finalizer = weakref.finalize(self, _stop, self.loop, decoder, self._procs,
                                           self._tmp, owns)
        self.last_stats = GenerationStats()
        _ACTIVE[0] = weakref.ref(self)

    def _finalizer_done(self) -> bool:
        return self._finalizer is None or not self._finalizer.alive

    def _start(self, world: int, path: str, dtype: Any, max_seq_len: Any
               ) -> tuple[int, list, Any, bool]:
        import torch.distributed as dist

        from atbcore.distributed import init_distributed
        from atbcore.distributed.launch import start_ranks

        rank, store, tmp, owns = _join_group(world, "cpu")
        if store is None:
            return rank, [], None, owns
        threads = max(1, (os.cpu_count() or 1) // world)
        procs, self._results = start_ranks(follower_main, (path, dtype, max_seq_len), world,
                                           range(1, world), store, threads=threads)
        try:
            init_distributed(0, world, f"file://{store}", "cpu", timeout=_TIMEOUT_S)
        except BaseException:
            _stop(None, None, procs, tmp, dist.is_initialized())
            raise
        return 0, procs, tmp, True

    def close(self) -> None:
        """Stop the engine thread and the other ranks, free the KV cache."""
        if self._finalizer is not None:
            self._finalizer()

    def __repr__(self) -> str:
        role = "rank 0 (driver)" if self.is_driver else f"rank {self.rank} (closed follower)"
        return (f"LLM({self.path}, tensor_parallel_size={self.tensor_parallel_size}, "
                f"{role})")


def _checkpoint_eos(config: Any, path: Any) -> Any:
    """An object with ``config`` and ``generation_config`` for ``LLM._eos_ids``."""
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError):
        gen = None
    return type("Eos", (), {"config": config, "generation_config": gen})()


def _stop(loop: Any, decoder: Any, procs: list, tmp: Any, owns_group: bool) -> None:
    """Close rank 0's loop, tell the followers to stop, join them, free the cache and
    the group this LLM made."""
    import torch.distributed as dist

    if loop is not None:
        loop.close()
        try:
            broadcast_step("stop", None)
        except Exception:  # noqa: BLE001 - a follower already gone: nothing to stop
            pass
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    if decoder is not None and decoder.kv_cache is not None and not decoder.kv_cache.freed:
        decoder.kv_cache.free()
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
