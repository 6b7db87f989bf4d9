"""The example third-party plugin package (examples/atb-example-plugin), installed
the way pip installs it: its wheel is built from its own pyproject.toml and
unpacked into a site directory on sys.path, so atb finds it through the real
``.dist-info`` metadata and its ``atb`` entry point."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import math
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from atbcore.cli.main import main
from atbcore.plugin import apply_point, get_plugin_manager, resolve_activation
from atbcore.tensor import framework_of, to_numpy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "atb-example-plugin"


@pytest.fixture(scope="module")
def example_wheel(tmp_path_factory) -> Path:
    """The example's wheel, built from a copy (so the source tree stays clean)."""
    src = tmp_path_factory.mktemp("example-src") / "atb-example-plugin"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(out), str(src)], check=True,
                   capture_output=True, text=True)
    (wheel,) = out.glob("atb_example_plugin-*.whl")
    return wheel


@pytest.fixture
def example(plugin_env, example_wheel):
    """The example plugin installed into the fake site (a wheel unpacked is what
    pip leaves in site-packages)."""
    with zipfile.ZipFile(example_wheel) as z:
        z.extractall(plugin_env.root)
    plugin_env.modules.add("atb_example_plugin")
    importlib.invalidate_caches()
    return plugin_env


def test_discovered_through_its_entry_point(example, capsys):
    dist = md.distribution("atb-example-plugin")
    assert [(ep.group, ep.name, ep.value) for ep in dist.entry_points] == [
        ("atb", "atb_example", "atb_example_plugin")]
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    row = rows["atb_example"]
    assert row["status"] == "loaded"
    assert row["source"] == "entry point atb-example-plugin 0.1.0 (atb_example_plugin)"
    assert row["hooks"] == ["atb_activation", "atb_preprocess", "atb_register_ops"]
    # the plugin module was imported from the unpacked wheel, not from examples/
    mod = sys.modules["atb_example_plugin"]
    assert Path(mod.__file__).is_relative_to(example.root)


def test_disabled_by_name(example, monkeypatch):
    monkeypatch.setenv("ATB_DISABLE_PLUGINS", "atb_example")
    pm = get_plugin_manager()
    assert pm.records["atb_example"].status == "disabled"
    assert pm.hook.atb_activation(name="squareplus") is None


def test_custom_activation_by_name_matches_hand_values(example):
    spec = resolve_activation("squareplus")
    x = np.array([-2.0, 0.0, 1.0, 3.0])
    # (x + sqrt(x^2 + 4)) / 2 by hand: sqrt(2) - 1, 1, the golden ratio, (3 + sqrt(13)) / 2
    hand = [math.sqrt(2) - 1, 1.0, (1 + math.sqrt(5)) / 2, (3 + math.sqrt(13)) / 2]
    np.testing.assert_allclose(spec(x), hand, rtol=1e-15)
    torch = pytest.importorskip("torch")
    got = spec.torch_fn(torch.tensor(x, dtype=torch.float32))
    np.testing.assert_allclose(got.numpy(), hand, rtol=1e-6)


