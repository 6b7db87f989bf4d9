"""Run a lowered decoder (a GraphOp of :func:`atbcore.models.decoder.decoder_layers`)
on chosen rows of an ``atbcore.memory.KVCache``, each row with its own past length.

``GraphOp(ids, kv_cache=cache)`` needs every row of the batch at the same length. A
serving loop runs rows of different lengths: a new prompt prefills its own row alone
(``B = 1``, ``S`` = its length) while other rows hold their own tokens, and a decode
step runs one token of each running row (``S = 1``, a past length per row). This
feeds the same in-place cache form (the plan writes the new keys/values into the
cache and reads it where it is: ``cache.block_tables`` names the cache row of each
batch row, ``cache.slot_mapping`` where each token goes, ``cache.context_lens`` the
length of each row after the call) with index tensors built per call:

    feeder = RowFeeder(op, cache, "mindspore", vocab_size)
    logits = feeder.run(ids, rows=[3], pasts=[0])          # ids [1, S] -> [S, V]
    logits = feeder.run(next_ids, rows=[0, 3], pasts=[9, 5])  # [2, 1] -> [2, V]
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import InputError, ShapeError
from ..tensor import convert
from ..graph.graph_op_kv import in_place_form

__all__ = ["RowFeeder"]


class RowFeeder:
    """The in-place cache form of ``op`` for ``cache``, fed row by row (see the module
    docstring); ``framework``: the tensors' framework (``numpy``, ``mindspore``,
    ``paddle``, ``torch``), whose backend runs the plan; ``vocab_size``: the rows of
    the embedding table (token ids are checked against it here)."""

    def __init__(self, op: Any, cache: Any, framework: str, vocab_size: int) -> None:
        self.cache, self.framework = cache, framework
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
        names = list(form.graph.inputs)
        self._x_at = names.index(feeder.graph.inputs[feeder._x_at])
        self._index_at = [names.index(n) for n in feeder.index]
        self._positions_at = [names.index(s.position_ids) for s in feeder.slots
                              if s.position_ids]
        self._inputs: list[Any] = [None] * len(names)
        for slot, layer in zip(feeder.slots, self.layers):
            self._inputs[names.index(slot.key_cache)] = convert(cache.keys(layer), framework)
            self._inputs[names.index(slot.value_cache)] = convert(cache.values(layer), framework)
        self._span = range(self.layers[0], self.layers[-1] + 1)

    def run(self, ids: np.ndarray, rows: Sequence[int], pasts: Sequence[int]) -> Any:
        """Logits ``[B*S, V]`` (the framework's tensor) of ``ids`` ``[B, S]`` placed
        after ``pasts[i]`` tokens of cache row ``rows[i]``; the rows' lengths in the
        cache grow by ``S``."""
        ids = np.asarray(ids, dtype=np.int64)
        b, s = ids.shape
        if self.vocab and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise InputError(self.form.name, "token ids", f"in [0, {self.vocab})",
                             ids.reshape(-1)[:8].tolist())
        rows_a = np.asarray(rows, dtype=np.int64)
        past = np.asarray(pasts, dtype=np.int64)
        cap = self.cache.max_seq_len
        if len(rows_a) != b or len(past) != b:
            raise InputError(self.form.name, "rows and pasts", f"{b} each (one per batch row)",
                             (len(rows_a), len(past)))
        if int((past + s).max()) > cap:
            raise ShapeError(self.form.name, "tokens in the KVCache after this call",
                             f"<= max_seq_len {cap}", int((past + s).max()))
        tok = past[:, None] + np.arange(s, dtype=np.int64)[None]        # [B, S] positions
        index = [(rows_a[:, None] * cap + tok).reshape(-1).astype(np.int32),  # slot_mapping
                 rows_a[:, None].astype(np.int32),                          # block_tables
                 (past + s).astype(np.int32),                               # context_lens
                 np.full(b, s, dtype=np.int32)]                             # q_seq_lens
        fw = self.framework
        inputs = list(self._inputs)
        for at, a in zip(self._index_at, index):
            inputs[at] = convert(a, fw)
        positions = convert(tok.reshape(-1), fw)
        for at in self._positions_at:
            inputs[at] = positions
        inputs[self._x_at] = convert(ids.reshape(-1), fw)
        out = self.form.execute(inputs)[0]
        self.cache.advance(self._span, s, [int(r) for r in rows_a])
        return out
