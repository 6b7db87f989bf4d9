"""RoPE: torch kernel vs the NumPy reference, HF oracles (LLaMA, GPT-NeoX partial,
GPT-J interleaved partial), the seed article's own formula, the table cache, bad input."""

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.backends.torch.rope import clear_rope_cache, rope_cache_stats, rope_tables
from oracle import FLOATS, check_error, check_op, rand


def _pos(shape, high, seed):
    return np.random.default_rng(seed).integers(0, high, size=shape).astype(np.int64)


# (name, params, q shape, k shape or None, position_ids shape or None)
CASES = [
    ("bsh-gqa", {"num_heads": 4, "num_kv_heads": 2, "head_dim": 72}, (2, 5, 288), (2, 5, 144), (2, 5)),
    ("bsh-seq1", {"head_num": 4, "size_per_head": 72}, (3, 1, 288), None, (3, 1)),
    ("bsh-seq2049", {"num_heads": 2, "head_dim": 8}, (1, 2049, 16), (1, 2049, 8), None),
    ("bsnd-pos1d", {}, (2, 7, 3, 72), (2, 7, 1, 72), (7,)),
    ("bnsd-partial", {"layout": "BNSD", "rotary_dim": 24}, (2, 4, 6, 72), (2, 2, 6, 72), (2, 6)),
    ("bsh-partial-offset", {"head_dim": 64, "rotary_dim": 32, "position_offset": 100},
     (2, 3, 128), None, None),
]


@pytest.mark.parametrize("rotary_type", ["half", "interleave"])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rope_matches_reference(case, dtype, rotary_type):
    _, params, qs, ks, ps = case
    ins = [rand(qs, dtype, 1)]
    if ks:
        ins.append(rand(ks, dtype, 2))
    if ps:
        ins.append(_pos(ps, 5000, 3))
    ref = check_op("RoPE", {**params, "rotary_type": rotary_type}, ins)
    assert len(ref) == (2 if ks else 1)
    # the op really rotates: outputs differ from inputs except at position 0
    assert not np.allclose(ref[0].astype(np.float64), ins[0].astype(np.float64))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("form", ["per-token-2d", "per-token-3d", "table+ids"])
def test_rope_with_given_cos_sin(form, dtype):
    b, s, h, d, rd = 2, 5, 3, 72, 72
    q, k = rand((b, s, h * d), dtype, 1), rand((b, s, h * d), dtype, 2)
    if form == "per-token-2d":
        cos, sin = rand((s, rd), dtype, 3), rand((s, rd), dtype, 4)
        ins = [q, k, cos, sin]
    elif form == "per-token-3d":
        cos, sin = rand((b, s, rd), dtype, 3), rand((b, s, rd), dtype, 4)
        ins = [q, k, cos, sin]
    else:
        cos, sin = rand((50, rd), dtype, 3), rand((50, rd), dtype, 4)
        ins = [q, k, _pos((b, s), 50, 5), cos, sin]
    ref = check_op("RoPE", {"head_dim": d}, ins)
    # explicit formula on the first head: x*cos + rotate_half(x)*sin
    x = q.astype(np.float64).reshape(b, s, h, d)[:, :, 0]
    c, sn = cos.astype(np.float64), sin.astype(np.float64)
    if form == "table+ids":
        c, sn = c[ins[2]], sn[ins[2]]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    want = (x * c + rot * sn).astype(q.dtype)
    atb.assert_close(ref[0].reshape(b, s, h, d)[:, :, 0], want, dtype, "explicit formula")


def _llama(head_dim, heads, theta):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim,
                      rope_theta=theta, max_position_embeddings=512)
    return LlamaRotaryEmbedding(cfg)


