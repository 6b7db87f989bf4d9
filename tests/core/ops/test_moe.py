"""MoE: torch kernel vs the NumPy reference, Hugging Face MixtralSparseMoeBlock and
Qwen2MoeSparseMoeBlock (norm_topk_prob False) oracles, experts without tokens never
computed, bad input."""

import numpy as np
import pytest
import torch

import atbcore as atb
from oracle import FLOATS, check_error, check_op, rand


def moe_inputs(t, h, i, e, dtype, gated=True, seed=1, lead=()):
    return [rand((*lead, t, h), dtype, seed), rand((e, h), dtype, seed + 1, 0.5),
            rand((e, (2 if gated else 1) * i, h), dtype, seed + 2, h ** -0.5),
            rand((e, h, i), dtype, seed + 3, i ** -0.5)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("t,h,e,k", [(1, 769, 4, 2), (7, 769, 8, 2), (16, 64, 8, 1), (9, 64, 6, 6)])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_reference(t, h, e, k, norm, dtype):
    check_op("MoE", {"top_k": k, "norm_topk_prob": norm}, moe_inputs(t, h, 32, e, dtype))


@pytest.mark.parametrize("dtype", FLOATS)
def test_other_activations_and_3d_input(dtype):
    check_op("MoE", {"activation_type": "geglu", "num_experts": 4},
             moe_inputs(5, 64, 24, 4, dtype))
    check_op("MoE", {"activation_type": "gelu"}, moe_inputs(5, 64, 24, 4, dtype, gated=False))
    check_op("MoE", {"num_experts_per_tok": 3}, moe_inputs(6, 64, 24, 5, dtype, lead=(2,)))


def test_experts_without_tokens_are_not_computed():
    """Experts the router never picks hold NaN weights: a kernel that touched them
    would return NaN. The routing is forced by the router rows."""
    x, r, gu, dn = moe_inputs(12, 64, 16, 6, "fp32")
    x = np.abs(x)
    r[[1, 4]] = -1.0                                             # logits << the others
    r[[0, 2, 3, 5]] = np.abs(r[[0, 2, 3, 5]])
    gu[[1, 4]] = np.nan
    dn[[1, 4]] = np.nan
    y = check_op("MoE", {"top_k": 2}, [x, r, gu, dn])[0]
    assert np.isfinite(y).all()


def _fill(module, std=0.1, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)
    return module.eval()


def test_vs_hf_mixtral_sparse_moe_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=96, intermediate_size=40, num_local_experts=8,
                        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    cfg._experts_implementation = "eager"  # HF's plain loop; 5.0 leaves it unset outside a model
    blk = _fill(MixtralSparseMoeBlock(cfg))
    x = torch.randn(2, 9, 96, generator=torch.Generator().manual_seed(1))
    want = blk(x).detach()
    # HF stores the experts as fused 3-D parameters: gate_up [E, 2I, H], down [E, H, I]
    ws = [blk.gate.weight, blk.experts.gate_up_proj, blk.experts.down_proj]
    op = atb.Builder().build_operation("MoE", {"num_experts": 8, "top_k": 2, "norm_topk_prob": True})
    y, = op.execute([x.reshape(-1, 96), *(w.detach() for w in ws)])
    atb.assert_close(y.reshape(2, 9, 96), want, "fp32", "MoE vs MixtralSparseMoeBlock")
    y3, = op.execute([x, *(w.detach() for w in ws)])            # [B, S, H] accepted as well
    atb.assert_close(y3, want, "fp32", "MoE [B, S, H] vs MixtralSparseMoeBlock")


def test_vs_hf_qwen2_moe_block_without_renorm():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                         num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                         num_attention_heads=4, num_key_value_heads=2)
    cfg._experts_implementation = "eager"  # HF's plain loop; 5.0 leaves it unset outside a model
    blk = _fill(Qwen2MoeSparseMoeBlock(cfg), seed=2)
    with torch.no_grad():
        blk.shared_expert.down_proj.weight.zero_()              # our MoE has no shared expert
    x = torch.randn(1, 11, 64, generator=torch.Generator().manual_seed(3))
    want = blk(x).detach()
    ws = [w.detach() for w in (blk.gate.weight, blk.experts.gate_up_proj, blk.experts.down_proj)]
    y, = atb.Builder().build_operation("MoE", {"num_experts": 6, "top_k": 3,
                                               "norm_topk_prob": False}).execute([x[0], *ws])
    atb.assert_close(y, want[0], "fp32", "MoE vs Qwen2MoeSparseMoeBlock (no renorm)")
    renormed, = atb.Builder().build_operation("MoE", {"top_k": 3}).execute([x[0], *ws])
    assert not torch.allclose(renormed, y, rtol=1e-3)           # the flag matters


