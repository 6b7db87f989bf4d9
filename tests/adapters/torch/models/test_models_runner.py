"""The ModelRunner API the serving code builds on: prebuilt decode plans (dynamic and
the graph-capturable static variant) against the general path, the paged cache
against the contiguous one, cache growth and conversion, prefix caching,
prompt-lookup speculation, opt level 3 on the CPU."""


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


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decode_plan_binds_its_matmuls_once(arch, monkeypatch):
    """The CPU decode plan packs each C matmul's arguments at build time (its buffers
    are fixed): the bound steps give the same bits as the plan that calls the
    general method every step. GPT-2's LayerNorm is not fused into the matmul and
    its GELU writes a fresh tensor, so only its output projection is bound."""
    from atbcore.backends.cpu_kernels import available
    from atb_torch.models.kernels import Lin

    m = tiny(arch)
    ids, mask = left_padded([4, 9], seed=8)

    def steps(r):
        c = r.new_cache(2, 32)
        tok = r.prefill(ids, c, attention_mask=mask).argmax(-1)
        out = []
        for _ in range(6):
            out.append(r.decode(tok, c).clone())
            tok = out[-1].argmax(-1)
        return torch.stack(out), plan_for(r, c)

    bound, plan = steps(ModelRunner.from_hf(m, opt_level=2))
    n_bound = sum(hasattr(f, "keep") or hasattr(f, "bound") for f in plan.calls)
    layers = len(plan.runner.blocks)
    if available():  # llama: the LM head, and qkv, o, gate_up, down per layer; GPT-2: o
        assert n_bound == (1 + 4 * layers if arch == "llama" else layers)
    monkeypatch.setattr(Lin, "bound", lambda *a, **k: None)
    general, plan2 = steps(ModelRunner.from_hf(m, opt_level=2))
    assert not any(hasattr(f, "keep") or hasattr(f, "bound") for f in plan2.calls)
    assert torch.equal(bound, general)


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