def test_rope_vs_hf_llama():
    """LLaMA: BNSD q/k with GQA; base-derived tables and HF's own cos/sin as inputs."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    b, h, hkv, s, d, theta = 2, 4, 2, 9, 72, 500000.0
    q, k = torch.randn(b, h, s, d), torch.randn(b, hkv, s, d)
    pos = torch.randint(0, 256, (b, s))
    cos, sin = _llama(d, h, theta)(q, pos)                     # [B, S, D]
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    op = atb.Builder().build_operation("RoPE", {"num_heads": h, "kv_head_num": hkv, "layout": "BNSD",
                                                "rotary_base": theta, "rotary_type": "neox"})
    got_q, got_k = op.execute([q, k, pos])
    atb.assert_close(got_q, want_q, "fp32", "RoPE q vs HF LLaMA")
    atb.assert_close(got_k, want_k, "fp32", "RoPE k vs HF LLaMA")
    got_q, got_k = op.execute([q, k, cos, sin])                # HF cos/sin given directly
    atb.assert_close(got_q, want_q, "fp32", "RoPE(cos, sin) q vs HF")
    atb.assert_close(got_k, want_k, "fp32", "RoPE(cos, sin) k vs HF")


def test_rope_vs_hf_gpt_neox_partial_rotary():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import (GPTNeoXRotaryEmbedding,
                                                                apply_rotary_pos_emb)

    torch.manual_seed(1)
    b, h, s, d = 2, 3, 7, 64
    cfg = GPTNeoXConfig(hidden_size=h * d, num_attention_heads=h, rotary_pct=0.25,
                        max_position_embeddings=256)
    rd = int(d * cfg.rope_parameters["partial_rotary_factor"])
    q, k = torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    pos = torch.randint(0, 200, (b, s))
    cos, sin = GPTNeoXRotaryEmbedding(cfg)(q, pos)
    assert cos.shape[-1] == rd == 16
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = atb.Builder().build_operation(
        "RoPE", {"layout": "BNSD", "rotary_dim": rd, "rotary_type": "rotate_half"}).execute([q, k, pos])
    atb.assert_close(got_q, want_q, "fp32", "RoPE vs GPT-NeoX partial (q)")
    atb.assert_close(got_k, want_k, "fp32", "RoPE vs GPT-NeoX partial (k)")
    assert torch.equal(got_q[..., rd:], q[..., rd:])          # the pass-through part is untouched


def test_rope_vs_hf_gptj_interleaved_partial():
    """GPT-J rotates pairs (2i, 2i+1) of the first rotary_dim dims, BSND layout."""
    from transformers.models.gptj import modeling_gptj as gptj

    torch.manual_seed(2)
    b, s, h, d, rd = 2, 6, 3, 64, 24
    q = torch.randn(b, s, h, d)
    pos = torch.randint(0, 300, (b, s))
    sincos = gptj.create_sinusoidal_positions(300, rd)[pos]   # [B, S, rd] = sin | cos
    sin, cos = sincos[..., :rd // 2], sincos[..., rd // 2:]
    want = torch.cat([gptj.apply_rotary_pos_emb(q[..., :rd], sin, cos), q[..., rd:]], -1)
    got, = atb.Builder().build_operation("RoPE", {"rotary_dim": rd, "rotary_type": "gptj"}).execute([q, pos])
    atb.assert_close(got, want, "fp32", "RoPE vs GPT-J")


def _seed_rope_per_head(q, position_ids, heads, base, literal):
    """The seed's ``manual_rope_pytorch`` applied per head (head_dim, not the whole
    hidden size). The seed writes ``base ** (2 * idx / dim)`` with ``idx =
    arange(0, dim, 2)``, which counts the 2 twice; ``literal=False`` uses the standard
    ``base ** (idx / dim)`` = ``base ** (2i / dim)``. cos/sin stay fp32 (round once)."""
    b, s, hidden = q.shape
    x = q.float().reshape(b, s, heads, hidden // heads)
    dim = x.shape[-1]
    idx = torch.arange(0, dim, 2, dtype=torch.float64)
    expo = 2 * idx / dim if literal else idx / dim
    angles = position_ids[:, :, None, None].double() / (base ** expo)       # [B, S, 1, D/2]
    cos, sin = angles.cos().float(), angles.sin().float()
    out = x.clone()
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out.reshape(b, s, hidden).to(q.dtype)


def test_seed_rope_usage_and_formula():
    """Seed 8.4: params by seed names, Q [B, S, H*D] fp16, int64 positions [B, S]."""
    heads, head_dim, b, s = 32, 128, 2, 6
    params = {"head_num": heads, "size_per_head": head_dim, "max_seq_len": 8192,
              "rotary_base": 10000.0, "rotary_type": "interleave", "dtype": atb.Dtype.FP16,
              "fuse_with_attention": True}
    torch.manual_seed(0)
    q = torch.randn(b, s, heads * head_dim, dtype=torch.float16)
    pos = torch.arange(100, 100 + s).unsqueeze(0).expand(b, -1).contiguous()
    op = atb.Builder().build_operation("RoPE", params)
    out, = op.execute([q, pos])
    assert out.shape == q.shape and out.dtype == torch.float16
    atb.assert_close(out, _seed_rope_per_head(q, pos, heads, 10000.0, literal=False), "fp16",
                     "RoPE vs the seed formula per head")
    # the seed's literal exponent equals standard RoPE with base**2
    lit, = atb.Builder().build_operation("RoPE", {**params, "rotary_base": 1e8}).execute([q, pos])
    atb.assert_close(lit, _seed_rope_per_head(q, pos, heads, 10000.0, literal=True), "fp16",
                     "RoPE(base**2) vs the seed's literal formula")
    # seed-style outputs list: a TensorDesc placeholder is replaced by the result
    outs = [atb.TensorDesc(shape=list(q.shape), dtype=atb.Dtype.FP16)]
    op.execute([q, pos], outs)
    assert torch.equal(outs[0], out)


def test_whole_hidden_rotation_is_one_head():
    """The seed's formula over the whole hidden dim is RoPE with a single head."""
    q = torch.randn(1, 4, 96)
    pos = torch.arange(4).unsqueeze(0)
    got, = atb.Builder().build_operation("RoPE", {"head_dim": 96, "rotary_type": "interleave"}).execute([q, pos])
    atb.assert_close(got, _seed_rope_per_head(q, pos, 1, 10000.0, literal=False), "fp32")