T, HH, II, E = 4, 16, 8, 4
GOOD = moe_inputs(T, HH, II, E, "fp32")
X, R, GU, DN = GOOD
BAD = [
    # (params, inputs, error, fragments)
    ({}, [rand((HH,)), R, GU, DN], atb.ShapeError, ["x", "rank 2 or 3"]),
    ({}, [X, rand((E, HH, 1)), GU, DN], atb.ShapeError, ["router_w", "rank 2"]),
    ({}, [X, rand((E, HH + 1)), GU, DN], atb.ShapeError, ["router_w", f"[{E}, {HH}]"]),
    ({}, [X, R, rand((E, 2 * II + 2, HH)), DN], atb.ShapeError, ["w_gate_up", f"[{E}, {2 * II}, {HH}]"]),
    ({}, [X, R, GU, rand((E + 1, HH, II))], atb.ShapeError, ["w_down", f"[{E + 1}, {HH}, {II}]"]),
    ({}, [X, R, rand((E, 2 * II, HH + 1)), DN], atb.ShapeError, ["w_gate_up"]),
    ({}, [X, R, GU[:, :, :, None], DN], atb.ShapeError, ["w_gate_up", "rank 3"]),
    ({"activation_type": "gelu"}, GOOD, atb.ShapeError, ["w_gate_up", "[E, I, H]"]),
    ({"num_experts": 8}, GOOD, atb.ShapeError, ["num_experts", "8"]),
    ({"top_k": 5}, GOOD, atb.ParamsError, ["top_k", f"<= {E}"]),
    ({}, [X, R.astype(np.float16), GU, DN], atb.DtypeError, ["router_w", "FP16"]),
    ({}, [X.astype(np.int64), R, GU, DN], atb.DtypeError, ["x", "INT64"]),
    ({"dtype": "bf16"}, GOOD, atb.DtypeError, ["BF16"]),
    ({}, GOOD[:3], atb.InputError, ["number of inputs"]),
    ({}, [*GOOD, X, X, X, X, X], atb.InputError, ["number of inputs"]),
    ({}, [*GOOD, X], atb.InputError, ["gate_up_scale", "quant"]),
    ({}, [X, R, None, DN], atb.InputError, ["w_gate_up", "missing"]),
]


@pytest.mark.parametrize("params,inputs,exc,frags", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(params, inputs, exc, frags):
    check_error("MoE", params, inputs, exc, *frags, outputs=[np.full((T, HH), 3.0, np.float32)])


def test_bad_params():
    for params, frag in [({"num_experts": 4, "top_k": 5}, "top_k"), ({"top_k": 0}, "top_k"),
                         ({"activation_type": "maxout"}, "maxout"), ({"num_experts": -1}, "num_experts"),
                         ({"capacity_factor": 1.25}, "capacity_factor")]:
        check_error("MoE", params, [], atb.ParamsError, frag, build_error=True)


def test_wrong_outputs_leave_them_untouched():
    check_error("MoE", {}, GOOD, atb.InputError, "number of outputs",
                outputs=[np.full((T, HH), 3.0, np.float32)] * 2)
    check_error("MoE", {}, GOOD, atb.DtypeError, "output", outputs=[np.full((T, HH), 3.0, np.float16)])
