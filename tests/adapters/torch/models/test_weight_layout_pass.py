"""The weight-layout pass (atbcore.passes.layout): a compiled decoder holds each weight
its kernels read as panels once, packed in the graph (no unpacked merged QKV, gate|up
or w8 codes beside the panels); explain() lists each weight's layout and bytes; the
bound plan equals the unbound, node-by-node run bit for bit, and the model still
matches Hugging Face (the oracle). Unpacking gives back the source (NumPy oracle)."""

import gc
import sys
import weakref

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.graph.packed import (PANELS, W4, W8A8, Layout, PackedWeight, pack, pack_joint,
                                  unpack)
from atbcore.ops.linear_quant import quantize_w4
from atbcore.numerics import assert_close
from atb_torch.models.core_runner import CoreRunner
from tiny_models import tiny

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels are not built here")


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
@pytest.mark.parametrize("transposed", [False, True])
def test_pack_unpack_round_trip_odd_sizes(dtype, transposed):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((45, 19)) * 50).astype(dtype)  # 45 rows: a partial panel
    p = pack(w, Layout(PANELS, transposed))
    n, k = (19, 45) if transposed else (45, 19)
    assert p.nbytes == -(-n // 32) * k * 32 * w.itemsize and p.shape == (45, 19)
    np.testing.assert_array_equal(unpack(p), w)
    raw = p.numpy_data().view(dtype)
    src = w.T if transposed else w
    last = n - 1
    assert raw[last // 32, 3, last % 32] == src[last, 3]  # p[i, k, j] = w[32 i + j, k]
    assert (raw[-1, :, n % 32:] == 0).all()  # zeros past N


@pytest.mark.parametrize("n,k", [(45, 19), (32, 64), (77, 130)])
def test_w8a8_layout_round_trip_odd_sizes(n, k):
    """int8 [n, k] in w8a8's VNNI panels ([P, K/4 + 1, 32, 4], the kernel's packer) and
    back; the last row holds each output's int32 column sum."""
    w = np.random.default_rng(n).integers(-127, 128, (n, k)).astype(np.int8)
    p = pack(w, Layout(W8A8))
    p4, k4 = -(-n // 32), -(-k // 4)
    assert p.nbytes == p4 * (k4 + 1) * 32 * 4 and p.shape == (n, k)
    np.testing.assert_array_equal(unpack(p), w)
    raw = p.numpy_data().view(np.int8)
    assert raw[(n - 1) // 32, (k - 1) // 4, (n - 1) % 32, (k - 1) % 4] == w[n - 1, k - 1]
    sums = raw[:, k4].copy().view(np.int32).reshape(-1)[:n]
    np.testing.assert_array_equal(sums, w.astype(np.int64).sum(1))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,group", [(45, 70, 32), (33, 19, 64), (64, 128, 32)])
def test_w4_layout_round_trip_odd_sizes(n, k, group, symmetric):
    """w4 codes, group scales (and zero points) packed together (one layout of several
    parts, by the kernel's packer), each part back to its stored array; the bytes are
    the layout's: codes K'/2 per output, scales and zero points per group, 32 outputs
    a panel."""
    wf = np.random.default_rng(k).standard_normal((n, k)).astype(np.float32)
    codes, scales, zeros = quantize_w4(wf, group, symmetric=symmetric)
    arrs = {"weight": codes, "scale": scales, **({} if zeros is None else {"zeros": zeros})}
    got = pack_joint(arrs, {p: Layout(W4, part=p, group=group) for p in arrs})
    rows, groups = -(-n // 32) * 32, -(-k // group)
    want = {"weight": rows * groups * group // 2, "scale": rows * groups * 2, "zeros": rows * groups}
    assert set(got) == set(arrs)
    for part, w in got.items():
        assert w.nbytes == want[part] and w.shape == arrs[part].shape, part
        np.testing.assert_array_equal(unpack(w), arrs[part])


def _held(r):
    """Bytes of packed weights and of unpacked arrays the runner's GraphOp holds itself
    (not views of the HF model's tensors), found through everything it references."""
    hf = [(p.untyped_storage().data_ptr(), p.untyped_storage().data_ptr()
           + p.untyped_storage().nbytes()) for p in r.hf_params]
    # module namespaces (a function's globals) lead to other tests' models: not held
    seen = {id(vars(m)) for m in list(sys.modules.values()) if hasattr(m, "__dict__")}
    packed, own, todo = {}, {}, [r.op]
    while todo:
        o = todo.pop()
        if type(o) in weakref.ProxyTypes or id(o) in seen or isinstance(o, (type, str, bytes, int, float)):
            continue
        seen.add(id(o))
        if type(o) is PackedWeight:
            packed[o.numpy_data().__array_interface__["data"][0]] = o.nbytes  # by memory
            continue
        if isinstance(o, np.ndarray):
            base = o
            while isinstance(base.base, np.ndarray):
                base = base.base
            addr = o.__array_interface__["data"][0]
            if not any(lo <= addr < hi for lo, hi in hf) and o.nbytes >= 16384:
                own[addr] = max(own.get(addr, 0), o.nbytes)
            continue
        if isinstance(o, torch.Tensor):
            continue
        todo += [x for x in gc.get_referents(o) if not callable(x) or hasattr(x, "__dict__")]
    return sum(packed.values()), sum(own.values())


def _panels_bytes(model, itemsize, o_proj, head_itemsize):
    """Panel bytes of the projections (QKV, gate|up, down; ``o_proj`` too) and the LM
    head: ceil(N / 32) panels of K x 32 elements each."""
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
    per = lambda n, k, size=itemsize: -(-n // 32) * 32 * k * size  # noqa: E731
    layer = per(qkv, c.hidden_size) + per(2 * c.intermediate_size, c.hidden_size) + \
        per(c.hidden_size, c.intermediate_size)
    if o_proj:
        layer += per(c.hidden_size, c.num_attention_heads * hd)
    return c.num_hidden_layers * layer + per(c.vocab_size, c.hidden_size, head_itemsize)


def _close(got, ref, quantize, what):
    if quantize is None:
        assert_close(got, ref, "fp32", what)
    else:  # int8 weights: the logits' direction (as test_core_weights checks w8)
        cos = torch.nn.functional.cosine_similarity(got, ref).min()
        assert cos > 0.999, (what, float(cos))


@pytest.mark.parametrize("quantize", [None, "w8"])
def test_decoder_holds_panels_only_and_matches_hf(llama, quantize):
    r = CoreRunner.from_hf(llama, quantize=quantize)
    r.hf_params = list(llama.parameters())
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(4))
    cache = r.new_cache(2, 16)
    logits = r.prefill(ids, cache)
    with torch.no_grad():
        ref = llama(ids).logits[:, -1]
    _close(logits, ref, quantize, "prefill vs HF")
    tok = logits.argmax(-1)
    step = r.decode(tok, cache).clone()
    with torch.no_grad():
        ref = llama(torch.cat([ids, tok[:, None]], 1)).logits[:, -1]
    _close(step, ref, quantize, "decode vs HF")
    packed, own = _held(r)
    # fp32: every projection (o too: the C matmul runs it at every row count) and the
    # LM head in panels; w8: every projection's int8 codes
    want = _panels_bytes(llama, 4, True, 4) if quantize is None else \
        _panels_bytes(llama, 1, True, 1)
    assert packed == want, (packed, want)
    assert own == 0, f"{own} B of unpacked weights held beside the panels"
    text = r.explain()
    assert "Weights: " in text and "32-output panels" in text
    total = int(text.split("Weights: ")[1].split(", ")[1].split(" B")[0])
    assert total >= packed


def _quant_bytes(model, quantize):
    """Packed bytes of every projection and the LM head: w8a8 VNNI panels (with the
    column sums' row), w4 codes and fp16 group scales (symmetric: no zero points)."""
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    h, i = c.hidden_size, c.intermediate_size
    shapes = [((c.num_attention_heads + 2 * c.num_key_value_heads) * hd, h),
              (h, c.num_attention_heads * hd), (2 * i, h), (h, i)] * c.num_hidden_layers
    total = 0
    for n, k in shapes + [(c.vocab_size, h)]:
        rows = -(-n // 32) * 32
        total += rows * (-(-k // 4) + 1) * 4 if quantize == "w8a8" else \
            rows * (-(-k // 32)) * (16 + 2)
    return total


@pytest.mark.parametrize("quantize", ["w8a8", "w4"])
def test_quantized_decoder_holds_packed_parts_only(llama, quantize, monkeypatch):
    """w8a8 and w4 decoders: every projection's codes (w4: with its group scales) held
    once, packed by the pass, 0 B of unpacked codes reachable; the logits are the
    same bits as with the pass off (binders packing beside the stored codes) and
    match HF within the quantized bounds."""
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(4))
    outs = []
    for on in ("0", "1"):
        monkeypatch.setenv("ATB_LAYOUT_PASS", on)
        r = CoreRunner.from_hf(llama, quantize=quantize)
        cache = r.new_cache(2, 16)
        logits = r.prefill(ids, cache).clone()
        outs.append((r, logits, r.decode(logits.argmax(-1), cache).clone()))
    (_, p0, d0), (r, p1, d1) = outs
    assert torch.equal(p0, p1) and torch.equal(d0, d1)
    with torch.no_grad():
        ref = llama(ids).logits[:, -1]
    cos = torch.nn.functional.cosine_similarity(p1, ref).min()
    assert cos > {"w8a8": 0.995, "w4": 0.975}[quantize], float(cos)
    r.hf_params = list(llama.parameters())
    packed, own = _held(r)
    assert packed == _quant_bytes(llama, quantize), (packed, _quant_bytes(llama, quantize))
    assert own == 0, f"{own} B of unpacked weights held beside the packed ones"
    assert ("w8a8 VNNI panels" if quantize == "w8a8" else "w4 32-output panels, group 32: "
            "group scales") in r.explain()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_plan_equals_unbound_run_with_packed_weights(dtype):
    """RmsNorm + Linear (fused to RmsNormLinear, 45 outputs: a partial panel): its weight
    packed in the graph; the profiled run goes node by node through the kernel's fn,
    the bound program must give the same bits, 1 and 2 threads; both match float64
    NumPy. The unpacked weight in the graph is gone (only the layer's source lives)."""
    from atbcore.graph import layers as L
    from atbcore.graph.graph_op import GraphOp
    from atbcore.runtime.profiler import Profiler

    rng = np.random.default_rng(5)
    w = rng.standard_normal((45, 24)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(24)).astype(np.float32)
    op = GraphOp([L.RmsNorm("n").load_weights({"weight": nw}),
                  L.Linear("lin", out_features=45, bias=False).load_weights({"weight": w})])
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    outs, keep = [], torch.get_num_threads()
    for threads in (1, 2):  # the C pool follows torch's thread count
        torch.set_num_threads(threads)
        outs.append(op(x).clone())
    torch.set_num_threads(keep)
    assert torch.equal(outs[0], outs[1])
    packed = [v for v in op.graph.weight_map.values() if type(v) is PackedWeight]
    assert len(packed) == 1 and packed[0].nbytes == 2 * 32 * 24 * x.element_size()
    plan = op.last_plan
    y = plan.run(dict(zip(op.graph.inputs, [x])), profiler=Profiler("t"))[0]
    assert torch.equal(outs[0], y)
    xd = x.double().numpy()
    n = xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + 1e-6)
    if dtype == torch.bfloat16:  # the norm rounds to x's dtype, the weight is bf16 too
        nb = torch.from_numpy(nw).to(dtype).double().numpy()
        n = torch.from_numpy(n * nb).to(dtype).double().numpy()
        ref = n @ torch.from_numpy(w).to(dtype).double().numpy().T
        assert_close(y, torch.from_numpy(ref), "bf16", "vs float64 NumPy")
    else:
        assert_close(y, torch.from_numpy(n * nw @ w.astype(np.float64).T), "fp32",
                     "vs float64 NumPy")


def test_saved_graph_holds_the_logical_weights(tmp_path):
    """Saving a graph whose weight the layout pass packed writes the logical [N, K]
    weight (unpacked); the loaded graph runs to the same bits (packed again)."""
    from atbcore.graph import layers as L
    from atbcore.graph.graph_op import GraphOp
    from atbcore.graph.serialize import load_graph, save_graph

    rng = np.random.default_rng(6)
    w = rng.standard_normal((70, 16)).astype(np.float32)
    nw = rng.standard_normal(16).astype(np.float32)
    op = GraphOp([L.RmsNorm("n").load_weights({"weight": nw}),
                  L.Linear("lin", out_features=70, bias=False).load_weights({"weight": w})])
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(2))
    y = op(x)
    tid = next(t for t, v in op.graph.weights if type(v) is PackedWeight)
    save_graph(op.graph, tmp_path)
    g = load_graph(tmp_path)
    np.testing.assert_array_equal(g.weight_map[tid], w)
    again = GraphOp(g)
    assert torch.equal(again(x), y)
    assert type(again.graph.weight_map[tid]) is PackedWeight


@pytest.mark.parametrize("quantize", ["w8a8", "w4"])
def test_quantized_graph_bound_unbound_and_saved(tmp_path, quantize):
    """RmsNorm + a w4 / w8a8 Linear (45 outputs, 70 inputs: a partial panel and group;
    asymmetric w4 codes, with zero points): packed by the pass; the bound program, the
    node-by-node run (the kernel's fn on the packed parts), 1 and 2 threads give the same
    bits; a saved graph holds the stored codes and runs to the same bits packed again."""
    from atbcore.graph import layers as L
    from atbcore.graph.graph_op import GraphOp
    from atbcore.graph.serialize import load_graph, save_graph
    from atbcore.models.quant import QuantLinear
    from atbcore.runtime.profiler import Profiler

    rng = np.random.default_rng(7)
    wf = rng.standard_normal((45, 70)).astype(np.float32)
    if quantize == "w4":
        c, s, z = quantize_w4(wf, 32, symmetric=False)
        ws, params = {"weight": c, "scale": s, "zeros": z}, {"quant": "w4", "group_size": 32}
    else:
        s = (np.abs(wf).max(1) / 127).astype(np.float32)
        ws = {"weight": np.rint(wf / s[:, None]).astype(np.int8), "scale": s}
        params = {"quant": "w8a8"}
    nw = (1 + 0.1 * rng.standard_normal(70)).astype(np.float32)
    op = GraphOp([L.RmsNorm("n").load_weights({"weight": nw}), QuantLinear("lin", params, ws)])
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(1))
    outs, keep = [], torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(op(x).clone())
    torch.set_num_threads(keep)
    assert torch.equal(outs[0], outs[1])
    packed = {t: v for t, v in op.graph.weights if type(v) is PackedWeight}
    assert {t.split(".")[-1] for t in packed} == ({"weight", "scale", "zeros"}
                                                  if quantize == "w4" else {"weight"})
    y = op.last_plan.run(dict(zip(op.graph.inputs, [x])), profiler=Profiler("t"))[0]
    assert torch.equal(outs[0], y)
    save_graph(op.graph, tmp_path)
    g = load_graph(tmp_path)
    for t in packed:
        np.testing.assert_array_equal(g.weight_map[t], ws[t.split(".")[-1]])
    again = GraphOp(g)
    assert torch.equal(again(x), y)
    assert all(type(again.graph.weight_map[t]) is PackedWeight for t in packed)
