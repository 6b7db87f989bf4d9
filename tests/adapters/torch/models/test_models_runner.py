"""The ModelRunner API the serving code builds on: prebuilt decode plans (dynamic and
the graph-capturable static variant) against the general path, the paged cache
against the contiguous one, cache growth and conversion, prefix caching,
prompt-lookup speculation, opt level 3 on the CPU."""

import copy
import logging

import pytest
import torch

from atbcore.memory import PagedKVCache
from atbcore.numerics import assert_close
from atb_torch.models import ContiguousKVCache, DecodePlan, ModelRunner, compile
from atb_torch.models.plan import plan_for
from tiny_models import left_padded, tiny


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gpt2", "mixtral"])
def test_decode_plan_matches_general_path(arch):
    m = tiny(arch)
    fast, ref = ModelRunner.from_hf(m, opt_level=2), ModelRunner.from_hf(m, opt_level=1)
    ids, mask = left_padded([4, 9], seed=8)
    ca, cb = fast.new_cache(2, 8), ref.new_cache(2, 8)  # grows past 8 while decoding
    la, lb = fast.prefill(ids, ca, attention_mask=mask), ref.prefill(ids, cb, attention_mask=mask)
    assert_close(la, lb, "fp32", "prefill")
    for step in range(12):
        tok = lb.argmax(-1)
        la, lb = fast.decode(tok, ca).clone(), ref.decode(tok, cb)
        assert_close(la, lb, "fp32", f"{arch} step {step}")
    assert fast.stats["plan_steps"] == 12 and ref.stats["plan_steps"] == 0
    assert ca.length == cb.length == ids.shape[1] + 12
    assert ca.capacity >= ca.length and fast.stats["plans_built"] >= 2  # rebuilt after growth


def test_static_plan_matches_dynamic(llama):
    r = ModelRunner.from_hf(llama, opt_level=2)
    ids, mask = left_padded([3, 7], seed=9)
    ca, cb = r.new_cache(2, 32), r.new_cache(2, 32)
    la = r.prefill(ids, ca, attention_mask=mask).clone()
    lb = r.prefill(ids, cb, attention_mask=mask).clone()
    dyn = plan_for(r, ca)
    static = DecodePlan(r, cb, static=True)  # what opt 3 captures on CUDA
    threads = torch.get_num_threads()
    assert not dyn.static and static.static and static.graph is None
    pa = pb = (mask.sum(1)).long()
    for step in range(6):
        tok = la.argmax(-1)
        la = dyn.step(tok, pa).clone()
        lb = static.step(tok, pb).clone()
        assert_close(lb, la, "fp32", f"static step {step}")
        pa = pb = pa + 1
    # the dynamic CPU plan runs RoPE + cache write and attention as two C kernels
    # where the static one needs RoPE, an index_copy_ and SDPA
    assert 0 < dyn.launches <= static.launches
    assert dyn.c_attn and not static.c_attn
    # torch's pool is parked at one thread only inside the C-matmul step
    assert dyn.parked and torch.get_num_threads() == threads


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mixtral"])
def test_prefill_workspace_reused_and_equal(arch):
    """A long prefill's big intermediates go to the runner's workspace: the same
    buffers serve every layer and the next prefill, the logits and the KV cache
    equal a runner that allocates every tensor, and releasing frees them."""
    m = tiny(arch)
    r, ref = ModelRunner.from_hf(m, opt_level=2), ModelRunner.from_hf(m, opt_level=2)
    ref.workspace = None
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    ca, cb = r.new_cache(2, 64), ref.new_cache(2, 64)
    la, lb = r.prefill(ids, ca).clone(), ref.prefill(ids, cb)
    assert_close(la, lb, "fp32", f"{arch} prefill")
    bufs = {k: v.data_ptr() for k, v in r.workspace.bufs.items()}
    want = {"qkv", "o", "h", "res_a", "res_b"} | ({"gate_up", "act", "down"} if arch in ("llama", "qwen2")
                                                  else set())
    assert want <= set(bufs), sorted(bufs)
    again = r.prefill(ids, r.new_cache(2, 64))
    assert torch.equal(again, la)
    assert {k: v.data_ptr() for k, v in r.workspace.bufs.items()} == bufs   # reused, not regrown
    for step in range(3):  # the caches the prefills wrote agree: decoding continues alike
        tok = lb.argmax(-1)
        la, lb = r.decode(tok, ca).clone(), ref.decode(tok, cb)
        assert_close(la, lb, "fp32", f"{arch} decode {step}")
    r.release_decode_kv()
    assert r.workspace.nbytes == 0