def test_rope_table_cache_is_shared_and_grows():
    clear_rope_cache()
    p = {"head_dim": 8, "rotary_type": "half", "max_seq_len": 16}
    q = rand((1, 3, 2, 8), "fp32", 1)
    check_op("RoPE", p, [q, np.array([0, 1, 2])])
    check_op("RoPE", p, [q, np.array([3, 4, 5])])
    st = rope_cache_stats()
    assert st["builds"] == 1 and st["hits"] >= 1 and list(st["tables"].values()) == [16]
    c1, _ = rope_tables(8, 10000.0, "half", 16)
    assert rope_tables(8, 10000.0, "half", 10)[0] is c1          # reused, not rebuilt
    check_op("RoPE", p, [q, np.array([7, 40, 2])])               # beyond the cache: grows
    assert list(rope_cache_stats()["tables"].values()) == [41]
    assert rope_cache_stats()["builds"] == 2
    check_op("RoPE", {**p, "position_offset": 200}, [q])         # offset beyond it too
    assert list(rope_cache_stats()["tables"].values())[0] >= 203


def test_rope_huge_positions_skip_the_table():
    """A position far past any table is rotated from on-the-fly angles (no huge cache)."""
    clear_rope_cache()
    q = rand((1, 2, 1, 8), "fp32", 1)
    check_op("RoPE", {}, [q, np.array([3, 5_000_000_000])])
    check_op("RoPE", {"position_offset": 2_000_000}, [q])
    assert all(n <= 8192 for n in rope_cache_stats()["tables"].values())


def test_rope_bind_by_kind():
    """Inputs are bound by kind: an int tensor is position_ids wherever it sits."""
    q, k = rand((1, 3, 16), "fp32", 1), rand((1, 3, 16), "fp32", 2)
    pos = np.array([[4, 5, 6]])
    a = check_op("RoPE", {"head_dim": 8}, [q, k, pos])
    b = check_op("RoPE", {"head_dim": 8}, [q, pos, k])
    c = check_op("RoPE", {"head_dim": 8}, [q, k, pos, None, None])
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a, c):
        np.testing.assert_array_equal(x, y)


