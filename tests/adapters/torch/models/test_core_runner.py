"""compile()'s core engine (CoreRunner over a RowKVCache) on Hugging Face's semantics:
padding anywhere in a 2-D mask, masks that pad earlier slots, logits_to_keep, the
cache's Hugging Face view, growth past its capacity; HF eager is the oracle."""

import pytest
import torch
from transformers.cache_utils import DynamicCache

from atbcore.errors import CapabilityError
from atbcore.numerics import assert_close
from atb_torch.models import compile
from atb_torch.models.core_runner import CoreRunner
from tiny_models import VOCAB, left_padded, tiny


@pytest.fixture(scope="module")
def pair():
    m = tiny("llama", seed=4)
    c = compile(m)
    assert isinstance(c.atb_runner, CoreRunner)
    return m, c


def _ids(b, s, seed=0):
    return torch.randint(3, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pattern", ["right", "middle", "mixed"])
def test_padding_anywhere_equals_hf_at_real_tokens(pair, pattern):
    m, c = pair
    ids = _ids(3, 9, seed=1)
    mask = torch.ones(3, 9, dtype=torch.long)
    if pattern == "right":
        mask[0, 6:] = 0
        mask[2, 4:] = 0
    elif pattern == "middle":
        mask[1, 3:5] = 0
    else:
        mask[0, :2] = 0
        mask[1, 7:] = 0
        mask[2, 4] = 0
    with torch.no_grad():
        ref = m(ids, attention_mask=mask).logits
        out = c(ids, attention_mask=mask).logits
    real = mask.bool()
    assert_close(out[real], ref[real], "fp32", f"{pattern} padding")
    assert (out[~real] == 0).all()  # padding positions: zeros (HF's are undefined)


def test_logits_to_keep_int_and_tensor(pair):
    m, c = pair
    ids, mask = left_padded([6, 9], seed=2)
    with torch.no_grad():
        full = m(ids, attention_mask=mask).logits
        for keep in (1, 3, torch.tensor([0, 4, 8]), torch.tensor([-1])):
            out = c(ids, attention_mask=mask, logits_to_keep=keep).logits
            want = full[:, -keep:] if isinstance(keep, int) else full[:, keep]
            m_k = mask.bool()[:, -keep:] if isinstance(keep, int) else mask.bool()[:, keep]
            assert out.shape == want.shape
            assert_close(out[m_k], want[m_k], "fp32", f"logits_to_keep {keep}")


def test_mask_padding_a_past_slot_drops_it(pair):
    """A later call's mask marks an earlier real token as padding: HF masks it from
    then on; the rows drop it."""
    m, c = pair
    ids = _ids(2, 6, seed=3)
    mask = torch.ones(2, 6, dtype=torch.long)
    with torch.no_grad():
        r = m(ids, attention_mask=mask, use_cache=True)
        o = c(ids, attention_mask=mask, use_cache=True)
        tok = r.logits[:, -1].argmax(-1, keepdim=True)
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        mask2[1, 2] = 0
        pos = torch.full((2, 1), 6)
        r2 = m(tok, attention_mask=mask2, position_ids=pos, past_key_values=r.past_key_values)
        o2 = c(tok, attention_mask=mask2, position_ids=pos, past_key_values=o.past_key_values)
        assert_close(o2.logits, r2.logits, "fp32", "after dropping a past slot")
        kv = o2.past_key_values.kv
        assert kv.real_lens().tolist() == [7, 6] and kv.length == 7
        # reviving the dropped slot cannot be answered: refused, the cache untouched
        mask3 = torch.cat([mask2, torch.ones(2, 1, dtype=torch.long)], 1)
        mask3[1, 2] = 1
        with pytest.raises(CapabilityError, match="padded cache slots"):
            c(tok, attention_mask=mask3, past_key_values=o2.past_key_values)
        assert kv.real_lens().tolist() == [7, 6] and kv.length == 7


def test_cache_view_is_hf_layout_with_padding(pair):
    m, c = pair
    ids, mask = left_padded([4, 7], seed=5)
    with torch.no_grad():
        r = m(ids, attention_mask=mask, use_cache=True).past_key_values
        o = c(ids, attention_mask=mask, use_cache=True).past_key_values
    assert o.get_seq_length() == r.get_seq_length() == 7
    real = mask.bool()
    for (ko, vo), layer in zip(o, r.layers):
        assert ko.shape == layer.keys.shape
        # [B, Hkv, S, D]: compare the real slots, and padding slots are zeros
        assert_close(ko.transpose(1, 2)[real], layer.keys.transpose(1, 2)[real], "fp32", "keys")
        assert_close(vo.transpose(1, 2)[real], layer.values.transpose(1, 2)[real], "fp32", "values")
        assert (ko.transpose(1, 2)[~real] == 0).all()


def test_hf_cache_in_and_growth_past_capacity(pair):
    """A DynamicCache converted in, then decode steps past the cache's first capacity
    (its block doubles and moves): every step equals HF."""
    m, c = pair
    ids = _ids(1, 5, seed=6)
    with torch.no_grad():
        r = m(ids, use_cache=True)
        pkv = DynamicCache(config=m.config)
        for i, layer in enumerate(r.past_key_values.layers):
            pkv.update(layer.keys.clone(), layer.values.clone(), i)
        tok = r.logits[:, -1].argmax(-1, keepdim=True)
        ref_pkv, out_pkv = r.past_key_values, pkv
        for step in range(40):
            rr = m(tok, past_key_values=ref_pkv, use_cache=True)
            oo = c(tok, past_key_values=out_pkv, use_cache=True)
            assert_close(oo.logits, rr.logits, "fp32", f"step {step}")
            ref_pkv, out_pkv = rr.past_key_values, oo.past_key_values
            tok = rr.logits[:, -1].argmax(-1, keepdim=True)
    assert out_pkv.kv.capacity >= 45 and out_pkv.kv.version >= 1  # grew (from 16 slots)


def test_base_model_on_the_core_engine():
    m = tiny("qwen2", seed=2).model  # no LM head: the final hidden states
    c = compile(m)
    assert isinstance(c.atb_runner, CoreRunner)
    ids, mask = left_padded([3, 8], seed=7)
    with torch.no_grad():
        ref = m(ids, attention_mask=mask).last_hidden_state
        out = c(ids, attention_mask=mask).last_hidden_state
    assert_close(out[mask.bool()], ref[mask.bool()], "fp32", "Qwen2Model hidden states")


def test_compiled_decoder_keeps_one_merged_gate_up_for_both_lowerings():
    """The plain lowering and the in-place cache form share the merged weights
    (passes.rewrite.weight_memo): one copy in memory, not one per lowering."""
    m = tiny("llama", seed=3)
    c = compile(m)
    r = c.atb_runner
    cache = r.new_cache(1, 16)
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = r.prefill(ids, cache)
        ref = m(ids).logits[:, -1]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    op, form = r.op, r.op._in_place
    assert op.graph is not None and form and form.graph is not None
    merged = [k for k in form.graph.weight_map if k.endswith("gate_up.weight")]
    assert merged, "the standard pipeline merges gate|up"
    for k in merged:
        assert op.graph.weight_map[k] is form.graph.weight_map[k]