@pytest.mark.parametrize("panels", ["1", "0"])
def test_decode_weights_on_hugepages_shared_with_the_model(panels, monkeypatch):
    """The weights the C matmul streams sit on huge pages: the fp32 panels, or with
    ATB_PANELS=0 the [out, in] rows, where a single model parameter moves itself (one
    copy in memory); the model's own forward is unchanged either way."""
    from atbcore.memory import hugepages

    monkeypatch.setenv("ATB_PANELS", panels)
    m = tiny("llama", vocab_size=16384)  # a 4 MiB LM head
    ids = torch.randint(3, 16384, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = m(ids).logits
    r = ModelRunner.from_hf(m, opt_level=2)
    head = r.lm_head.w
    assert head.data_ptr() == m.lm_head.weight.data_ptr()
    streamed = head if r.lm_head.panels is None else r.lm_head.panels
    assert (r.lm_head.panels is None) == (panels == "0" or not r.lm_head.rows)
    if hugepages.available() is None and r.lm_head.rows:
        if panels == "0":  # moved alone: aligned (panels share the runner's arena)
            assert streamed.data_ptr() % hugepages.HUGE == 0
        assert hugepages.on_hugepages(streamed) >= hugepages.HUGE
    with torch.no_grad():
        assert torch.equal(m(ids).logits, before)
    c = r.new_cache(1, 16)
    assert_close(r.prefill(ids, c), before[:, -1], "fp32", "runner after the move")
    r2 = ModelRunner.from_hf(m, opt_level=2)  # a second compile finds it there: no copy
    assert r2.lm_head.w.data_ptr() == head.data_ptr() == m.lm_head.weight.data_ptr()
    # tied embeddings: the embedding table follows the head (no stale second copy)
    t = tiny("llama", vocab_size=16384, tie_word_embeddings=True)
    rt = ModelRunner.from_hf(t, opt_level=2)
    assert (rt.embed_w.data_ptr() == rt.lm_head.w.data_ptr()
            == t.model.embed_tokens.weight.data_ptr() == t.lm_head.weight.data_ptr())


def test_decode_weights_in_panels_unless_disabled(llama, monkeypatch):
    """Decode Linears carry a panel-packed copy the C matmul streams (shown by
    explain()'s kernel names); with ATB_PANELS=0 they run on the [out, in] rows, and
    both prefill and decode HF's logits. bf16 and int8 weights are packed too."""
    from atbcore.backends.cpu_kernels import available

    packed = ModelRunner.from_hf(llama, opt_level=2)
    monkeypatch.setenv("ATB_PANELS", "0")
    plain = ModelRunner.from_hf(llama, opt_level=2)
    monkeypatch.delenv("ATB_PANELS")
    lins = [packed.lm_head] + [getattr(b, n) for b in packed.blocks for n in ("qkv", "o", "down")]
    if available():
        assert all(lin.panels is not None and "panels" in lin.kernel for lin in lins)
        assert packed.lm_head.panels.shape == (256 // 32, 64, 32)
    assert plain.lm_head.panels is None and "panels" not in plain.lm_head.kernel
    half = ModelRunner.from_hf(tiny("llama").to(torch.bfloat16), opt_level=2)
    w8 = ModelRunner.from_hf(llama, opt_level=2, quantize="w8")
    if available():  # panels keep the weights' dtype; w8 ones replace the int8 rows
        assert half.lm_head.panels.dtype == torch.bfloat16
        assert w8.blocks[0].qkv.panels.dtype == torch.int8 and w8.blocks[0].qkv.w.is_meta
    long, long_mask = left_padded([40, 33], seed=5)  # 80 rows: the prefill GEMMs on panels
    with torch.no_grad():
        ref = llama(long, attention_mask=long_mask).logits
    for r in (packed, plain):
        got = r.forward(long, r.new_cache(2, 48), attention_mask=long_mask)
        assert_close(got[long_mask.bool()], ref[long_mask.bool()], "fp32", "prefill vs HF")
    ids, mask = left_padded([4, 9], seed=8)
    ca, cb = packed.new_cache(2, 32), plain.new_cache(2, 32)
    la = packed.prefill(ids, ca, attention_mask=mask)
    lb = plain.prefill(ids, cb, attention_mask=mask)
    seq = ids
    for step in range(5):
        tok = lb.argmax(-1)
        seq, mask = torch.cat([seq, tok[:, None]], 1), torch.cat([mask, mask[:, -1:]], 1)
        la, lb = packed.decode(tok, ca).clone(), plain.decode(tok, cb).clone()
        with torch.no_grad():
            ref = llama(seq, attention_mask=mask).logits[:, -1]
        assert_close(la, ref, "fp32", f"panels step {step} vs HF")
        assert_close(lb, ref, "fp32", f"rows step {step} vs HF")


def test_paged_prefill_attends_in_one_c_call_per_layer(llama):
    """Fresh prompts packed in one paged prefill: one C prefill attention per layer for
    all of them, and each prompt's last logits equal HF's."""
    from atbcore.backends.cpu_kernels import available
    from atbcore.backends.cpu_kernels.counting import LaunchCounter

    r = ModelRunner.from_hf(llama, opt_level=2)
    s = r.spec
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 70, 1)]
    paged = PagedKVCache(s.num_layers, num_blocks=64, block_size=4, num_kv_heads=s.num_kv_heads,
                         head_dim=s.head_dim, dtype="fp32")
    batch = paged.prepare_prefill(["a", "b", "c"], [p.tolist() for p in prompts])
    with LaunchCounter() as c:
        logits = r.forward_paged(torch.cat(prompts), batch, paged)
    assert c.ops.count("prefill_attention") == (s.num_layers if available() else 0)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            assert_close(logits[i], llama(p[None]).logits[0, -1], "fp32", f"prompt {i} vs HF")


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