Q = rand((2, 3, 16), "fp32", 1)
BAD = [
    # (params, inputs, error, fragments)
    ({"head_dim": 8}, [rand((2, 16), "fp32", 1)], atb.ShapeError, ["rank 3 or 4", "[2, 16]"]),
    ({"head_dim": 6}, [Q], atb.ShapeError, ["divisible by head_dim 6", "16"]),
    ({"num_heads": 3}, [Q], atb.ShapeError, ["num_heads 3", "16"]),
    ({}, [Q], atb.ShapeError, ["head_dim", "num_heads"]),
    ({"head_dim": 4, "num_heads": 4}, [Q, rand((2, 3, 12), "fp32", 2)], atb.ShapeError,
     ["kv heads must divide", "3 kv heads"]),
    ({"head_dim": 8}, [Q, rand((2, 4, 16), "fp32", 2)], atb.ShapeError, ["'k' batch and seq", "[2, 3]"]),
    ({"head_dim": 8, "num_kv_heads": 1}, [Q, rand((2, 3, 16), "fp32", 2)], atb.ShapeError,
     ["number of heads", "1", "2"]),
    ({"head_dim": 8}, [Q, rand((2, 3, 16), "fp16", 2)], atb.DtypeError, ["'k'", "FP32", "FP16"]),
    ({"head_dim": 8}, [Q.astype(np.int32)], atb.DtypeError, ["'q'", "INT32"]),
    ({"head_dim": 8, "dtype": "fp16"}, [Q], atb.DtypeError, ["FP16", "FP32"]),
    ({"head_dim": 8}, [Q, np.zeros((2, 4), np.int64)], atb.ShapeError, ["position_ids", "[3]", "[2, 4]"]),
    ({"head_dim": 8}, [Q, np.zeros((2, 3, 1), np.int64)], atb.ShapeError, ["position_ids", "rank"]),
    ({"head_dim": 8}, [Q, np.array([0, -1, 2])], atb.InputError, ["position_ids", ">= 0", "-1"]),
    ({"head_dim": 8}, [Q, np.array([0, 1, 9]), rand((5, 8), "fp32", 3), rand((5, 8), "fp32", 4)],
     atb.InputError, ["cos/sin table", "< 5", "max 9"]),
    ({"head_dim": 8}, [Q, rand((3, 6), "fp32", 3), rand((3, 6), "fp32", 4)], atb.ShapeError,
     ["'cos'", "8", "[3, 6]"]),
    ({"head_dim": 8}, [Q, rand((3, 8), "fp32", 3), rand((4, 8), "fp32", 4)], atb.ShapeError, ["'sin'"]),
    ({"head_dim": 8}, [Q, None, None, rand((3, 8), "fp32", 3)], atb.InputError,
     ["cos and sin", "only cos"]),
    ({"head_dim": 8}, [Q, rand((3, 8), "fp32", 3)], atb.InputError, ["cos and sin"]),
    ({"head_dim": 8}, [Q, np.zeros(3, np.int64), np.zeros(3, np.int64)], atb.InputError,
     ["integer inputs", "at most 1"]),
    ({"head_dim": 8}, [Q, Q, Q, Q, Q, Q], atb.InputError, ["number of inputs", "6"]),
    ({"head_dim": 8, "layout": "BNSD"}, [Q], atb.ShapeError, ["layout BNSD", "rank 4"]),
    ({"rotary_dim": 16}, [rand((1, 2, 3, 8), "fp32", 1)], atb.ShapeError,
     ["rotary_dim", "<= 8"]),
    ({"head_dim": 8}, [rand((1, 2, 3, 6), "fp32", 1)], atb.ShapeError, ["head_dim", "8", "6"]),
]


