"""torch.ops.atb.*: opcheck for every registered op, values vs the core reference,
torch.compile(fullgraph=True) without graph breaks, and autograd refused clearly."""

import numpy as np
import pytest
import torch
from torch.library import opcheck

import atbcore as atb
import atb_torch.library as L
from atbcore.ops.linear import quantize_w8

A = torch.ops.atb


def _graph_op_case(r):
    """A registered GraphOp (LayerNorm -> Linear -> SiLU -> Linear -> ResidualAdd)."""
    import atb_torch

    g = atb_torch.GraphOp([atb_torch.LayerNorm(16), atb_torch.Linear(16, 32), atb_torch.SiLU(),
                           atb_torch.Linear(32, 16), atb_torch.ResidualAdd()], name="mlp_case")
    _KEEP.append(g)  # the op holds GraphOps weakly
    return (g._handle, [r(2, 3, 16)], [p.detach() for p in g.weight_tensors()])


_KEEP: list = []


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, w, b = r(2, 5, 64), r(48, 64), r(48)
    wq, s = quantize_w8(w)
    q, k, v = r(2, 5, 64), r(2, 5, 32), r(2, 5, 32)
    kk = r(5, 2, 16)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cl = torch.tensor([5, 3], dtype=torch.int32)
    return {
        "rms_norm": (x, r(64), 1e-6),
        "add_rms_norm": (x, r(2, 5, 64), r(64), 1e-6),
        "layer_norm": (x, r(64), r(64), 1e-5),
        "add_layer_norm": (x, r(2, 5, 64), r(64), r(64), 1e-5),
        "linear": (x, w, b),
        "linear_w8": (x, wq, s, None),
        "matmul": (x, w, False, True),
        "rope": (q, k, torch.arange(5), None, None, 4, 2),
        "flash_attention": (q, k, v, None, None, 4, 2, 0.0, True),
        "reshape_and_cache": (kk, kk, torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16),
                              torch.arange(5)),
        "paged_attention": (r(2, 4, 16), r(4, 4, 2, 16), r(4, 4, 2, 16), bt, cl, None, 4, 2),
        "gelu": (x, "tanh"),
        "quick_gelu": (x,),
        "silu": (x,),
        "relu": (x,),
        "swiglu": (x, None),
        "geglu": (x, r(2, 5, 64), "none"),
        "activation": (x, None, "swiglu"),
        "softmax": (x, [-1, -2]),
        "scaled_masked_softmax": (r(2, 4, 5, 5), None, 0.5, True, -1),
        "fused_ffn": (x, r(32, 64), r(32, 64), r(64, 32), None, None, None, None, None, x,
                      "swiglu"),
        "moe": (r(6, 16), r(4, 16), r(4, 16, 16), r(4, 16, 8), 2, True, "swiglu", 0),
        "residual_add": (x, r(2, 5, 64)),
        "elewise": (x, None, "cast", 1.0, "bf16"),
        "transpose": (x, [0, 2, 1]),
        "split": (x, [16, 48], -1),
        "concat": ([x, r(2, 3, 64)], 1),
        "slice": (x, [0, 1, 8], [-1, 3, 16]),
        "gather": (x, torch.tensor([[1, 0], [1, 1]]), 0),
        "embedding": (w, torch.tensor([[1, 47], [3, 0]])),
        "argmax": (x, 1, True),
        "topk_topp_sampling": (r(3, 50), 10, 0.9, 0.7, 5),
        "all_reduce": (x, "sum", 0),
        "graph_op": _graph_op_case(r),
    }


CASES = _cases()


def test_every_registered_op_has_a_case():
    assert set(L.OPS) <= set(CASES), set(L.OPS) - set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    args = CASES[name]
    opcheck(getattr(A, name).default, args)


@pytest.mark.parametrize("name", ["swiglu", "softmax", "fused_ffn", "moe", "elewise", "slice",
                                  "gather", "embedding", "topk_topp_sampling"])