def test_paged_forward_matches_contiguous(llama):
    r = ModelRunner.from_hf(llama, opt_level=2)
    s = r.spec
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 11)]
    paged = PagedKVCache(s.num_layers, num_blocks=32, block_size=4, num_kv_heads=s.num_kv_heads,
                         head_dim=s.head_dim, dtype="fp32", enable_prefix_caching=True)
    batch = paged.prepare_prefill(["a", "b"], [p.tolist() for p in prompts])
    logits = r.forward_paged(torch.cat(prompts), batch, paged)
    paged.mark_computed(["a", "b"])
    refs = []
    for p in prompts:
        c = r.new_cache(1, 64)
        refs.append((c, r.prefill(p[None], c)))
    assert_close(logits, torch.cat([x[1] for x in refs]), "fp32", "paged prefill")
    toks = [p.tolist() for p in prompts]
    for step in range(5):
        nxt = logits.argmax(-1)
        batch = paged.prepare_decode(["a", "b"], [[int(t)] for t in nxt])
        logits = r.forward_paged(nxt, batch, paged)
        for i, (c, _) in enumerate(refs):
            ref = r.decode(nxt[i:i + 1], c)
            assert_close(logits[i:i + 1], ref, "fp32", f"paged decode {step} seq {i}")
        for i, t in enumerate(nxt.tolist()):
            toks[i].append(t)
    # prefix caching: a prompt sharing b's first 8 tokens reuses two full blocks
    p3 = torch.tensor(toks[1][:8] + [7, 8, 9])
    batch = paged.prepare_prefill(["c"], [p3.tolist()])
    assert batch.num_cached == [8]
    out = r.forward_paged(p3[8:], batch, paged)
    c = r.new_cache(1, 32)
    assert_close(out, r.prefill(p3[None], c), "fp32", "prefix-cached prefill")
    # all_logits: one row per new token (speculative verification)
    paged.mark_computed(["c"])
    batch = paged.prepare_decode(["c"], [[5, 6]], num_tokens=2)
    assert r.forward_paged(torch.tensor([5, 6]), batch, paged, all_logits=True).shape == (2, 256)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "mixtral", "gpt2"])
