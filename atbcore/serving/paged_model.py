"""The core lowered decoder as the serving engine's model: packed token ids of several
sequences over a :class:`~atbcore.memory.PagedKVCache`, run as a front-end's tensors
(its backend, and the C kernels it binds through DLPack, run the plan), logits back
on the host for :func:`~.select.select_tokens`. A cache on a device (torch's CUDA or
NPU) gets the token ids there, so the plan runs on the device's kernels; only the
``[B, V]`` logits come back.

    model = PagedDecoder(GraphOp(decoder_layers(spec, weights, last_token=True)),
                         cache, "paddle", vocab_size)
    engine = Engine(model, cache)                     # atbcore.serving.engine
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import InputError
from ..graph.graph_op_kv import in_place_form, run_paged
from ..tensor import convert

__all__ = ["PagedDecoder"]


class PagedDecoder:
    """``op`` (a lowered decoder with ``last_token=True``) run over ``cache`` with
    ``framework``'s tensors (``numpy``, ``mindspore``, ``paddle``, ``torch``);
    ``vocab_size``: the embedding's rows (token ids are checked against it here, so
    the plan need not read them back)."""

    def __init__(self, op: Any, cache: Any, framework: str, vocab_size: int) -> None:
        self.op, self.framework, self.vocab = op, framework, int(vocab_size)
        # where the ids go: the cache's device when it is one of this framework's
        dev = str(getattr(cache, "device", "cpu"))
        backing = getattr(getattr(cache, "pool", None), "backing", None)
        self.device = dev if dev.split(":")[0] != "cpu" and \
            getattr(backing, "name", None) == framework else None
        probe = self._ids(np.zeros((1, 1), dtype=np.int64))
        if op.graph is None:  # the block's own lowering first: it assigns the cache layers
            op._ensure_graph(op._descs_of([probe]))
        form = in_place_form(op, probe, cache)
        if form is None:
            raise InputError(op.name, "decoder", "a block that takes the in-place KV cache "
                             "form (built from layers with FlashAttention(kv_cache=True))",
                             "a block without it")
        feeder = form._feeder
        form._trusted = form._trusted | {feeder.graph.inputs[feeder._x_at]}

    def forward_paged(self, ids: Sequence[int], batch: Any, cache: Any,
                      all_logits: bool = False) -> np.ndarray:
        """fp32 host logits ``[B, V]`` of each sequence's last new token (``[T, V]``
        with ``all_logits``) of the packed ``ids`` of ``batch`` (a
        :class:`~atbcore.memory.paged.PagedBatch`); their keys/values are written
        into ``cache``."""
        x = np.asarray(ids, dtype=np.int64).reshape(-1)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.vocab):
            raise InputError(self.op.name, "token ids", f"in [0, {self.vocab})", x[:8].tolist())
        out = run_paged(self.op, self._ids(x), cache, batch, all_logits)
        if self.device is not None:  # the logits to the host, as fp32
            out = out.float().cpu()
        a = convert(out, "numpy")
        return a if a.dtype == np.float32 else np.asarray(a, dtype=np.float32)

    def _ids(self, x: np.ndarray) -> Any:
        """Host ids as the framework's tensor, on the cache's device."""
        t = convert(x, self.framework)
        return t if self.device is None else t.to(self.device)
