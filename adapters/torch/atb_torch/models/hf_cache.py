"""``AtbCache``: a Hugging Face ``Cache`` over a :class:`.row_cache.RowKVCache`.

Compiled models return it as ``past_key_values`` and accept it back, so
``model(ids, use_cache=True)`` → ``model(next_ids, past_key_values=out.past_key_values)``
and ``generate`` (which keeps whatever ``forward`` returned) work unchanged. It answers
``get_seq_length``, ``get_mask_sizes``, ``crop`` (assisted decoding rolls back through
it), ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` (beam
search), and exposes per-layer ``keys`` / ``values`` as ``[B, Hkv, S, D]`` views like
``DynamicCache``. Storage is allocated on the first forward (the batch is known then).

A Hugging Face cache passed to a compiled model is converted (its tensors copied in);
the compiled model returns the converted ``AtbCache``, and the original object is
not updated.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from atbcore.errors import CapabilityError

from .row_cache import RowKVCache

__all__ = ["AtbCache", "to_atb_cache"]


def _query_length(query: Any) -> int:
    """New tokens of a ``get_mask_sizes`` call: an int from transformers >= 5.2 (or so),
    the ``cache_position`` tensor before that."""
    return int(query.shape[0]) if isinstance(query, torch.Tensor) else int(query)


class _AtbLayer(CacheLayerMixin):
    """One layer's view of the shared cache (read-only for Hugging Face code)."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, owner: "AtbCache", idx: int) -> None:  # no super(): keys is a property
        self.owner, self.idx = owner, idx

    @property
    def is_initialized(self) -> bool:
        return self.owner.kv is not None

    def _view(self, which: int) -> torch.Tensor | None:
        kv = self.owner.kv
        if kv is None:
            return None
        return kv.hf_view(self.idx, which)  # rows of real tokens: padding put back

    @property
    def keys(self) -> torch.Tensor | None:
        return self._view(0)

    @property
    def values(self) -> torch.Tensor | None:
        return self._view(1)

    def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
        pass

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        raise CapabilityError("AtbCache", "update() from model code", "the compiled model "
                              "writes its own cache", "an uncompiled layer writing into it")

    def get_mask_sizes(self, query_length: Any) -> tuple[int, int]:
        return self.get_seq_length() + _query_length(query_length), 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers < 5.2 asks this instead
        return -1


class AtbCache(Cache):
    """See the module docstring. ``capacity``: slots to allocate on first use (it
    grows by doubling past that)."""

    def __init__(self, runner: Any, capacity: int = 0, kv: RowKVCache | None = None) -> None:
        self.runner, self.capacity, self.kv = runner, int(capacity), kv
        super().__init__(layers=[_AtbLayer(self, i) for i in range(runner.spec.num_layers)])

    def storage(self, batch: int, needed: int) -> RowKVCache:
        """The engine's cache, allocated for ``batch`` rows on first use."""
        if self.kv is None:
            self.kv = self.runner.new_cache(batch, max(self.capacity, needed, 16))
        elif self.kv.batch != batch:
            raise CapabilityError("AtbCache", "batch size change", f"{self.kv.batch} rows",
                                  f"{batch} rows")
        self.kv.reserve(needed)
        return self.kv

    # ------------------------------------------------------------------ Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.kv is None else self.kv.length

    def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + _query_length(query_length), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return -1 if self.kv is None else self.kv.batch

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (Hugging Face's convention since
        5.x); a positive count is the length to keep (the older convention, which
        transformers < 5.2 still uses in assisted decoding)."""
        if self.kv is None or tokens_to_remove == 0:
            return
        keep = tokens_to_remove if tokens_to_remove > 0 else self.kv.length + tokens_to_remove
        if keep < self.kv.length:
            self.kv.crop(max(keep, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.kv is not None:
            self.kv.select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.kv is not None:
            self.kv.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.kv is not None:
            idx = torch.arange(self.kv.batch, device=self.kv.device).repeat_interleave(repeats)
            self.kv.select(idx)

    def reset(self) -> None:
        if self.kv is not None:
            self.kv.reset()

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        for layer in self.layers:
            yield layer.keys, layer.values

    def __getitem__(self, idx: int) -> tuple[Any, Any]:
        layer = self.layers[idx]
        return layer.keys, layer.values

    def __repr__(self) -> str:
        return f"AtbCache({self.kv!r})"


def to_atb_cache(cache: Any, runner: Any, capacity: int) -> AtbCache:
    """``cache`` as an :class:`AtbCache` for ``runner`` (itself, or a copy of a Hugging
    Face cache's filled part). Refuses caches it cannot read exactly."""
    if isinstance(cache, AtbCache):
        if cache.runner is not runner:
            raise CapabilityError("compile", "past_key_values from another compiled model",
                                  "a cache this model returned", "a foreign AtbCache")
        return cache
    if not isinstance(cache, Cache):
        raise CapabilityError("compile", "past_key_values type", "a transformers Cache "
                              "(tuples of tensors are not accepted)", type(cache).__name__)
    n = cache.get_seq_length()
    out = AtbCache(runner, capacity)
    if n == 0:
        return out
    layers = getattr(cache, "layers", [])
    if len(layers) != runner.spec.num_layers or any(getattr(l, "is_sliding", False) for l in layers):
        raise CapabilityError("compile", "past_key_values layout", "one full-attention layer "
                              "per model layer", type(cache).__name__)
    k0 = layers[0].keys
    kv = out.storage(k0.shape[0], max(capacity, n + 1))
    for i, layer in enumerate(layers):
        # HF layers are [B, Hkv, S, D]; static ones are longer than their filled part
        kv.write(i, layer.keys[:, :, :n].transpose(1, 2), layer.values[:, :, :n].transpose(1, 2),
                 0)  # [B, S, Hkv, D]; an int8 cache quantizes them
    kv.length = n
    return out