def test_paged_matches_contiguous_per_arch(arch):
    r = ModelRunner.from_hf(tiny(arch), opt_level=2)
    s = r.spec
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 11)]
    paged = PagedKVCache(s.num_layers, num_blocks=32, block_size=4, num_kv_heads=s.num_kv_heads,
                         head_dim=s.head_dim, dtype="fp32")
    batch = paged.prepare_prefill(["a", "b"], [p.tolist() for p in prompts])
    logits = r.forward_paged(torch.cat(prompts), batch, paged)
    paged.mark_computed(["a", "b"])
    caches = [r.new_cache(1, 32) for _ in prompts]
    ref = torch.cat([r.prefill(p[None], c) for p, c in zip(prompts, caches)])
    for step in range(7):  # past Mistral's window of 6
        assert_close(logits, ref, "fp32", f"{arch} paged step {step}")
        nxt = ref.argmax(-1)
        batch = paged.prepare_decode(["a", "b"], [[int(t)] for t in nxt])
        logits = r.forward_paged(nxt, batch, paged)
        ref = torch.cat([r.decode(nxt[i:i + 1], c).clone() for i, c in enumerate(caches)])
    # the paged decode steps ran as the prebuilt paged plan (C kernels on the CPU)
    assert r.__dict__.get("_paged_plan") is not None and r._paged_plan.b == 2


def test_hf_cache_in_and_growth(llama):
    from transformers import DynamicCache

    c = compile(llama)
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
    kv = next(iter(c.atb_runner.new_cache(1, 4).__dict__.get("plans", {}).values()), None)
    assert kv is None


def test_contiguous_cache_editing():
    kv = ContiguousKVCache(2, 3, 4, 2, 8)
    k = torch.arange(3 * 2 * 16, dtype=torch.float32).reshape(3, 2, 16)
    kv.write(1, k, -k, 0)
    kv.length = 2
    kv.select(torch.tensor([2, 0]))
    assert kv.batch == 2 and torch.equal(kv.view(1, 2)[0], k[[2, 0]])
    assert torch.equal(kv.view(1, 2)[1], -k[[2, 0]])
    kv.crop(1)
    assert kv.length == 1
    with pytest.raises(Exception, match="write past the cache"):
        kv.write(0, torch.zeros(2, 5, 16), torch.zeros(2, 5, 16), 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: opt 3 captures the "
                    "decode step as a CUDA graph (on the CPU it runs as opt 2, tested above)")
def test_opt3_cuda_graph_decode():
    m = tiny("llama").cuda()
    c = compile(m, opt_level=3)
    ids, mask = left_padded([5, 9], seed=14)
    ids, mask = ids.cuda(), mask.cuda()
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(c.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False), ref)
    r = c.atb_runner
    kv = r.new_cache(2, 64)
    lg = r.prefill(ids, kv, attention_mask=mask)
    lg = r.decode(lg.argmax(-1), kv).clone()
    plan = next(p for p in kv.plans.values() if p is not None)
    assert plan.static and plan.graph is not None  # each step is one graph replay
    r1 = ModelRunner.from_hf(m, opt_level=1)  # the same step through the general path
    kv1 = r1.new_cache(2, 64)
    l1 = r1.prefill(ids, kv1, attention_mask=mask)
    l1 = r1.decode(l1.argmax(-1), kv1)
    assert_close(lg, l1, "fp32", "CUDA graph decode step")