def test_new_ops_match_core_reference(name):
    """Each op's torch.ops.atb result equals the core NumPy reference on the same data."""
    args = CASES[name]
    out = getattr(A, name)(*args)
    out = out[0] if isinstance(out, (list, tuple)) else out
    core_name = L.OPS[name]
    t = [a for a in args if isinstance(a, torch.Tensor)]
    params = {"softmax": {"dim": (-1, -2)}, "elewise": {"elewise_type": "cast", "out_dtype": "bf16"},
              "slice": {"offsets": (0, 1, 8), "sizes": (-1, 3, 16)},
              "fused_ffn": {"has_residual": True}, "moe": {"top_k": 2},
              "topk_topp_sampling": {"top_k": 10, "top_p": 0.9, "temperature": 0.7, "seed": 5}
              }.get(name, {})
    ref = atb.Builder(backend="numpy").build_operation(core_name, params).execute(
        [a.numpy() if a.dtype != torch.bfloat16 else a for a in t])[0]
    if out.dtype in (torch.int64, torch.int32):
        assert np.array_equal(out.numpy(), ref)
    else:
        atb.assert_close(out, ref, str(out.dtype).split(".")[-1].replace("float32", "fp32")
                         .replace("bfloat16", "bf16"), name)


def test_values_match_core_reference():
    x, w = torch.randn(3, 64), torch.randn(64)
    ref, = atb.Builder(backend="numpy").build_operation("RmsNorm", {"eps": 1e-6}).execute(
        [x.numpy(), w.numpy()])
    atb.assert_close(A.rms_norm(x, w, 1e-6), ref, "fp32")
    q, k, v = torch.randn(1, 6, 32), torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    ref, = atb.Builder(backend="numpy").build_operation(
        "FlashAttention", {"num_heads": 4, "num_kv_heads": 2, "causal": True}).execute(
        [q.numpy(), k.numpy(), v.numpy()])
    atb.assert_close(A.flash_attention(q, k, v, None, None, 4, 2, 0.0, True), ref, "fp32")


def test_reshape_and_cache_mutates_in_place():
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key, val = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    A.reshape_and_cache(key, val, kc, vc, torch.tensor([5, 0, 7]))
    assert torch.equal(kc.view(8, 1, 8)[5], key[0]) and torch.equal(vc.view(8, 1, 8)[7], val[2])


def test_compile_fullgraph_no_graph_breaks():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(32), requires_grad=False)
            self.qkv = torch.nn.Parameter(torch.randn(64, 32) * 0.1, requires_grad=False)

        def forward(self, h, res):
            y, s = A.add_rms_norm(h, res, self.w, 1e-6)
            qkv = A.linear(y, self.qkv, None)
            q, k, v = qkv.split([32, 16, 16], dim=-1)
            q, k = A.rope(q, k, None, None, None, 4, 2)
            o = A.flash_attention(q, k, v, None, None, 4, 2, 0.0, True)
            return A.rms_norm(o + s, self.w, 1e-6)

    m = Block()
    h, res = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    explained = torch._dynamo.explain(m)(h, res)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)
    atb.assert_close(compiled(h, res), m(h, res), "fp32", "compiled vs eager")


def test_autograd_is_refused_with_atb_error():
    x = torch.randn(2, 8, requires_grad=True)
    y = A.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(atb.AtbError, match="inference-only"):
        y.sum().backward()


def test_refuse_backward_raises_and_is_what_every_op_differentiates_to():
    with pytest.raises(atb.AtbError, match="RmsNorm: backward is not implemented"):
        A.refuse_backward("RmsNorm", torch.ones(2))
    x = torch.randn(3, 8, requires_grad=True)
    y, s = A.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(atb.AtbError, match="AddRmsNorm"):
        torch.autograd.grad(s.sum(), x)
    assert x.grad is None


def test_bad_input_raises_atb_error_through_torch_ops():
    with pytest.raises(atb.ShapeError, match="RmsNorm"):
        A.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
