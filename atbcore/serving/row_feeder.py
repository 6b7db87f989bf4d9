"""Run a lowered decoder (a GraphOp of :func:`atbcore.models.decoder.decoder_layers`)
on chosen rows of an ``atbcore.memory.KVCache``, each row with its own past length.

A serving loop runs rows of different lengths: a new prompt prefills its own row alone
(``B = 1``, ``S`` = its length) while other rows hold their own tokens, and a decode
step runs one token of each running row (``S = 1``, a past length per row). This
runs the in-place cache form with the rows named
(:func:`atbcore.graph.graph_op_kv.run_in_place` with ``rows``: the plan writes the new
keys/values into the cache and reads it where it is), the token ids checked against
the vocabulary first:

    feeder = RowFeeder(op, cache, "mindspore", vocab_size)
    logits = feeder.run(ids, rows=[3], pasts=[0])          # ids [1, S] -> [S, V]
    logits = feeder.run(next_ids, rows=[0, 3], pasts=[9, 5])  # [2, 1] -> [2, V]
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import InputError
from ..tensor import convert, reshape
from ..graph.graph_op_kv import in_place_form, run_in_place

__all__ = ["RowFeeder"]


class RowFeeder:
    """The in-place cache form of ``op`` for ``cache``, fed row by row (see the module
    docstring); ``framework``: the tensors' framework (``numpy``, ``mindspore``,
    ``paddle``, ``torch``), whose backend runs the plan; ``vocab_size``: the rows of
    the embedding table (token ids are checked against it here)."""

    def __init__(self, op: Any, cache: Any, framework: str, vocab_size: int) -> None:
        self.op, self.cache, self.framework = op, cache, framework
        probe = convert(np.zeros((1, 1), dtype=np.int64), framework)
        if op.graph is None:  # the block's own lowering first: it assigns the cache layers
            op._ensure_graph(op._descs_of([probe]))
        form = in_place_form(op, probe, cache)
        if form is None:
            raise InputError(op.name, "decoder", "a block that takes the in-place KV cache "
                             "form (built from layers with FlashAttention(kv_cache=True))",
                             "a block without it")
        self.form = form
        feeder = form._feeder
        # the token ids are checked here against the table (run() below), so the plan
        # need not read them back from the framework's tensor
        form._trusted = form._trusted | {feeder.graph.inputs[feeder._x_at]}
        self.vocab = int(vocab_size)
        self.layers = feeder.layers._layers(cache)

    def run(self, ids: np.ndarray, rows: Sequence[int], pasts: Sequence[int]) -> Any:
        """Logits ``[B*S, V]`` (the framework's tensor) of ``ids`` ``[B, S]`` placed
        after ``pasts[i]`` tokens of cache row ``rows[i]`` (what the cache holds for
        it); the rows' lengths in the cache grow by ``S``. The in-place form is fed by
        its own :class:`~atbcore.graph.graph_op_feed.CacheFeeder` (index tensors kept
        per set of rows and moved forward in place)."""
        ids = np.asarray(ids, dtype=np.int64)
        b, s = ids.shape
        if self.vocab and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise InputError(self.form.name, "token ids", f"in [0, {self.vocab})",
                             ids.reshape(-1)[:8].tolist())
        if len(rows) != b or len(pasts) != b:
            raise InputError(self.form.name, "rows and pasts", f"{b} each (one per batch row)",
                             (len(rows), len(pasts)))
        held = self.cache.seq_lens([int(r) for r in rows], self.layers[0])
        if [int(v) for v in held] != [int(v) for v in pasts]:
            raise InputError(self.form.name, "pasts", f"the cache rows' lengths {held.tolist()}",
                             list(pasts))
        out = run_in_place(self.op, convert(ids, self.framework), self.cache, rows=rows)
        return reshape(out, [b * s, -1])
