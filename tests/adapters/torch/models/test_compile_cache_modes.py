"""compile()'s cache modes on the core engine, with Hugging Face as the oracle: an HF
DynamicCache read in and the compiled cache's HF view, growth past capacity, prefix
caching across generate calls, prompt-lookup speculation, opt_level 3 on the CPU."""

import copy
import logging

import pytest
import torch

from atbcore.numerics import assert_close
from atb_torch.models import compile
from atb_torch.models.core_runner import CoreRunner
from tiny_models import left_padded, tiny


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


def test_hf_cache_in_and_growth(llama):
    from transformers import DynamicCache

    c = compile(llama)
    assert isinstance(c.atb_runner, CoreRunner)
    ids, _ = left_padded([6], seed=11)
    with torch.no_grad():
        r = llama(ids, use_cache=True)
        assert isinstance(r.past_key_values, DynamicCache)
        tok = r.logits[:, -1:].argmax(-1)
        # an HF DynamicCache from the uncompiled model is read in (copied: HF appends in place)
        out = c(tok, past_key_values=copy.deepcopy(r.past_key_values))
        ref = llama(tok, past_key_values=r.past_key_values)
    assert_close(out.logits, ref.logits, "fp32", "from DynamicCache")
    k_hf, v_hf = ref.past_key_values.layers[1].keys, ref.past_key_values.layers[1].values
    assert_close(out.past_key_values.layers[1].keys, k_hf, "fp32", "keys view")
    assert_close(out.past_key_values[1][1], v_hf, "fp32", "values view")
    # growth: a runner cache of 2 slots grows while tokens arrive one at a time
    run = c.atb_runner
    kv = run.new_cache(1, 2)
    outs = [run.forward(ids[:, i:i + 1], kv)[:, -1] for i in range(ids.shape[1])]
    assert kv.capacity >= 6 and kv.length == 6
    with torch.no_grad():
        full = llama(ids).logits[0]
    assert_close(torch.cat(outs), full, "fp32", "token by token through growth")


def test_prefix_caching_generate(llama):
    c = compile(llama, enable_prefix_caching=True)
    p1, _ = left_padded([10], seed=12)
    g1 = c.generate(p1, max_new_tokens=6, do_sample=False)
    p2 = torch.cat([g1[:, :14], torch.tensor([[5, 6, 7]])], dim=1)
    g2 = c.generate(p2, max_new_tokens=6, do_sample=False)
    assert c.atb_runner.stats["prefix_hits"] == 14
    assert torch.equal(g2, llama.generate(p2, max_new_tokens=6, do_sample=False))
    assert torch.equal(g1, llama.generate(p1, max_new_tokens=6, do_sample=False))


def test_speculative_prompt_lookup_same_tokens(llama):
    c = compile(llama, enable_speculative=True)
    p = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    ref = llama.generate(p, max_new_tokens=16, do_sample=False)
    out = c.generate(p, max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert c.atb_runner.stats["general_steps"] > 1  # multi-token verification steps ran


def test_opt3_on_cpu_runs_as_opt2(llama, caplog):
    with caplog.at_level(logging.INFO, logger="atb"):
        c = compile(llama, opt_level=3)
    assert "runs as opt_level 2" in caplog.text
    ids, _ = left_padded([5], seed=13)
    assert torch.equal(c.generate(ids, max_new_tokens=8, do_sample=False),
                       llama.generate(ids, max_new_tokens=8, do_sample=False))
    assert isinstance(c.atb_runner, CoreRunner)  # no device graph to capture on the CPU
