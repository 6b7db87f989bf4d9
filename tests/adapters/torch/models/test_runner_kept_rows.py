"""A prefill that wants only some rows' logits (each prompt's last token in the
paged engine, logits_to_keep in the general path) runs the last block on those rows."""

import pytest
import torch

from atbcore.memory import PagedKVCache
from atbcore.numerics import assert_close
from atb_torch.models import ModelRunner
from tiny_models import left_padded, tiny


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


class _Rows:
    """Wraps a block's Linear, recording the rows of every input it gets."""

    def __init__(self, lin):
        self.lin, self.rows = lin, []

    def __call__(self, x, *a, **k):
        self.rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return self.lin(x, *a, **k)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "mixtral", "qwen3"])
def test_last_block_runs_only_the_kept_rows(arch):
    """A prefill that wants each prompt's last logits runs the last block's output
    projection and MLP on those rows alone (and the C attention on those queries),
    with every row's keys and values still cached: logits equal HF's and the rows of
    a run that keeps every token; the next decode step equals HF on prompt + token."""
    m = tiny(arch)
    r = ModelRunner.from_hf(m, opt_level=2)
    s = r.spec
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n))
               for n in (9, 1, 14)]  # past Mistral's window of 6, and a one-token prompt
    ends = torch.tensor([9, 10, 24]) - 1
    paged = PagedKVCache(s.num_layers, num_blocks=64, block_size=4, num_kv_heads=s.num_kv_heads,
                         head_dim=s.head_dim, dtype="fp32")
    full = paged.prepare_prefill(["f0", "f1", "f2"], [p.tolist() for p in prompts])
    every = r.forward_paged(torch.cat(prompts), full, paged, all_logits=True)
    assert every.shape == (24, 256)
    batch = paged.prepare_prefill(["a", "b", "c"], [p.tolist() for p in prompts])
    last, first = r.blocks[-1], r.blocks[0]
    lin = "down" if last.down is not None else "o"
    spy_last, spy_first = _Rows(getattr(last, lin)), _Rows(getattr(first, lin))
    setattr(last, lin, spy_last), setattr(first, lin, spy_first)
    try:
        logits = r.forward_paged(torch.cat(prompts), batch, paged)
    finally:
        setattr(last, lin, spy_last.lin), setattr(first, lin, spy_first.lin)
    assert spy_last.rows == [3] and spy_first.rows == [24]
    assert_close(logits, every[ends], "fp32", f"{arch} kept rows vs all rows")
    with torch.no_grad():
        for i, p in enumerate(prompts):
            assert_close(logits[i], m(p[None]).logits[0, -1], "fp32", f"{arch} prompt {i} vs HF")
    paged.mark_computed(["a", "b", "c"])
    nxt = logits.argmax(-1)
    step = r.forward_paged(nxt, paged.prepare_decode(["a", "b", "c"], [[int(t)] for t in nxt]),
                           paged)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.cat([p, nxt[i:i + 1]])[None]
            assert_close(step[i], m(ids).logits[0, -1], "fp32", f"{arch} decode {i} vs HF")


@pytest.mark.parametrize("keep", [1, 3, torch.tensor([0, 4, 6])])
def test_general_forward_keeps_rows_like_hf(llama, keep):
    """``forward(logits_to_keep=...)`` (an int from the end, or token indices) runs
    the last block on those rows and gives HF's logits for them."""
    r = ModelRunner.from_hf(llama, opt_level=2)
    ids, mask = left_padded([5, 7], seed=4)
    spy = _Rows(r.blocks[-1].down)
    r.blocks[-1].down = spy
    try:
        got = r.forward(ids, r.new_cache(2, 16), attention_mask=mask, logits_to_keep=keep)
    finally:
        r.blocks[-1].down = spy.lin
    with torch.no_grad():
        ref = llama(ids, attention_mask=mask, logits_to_keep=keep).logits
    n = keep if isinstance(keep, int) else len(keep)
    assert got.shape == ref.shape == (2, n, 256) and spy.rows == [2 * n]
    valid = mask[:, -n:].bool() if isinstance(keep, int) else mask[:, keep].bool()
    assert_close(got[valid], ref[valid], "fp32", f"logits_to_keep={keep}")
