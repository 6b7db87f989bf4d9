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
from atbcore.graph.packed import PANELS, Layout, PackedWeight, pack, unpack
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
    # fp32: QKV, gate|up, down and the LM head in panels (o runs oneDNN at many rows,
    # so it stays as stored: a view of HF's tensor); w8: every projection's int8 codes
    want = _panels_bytes(llama, 4, False, 4) if quantize is None else \
        _panels_bytes(llama, 1, True, 1)
    assert packed == want, (packed, want)
    assert own == 0, f"{own} B of unpacked weights held beside the panels"
    text = r.explain()
    assert "Weights: " in text and "32-output panels" in text
    total = int(text.split("Weights: ")[1].split(", ")[1].split(" B")[0])
    assert total >= packed


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