def hand_rope(x: np.ndarray, theta: float, head_dim: int) -> np.ndarray:
    """Interleaved RoPE written independently: pairs as complex numbers times
    exp(i * pos * theta^(-2j/d)). x: [..., S, F]."""
    s, f = x.shape[-2], x.shape[-1]
    z = x.astype(np.float64).reshape(*x.shape[:-1], f // head_dim, head_dim // 2, 2)
    c = z[..., 0] + 1j * z[..., 1]  # [..., S, H, d/2]
    pos = np.arange(s).reshape(s, 1, 1)
    freq = theta ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    c = c * np.exp(1j * pos * freq)
    out = np.stack([c.real, c.imag], axis=-1)
    return out.reshape(x.shape)


def _frameworks():
    import importlib.util as u

    out = []
    if u.find_spec("torch"):
        out.append(("torch", lambda a: __import__("torch").from_numpy(a)))
    if u.find_spec("mindspore"):
        out.append(("mindspore", lambda a: __import__("mindspore").Tensor(a)))
    if u.find_spec("paddle"):
        out.append(("paddle", lambda a: __import__("paddle").to_tensor(a)))
    return out


@pytest.mark.parametrize("framework,make", _frameworks(), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_pre_attention_rope_variant_at_the_point(example, framework, make):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 5, 8)).astype(np.float32) for _ in range(3))
    get_plugin_manager()
    sys.modules["atb_example_plugin"].configure(theta=100.0, head_dim=4)
    out = apply_point("pre_attention", [make(q), make(k), make(v)], node="blk/attn")
    assert [framework_of(t) for t in out] == [framework] * 3
    np.testing.assert_allclose(to_numpy(out[0]), hand_rope(q, 100.0, 4), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(out[1]), hand_rope(k, 100.0, 4), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(to_numpy(out[2]), v)  # values are not rotated
    # position 0 is never rotated; other points are left alone
    np.testing.assert_allclose(to_numpy(out[0])[:, 0], q[:, 0], rtol=1e-6)
    same = apply_point("post_attention", [make(q)])
    np.testing.assert_array_equal(to_numpy(same[0]), q)


# --------------------------------------------------------------------------- in a GraphOp
FRONT_ENDS = {"torch": "atb_torch", "mindspore": "atb_mindspore", "paddle": "atb_paddle"}


def _graph_op_class(front_end):
    """The front-end's own GraphOp (every front-end exports one)."""
    return front_end.GraphOp


def _attention_block():
    """q, k, v [1, 5, 8] (2 heads of 4) -> FlashAttention -> squareplus."""
    from atbcore.graph.builder import GraphBuilder
    from atbcore.tensor import TensorDesc

    b = GraphBuilder("attn_block")
    q, k, v = (b.add_input(n, TensorDesc([1, 5, 8], "fp32")) for n in "qkv")
    (o,) = b.add_node("FlashAttention", [q, k, v], {"num_heads": 2, "head_dim": 4}, name="attn")
    (y,) = b.add_node("Activation", [o], {"activation_type": "squareplus"}, name="act")
    b.mark_output(y)
    return b.build()


def hand_block(q, k, v, rope: bool, post_scale: float = 1.0) -> np.ndarray:
    """The block by hand: (RoPE on q, k), per-head softmax(q k^T / 2) v, x post_scale,
    then squareplus."""
    if rope:
        q, k = hand_rope(q, 100.0, 4), hand_rope(k, 100.0, 4)
    heads = lambda t: t.astype(np.float64).reshape(1, 5, 2, 4).transpose(0, 2, 1, 3)  # noqa: E731
    qh, kh, vh = heads(q), heads(k), heads(v)  # [1, 2, 5, 4]
    s = qh @ kh.transpose(0, 1, 3, 2) / 2.0  # 1/sqrt(head_dim 4)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ vh).transpose(0, 2, 1, 3).reshape(1, 5, 8) * post_scale
    return (o + np.sqrt(o * o + 4.0)) / 2.0


@pytest.mark.parametrize("framework,make", _frameworks(), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_effect_on_a_graph_op_output(example, framework, make):
    from atbcore.numerics import assert_close
    from atbcore.ops import activation as registry

    front_end = importlib.import_module(FRONT_ENDS[framework])
    registry.unregister_activation("squareplus")  # found again only through the plugin
    graph = _attention_block()  # building "Activation(squareplus)" starts the plugin manager
    assert get_plugin_manager().records["atb_example"].status == "loaded"
    sys.modules["atb_example_plugin"].configure(theta=100.0, head_dim=4)

    class Doubler(front_end.Plugin):
        def postprocess(self, outputs):
            return [o * 2 for o in outputs]

    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 5, 8)).astype(np.float32) for _ in range(3))
    op = _graph_op_class(front_end)(graph)
    y = op(make(q), make(k), make(v))
    assert framework_of(y) == framework
    want = hand_block(q, k, v, rope=True)
    assert_close(to_numpy(y), want.astype(np.float32), "fp32", what=f"{framework} GraphOp")
    # the plugin changed the result: without RoPE the block computes something else
    assert not np.allclose(to_numpy(y), hand_block(q, k, v, rope=False), atol=1e-3)

    op.register_plugin("post_attention", Doubler())  # the seed's local plugin path
    y2 = op(make(q), make(k), make(v))
    want2 = hand_block(q, k, v, rope=True, post_scale=2.0)
    assert_close(to_numpy(y2), want2.astype(np.float32), "fp32", what=f"{framework} + local")
