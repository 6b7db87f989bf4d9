"""Each rank reads only its shard of a seeded local safetensors checkpoint through
``get_slice`` (never a whole-tensor read of a sharded weight), and the shard equals
the same rank's slices of the in-memory model."""

from __future__ import annotations

import pytest
import safetensors
import torch

from atb_torch.models.arch import resolve_architecture
from atb_torch.models.lower_tp import shard_weights
from atb_torch.models.shard_load import load_shard
from atbcore.distributed import ShardPlan
from atbcore.errors import InputError
from tiny_models import tiny


class _SpyOpen:
    """safetensors.safe_open that records every tensor read and its bytes."""

    reads: list = []

    def __init__(self, path, framework):
        self._h = _REAL_OPEN(path, framework=framework)

    def __enter__(self):
        self._h.__enter__()
        return self

    def __exit__(self, *exc):
        return self._h.__exit__(*exc)

    def keys(self):
        return self._h.keys()

    def get_tensor(self, name):
        raise AssertionError(f"whole-tensor read of {name}")

    def get_slice(self, name):
        inner, reads = self._h.get_slice(name), self.reads

        class Slice:
            def __getitem__(self, idx):
                t = inner[idx]
                reads.append((name, t.numel() * t.element_size()))
                return t
        return Slice()


_REAL_OPEN = safetensors.safe_open


def _tensors(w):
    yield "embed", w.embed
    yield "lm_head", w.lm_head
    yield "final_norm", w.final_norm
    for i, lw in enumerate(w.layers):
        for k in ("q", "k", "v", "o", "q_b", "k_b", "v_b", "attn_norm", "mlp_norm", "gate", "up",
                  "down"):
            if getattr(lw, k) is not None:
                yield f"l{i}.{k}", getattr(lw, k)


@pytest.mark.parametrize("arch,over", [("llama", {}), ("qwen2", {"num_key_value_heads": 1,
                                                                 "vocab_size": 251})])
def test_each_rank_reads_only_its_slices(tmp_path, monkeypatch, arch, over):
    hf = tiny(arch, **over)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    total = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    spec = resolve_architecture(hf.config).describe(hf.config)
    full = resolve_architecture(hf.config).extract(hf, spec)
    monkeypatch.setattr(safetensors, "safe_open", _SpyOpen)
    for rank in range(2):
        _SpyOpen.reads = []
        plan = ShardPlan.for_model(spec, rank, 2)
        got = dict(_tensors(load_shard(tmp_path, plan)))
        want = dict(_tensors(shard_weights(full, plan)))
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (rank, k)
        read = sum(b for _, b in _SpyOpen.reads)
        assert 0.45 * total <= read <= 0.6 * total, (rank, read, total)


def test_missing_checkpoint_is_refused_by_name(tmp_path):
    with pytest.raises(InputError, match="safetensors"):
        load_shard(tmp_path, ShardPlan(0, 2, 64, 4, 2, 16, 128, 256))