@pytest.mark.parametrize("params,inputs,exc,frags", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input(params, inputs, exc, frags):
    check_error("RoPE", params, inputs, exc, *frags, outputs=[np.full((2, 3, 16), 3.0, np.float32)]
                if exc is atb.InputError and "number of inputs" not in frags else None)


def test_bad_input_leaves_outputs_untouched():
    check_error("RoPE", {"head_dim": 8}, [Q, np.array([0, -1, 2])], atb.InputError, "position_ids",
                outputs=[np.full((2, 3, 16), 3.0, np.float32)])
    check_error("RoPE", {"head_dim": 6}, [Q], atb.ShapeError, "head_dim",
                outputs=[np.full((2, 3, 16), 3.0, np.float32)])


def test_wrong_number_of_outputs():
    k = rand((2, 3, 16), "fp32", 2)
    check_error("RoPE", {"head_dim": 8}, [Q], atb.InputError, "number of outputs", "1", "2",
                outputs=[np.zeros((2, 3, 16), np.float32), np.zeros((2, 3, 16), np.float32)])
    # with k given, a single output slot is allowed: only q_out is written
    out = [np.full((2, 3, 16), 3.0, np.float32)]
    atb.Builder().build_operation("RoPE", {"head_dim": 8}).execute([Q, k], out)
    ref, _ = atb.Builder(backend="numpy").build_operation("RoPE", {"head_dim": 8}).execute([Q, k])
    atb.assert_close(out[0], ref, "fp32")
    check_error("RoPE", {"head_dim": 8}, [Q, k], atb.InputError, "number of outputs", "2",
                outputs=[np.full((2, 3, 16), 3.0, np.float32)] * 3)
    check_error("RoPE", {"head_dim": 8}, [Q], atb.ShapeError, "output", outputs=[np.zeros((2, 3, 8), np.float32)])


@pytest.mark.parametrize("params,frag", [
    ({"rotary_type": "spiral"}, "rotary_type"),
    ({"rotary_dim": 7}, "even"),
    ({"head_dim": 8, "rotary_dim": 10}, "<= head_dim"),
    ({"num_heads": 6, "num_kv_heads": 4}, "divisor of num_heads"),
    ({"layout": "SBH"}, "layout"),
    ({"base": 0.5}, "base"),
    ({"head_dim": 0}, "head_dim"),
    ({"max_seq_len": "long"}, "max_seq_len"),
    ({"position_offset": -1}, "position_offset"),
    ({"rotary_bass": 1.0}, "rotary_bass"),
])
def test_bad_params(params, frag):
    check_error("RoPE", params, [], atb.ParamsError, frag, build_error=True)


def test_rope_tables_grow_by_doubling_and_pass_extra_arguments():
    import numpy as np

    from atbcore.ops.rope import rope_angles, rope_cos_sin
    from atbcore.ops.rope_tables import RopeTables

    made = []

    def make(key, rows, scale):
        made.append((key, rows, scale))
        c, s = rope_cos_sin(rope_angles(np.arange(rows), 8, key), "half")
        return c * scale, s * scale

    t = RopeTables(make, min_rows=4)
    c, _ = t.get(10000.0, 3, 1.0)
    assert c.shape == (4, 8) and made == [(10000.0, 4, 1.0)]  # at least min_rows
    assert t.get(10000.0, 4, 1.0)[0] is c and t.hits == 1     # long enough: cached
    c2, s2 = t.get(10000.0, 5, 1.0)                           # longer: at least doubled
    assert c2.shape == (8, 8) and t.builds == 2 and t.sizes() == {10000.0: 8}
    want_c, want_s = rope_cos_sin(rope_angles(np.arange(8), 8, 10000.0), "half")
    np.testing.assert_array_equal(c2, want_c)
    np.testing.assert_array_equal(s2, want_s)
    t.clear()
    assert t.sizes() == {} and t.builds == t.hits == 0
    from atbcore.errors import ParamsError

    for bad in (-1, 2.5, True):
        with pytest.raises(ParamsError, match="table length"):
            t.get(10000.0, bad, 1.0)
    assert t.builds == 0 and made[-1][1] == 8  # nothing built for a bad length
