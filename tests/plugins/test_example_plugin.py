"""The example third-party plugin package (examples/atb-example-plugin), installed
the way pip leaves it: its module and a ``.dist-info`` with its ``atb`` entry point
in a site directory on sys.path (made here in tmp_path; no pip at test time), so
atb finds it through the real entry-point machinery.

Its custom RoPE (partial, position-scaled, interleaved; at the ``rope`` point) and
its ``squareplus`` activation are checked against the block written by hand in
NumPy, in a GraphOp of each front-end, for a full recompute and for incremental
decoding in both KV-cache forms."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from atbcore.cli.main import main
from atbcore.numerics import assert_close
from atbcore.plugin import get_plugin_manager, resolve_activation
from atbcore.tensor import framework_of, from_numpy, to_numpy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "atb-example-plugin"
SOURCE = EXAMPLE / "src" / "atb_example_plugin" / "__init__.py"


@pytest.fixture
def example(plugin_env):
    """The example installed: its module plus a dist-info naming its entry point."""
    plugin_env.add_dist("atb-example-plugin", "0.1.0", {"atb_example": "atb_example_plugin"},
                        {"atb_example_plugin/__init__.py": SOURCE.read_text()})
    importlib.invalidate_caches()
    return plugin_env


def test_discovered_through_its_entry_point(example, capsys):
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    row = rows["atb_example"]
    assert row["status"] == "loaded"
    assert row["source"] == "entry point atb-example-plugin 0.1.0 (atb_example_plugin)"
    assert row["hooks"] == ["atb_activation", "atb_rope"]
    assert Path(sys.modules["atb_example_plugin"].__file__).is_relative_to(example.root)


def test_disabled_by_name(example, monkeypatch):
    monkeypatch.setenv("ATB_DISABLE_PLUGINS", "atb_example")
    pm = get_plugin_manager()
    assert pm.records["atb_example"].status == "disabled"
    assert pm.hook.atb_activation(name="squareplus") is None
    assert not pm.hook.atb_rope.get_hookimpls()


def test_custom_activation_by_name_matches_hand_values(example):
    spec = resolve_activation("squareplus")
    x = np.array([-2.0, 0.0, 1.0, 3.0])
    # (x + sqrt(x^2 + 4)) / 2 by hand: sqrt(2) - 1, 1, the golden ratio, (3 + sqrt(13)) / 2
    hand = [math.sqrt(2) - 1, 1.0, (1 + math.sqrt(5)) / 2, (3 + math.sqrt(13)) / 2]
    np.testing.assert_allclose(spec(x), hand, rtol=1e-15)


# --------------------------------------------------------------------------- by hand
B, S, H, D, HID, INTER = 2, 7, 2, 8, 16, 24


def hand_rope(x: np.ndarray, pos: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """The example's rotation written independently: the first D/2 dims of each head
    as D/4 complex pairs (2i, 2i+1) times exp(i * (pos / 2) * base^(-2i / (D/2)));
    x [B, S, H, D], pos [S]."""
    rd = D // 2
    z = x[..., :rd].reshape(*x.shape[:-1], rd // 2, 2)
    c = z[..., 0] + 1j * z[..., 1]
    freq = base ** (-np.arange(0, rd, 2) / rd)
    c = c * np.exp(1j * (pos / 2.0)[None, :, None, None] * freq)
    out = x.copy()
    out[..., :rd] = np.stack([c.real, c.imag], axis=-1).reshape(*x.shape[:-1], rd)
    return out


def hand_block(x: np.ndarray, w: dict, rope: bool = True) -> np.ndarray:
    """qkv projection, (the example's RoPE), causal attention, output projection,
    squareplus MLP; float64."""
    x = x.astype(np.float64)
    qkv = x @ w["qkv"].T
    q, k, v = (qkv[..., i * H * D:(i + 1) * H * D].reshape(B, S, H, D) for i in range(3))
    if rope:
        q, k = hand_rope(q, np.arange(S)), hand_rope(k, np.arange(S))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, S, H * D) @ w["o"].T
    u = o @ w["up"].T
    return (0.5 * (u + np.sqrt(u * u + 4.0))) @ w["down"].T


def _weights() -> dict:
    rng = np.random.default_rng(5)
    shapes = {"qkv": (3 * H * D, HID), "o": (HID, H * D), "up": (INTER, HID),
              "down": (HID, INTER)}
    return {k: (rng.standard_normal(s) / math.sqrt(s[1])).astype(np.float32)
            for k, s in shapes.items()}


def _block(w: dict):
    from atbcore.graph import layers as L
    from atbcore.graph.graph_op import GraphOp
    from atbcore.graph.layers_attention import FlashAttention, FusedFeedForward, RoPE

    return GraphOp([
        L.Linear("qkv", out_features=3 * H * D, bias=False).load_weights({"weight": w["qkv"]}),
        RoPE("rope"),
        FlashAttention("attn", num_heads=H, causal=True, kv_cache=True),
        L.Linear("o", out_features=HID, bias=False).load_weights({"weight": w["o"]}),
        FusedFeedForward("mlp", intermediate_size=INTER, activation_type="squareplus"
                         ).load_weights({"up_proj.weight": w["up"], "down_proj.weight": w["down"]}),
    ], name="block")


FRAMEWORKS = [f for f in ("torch", "mindspore", "paddle") if importlib.util.find_spec(f)]
FRONT_ENDS = {"torch": "atb_torch", "mindspore": "atb_mindspore", "paddle": "atb_paddle"}


def _front_end_block(framework: str, w: dict):
    """The block as the front-end's own GraphOp (an nn.Module, a Cell, a Layer)."""
    fe = importlib.import_module(FRONT_ENDS[framework])
    if framework != "torch":  # Cell / Layer wrappers take the core layers
        return fe.GraphOp(_block(w)._layers, name="block")
    import torch

    op = fe.GraphOp([fe.Linear(HID, 3 * H * D, bias=False), fe.RoPE(),
                     fe.FlashAttention(num_heads=H, head_dim=D, causal=True, kv_cache=True, packed=True),
                     fe.Linear(H * D, HID, bias=False),
                     fe.FusedFeedForward(intermediate_size=INTER, activation_type="squareplus",
                                         hidden_size=HID)], name="block")
    named = {"layers.linear.weight": "qkv", "layers.linear_1.weight": "o",
             "layers.ffn.up_proj.weight": "up", "layers.ffn.down_proj.weight": "down"}
    params = dict(op.named_parameters())
    with torch.no_grad():
        for name, key in named.items():
            params[name].copy_(torch.from_numpy(w[key]))
    return op


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_custom_rope_and_activation_full_and_incremental(example, framework):
    from atbcore.memory import KVCache
    from atbcore.ops import activation as registry

    registry.unregister_activation("squareplus")  # found again through the hook alone
    w = _weights()
    x = np.random.default_rng(9).standard_normal((B, S, HID)).astype(np.float32)
    want = hand_block(x, w).astype(np.float32)
    t = lambda a: from_numpy(np.ascontiguousarray(a), framework)  # noqa: E731
    op = _front_end_block(framework, w)

    full, _ = op(t(x), kv_cache=None)  # full recompute (concatenating form, empty past)
    assert framework_of(full) == framework
    assert_close(to_numpy(full), want, "fp32", what=f"{framework} full recompute")
    # the plugin changed the result: the built-in RoPE computes something else
    assert np.abs(to_numpy(full) - hand_block(x, w, rope=False)).max() > 1e-2

    kv, parts = None, []  # incremental, concatenating form: prefill 3, then one at a time
    for a, b in [(0, 3)] + [(i, i + 1) for i in range(3, S)]:
        y, kv = op(t(x[:, a:b]), kv_cache=kv)
        parts.append(to_numpy(y))
    assert_close(np.concatenate(parts, 1), want, "fp32", what=f"{framework} incremental")

    cache, parts = KVCache(1, B, 16, H, D, dtype="fp32"), []  # in-place form
    for a, b in [(0, 4)] + [(i, i + 1) for i in range(4, S)]:
        y, cache = op(t(x[:, a:b]), kv_cache=cache)
        parts.append(to_numpy(y))
    assert_close(np.concatenate(parts, 1), want, "fp32", what=f"{framework} atb.KVCache")


def test_payload_positions_are_absolute_and_v_is_never_rotated(example):
    """What the plugin is handed on a decode step: the cache offset is in the
    positions, the layer index and the cache form are named, and only q and k
    come (the RoPE node never sees v)."""
    seen = []
    get_plugin_manager()
    mod = sys.modules["atb_example_plugin"]
    orig = mod.atb_rope

    class Spy:
        def rope(self, payload):
            seen.append(payload)
            return orig(payload)

    w = _weights()
    x = np.random.default_rng(2).standard_normal((B, S, HID)).astype(np.float32)
    op = _block(w)
    op.register_plugin("rope", Spy())
    _, kv = op(x[:, :5], kv_cache=None)
    y, kv = op(x[:, 5:6], kv_cache=kv)
    last = seen[-1]
    assert last.layer == 0 and last.cache.form == "concatenate"
    assert to_numpy(last.positions).tolist() == [[5]] and last.cache.past_lengths == (5,)
    assert last.q.shape == (B, 1, H, D) and last.k.shape == (B, 1, H, D)
    assert (last.rope.base, last.rope.rotary_dim, last.rope.head_dim) == (10000.0, D, D)
