"""Built-in RoPE schedules vs Hugging Face's ROPE_INIT_FUNCTIONS for the same config."""

from __future__ import annotations

import numpy as np
import pytest

from atbcore.plugin import (RopeFrequencies, get_plugin_manager, hookimpl, rope_frequencies,
                            rope_settings)

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, Phi3Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from atb_plugins import rope_scaling  # noqa: E402

PAIRS = 8  # rotated pairs for head_dim 16
SHORT = list(np.linspace(1.0, 1.5, PAIRS))
LONG = list(np.linspace(1.0, 6.0, PAIRS))


def llama(rope: dict, **kw) -> LlamaConfig:
    kw.setdefault("hidden_size", 64)
    kw.setdefault("num_attention_heads", 4)
    kw.setdefault("max_position_embeddings", 256)
    return LlamaConfig(rope_parameters=dict(rope), **kw)


# (id, config factory, seq_lens to check)
CASES = [
    ("linear", lambda: llama({"rope_type": "linear", "factor": 4.0, "rope_theta": 5e3}), [None]),
    ("linear-partial-headdim", lambda: llama(
        {"rope_type": "linear", "factor": 2.5, "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        head_dim=24), [None]),
    ("dynamic", lambda: llama({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     [None, 100, 256, 1000]),
    ("yarn", lambda: llama({"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4,
                            "original_max_position_embeddings": 32}), [None]),
    ("yarn-mscale", lambda: llama({"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e4,
                                   "original_max_position_embeddings": 64, "mscale": 0.707,
                                   "mscale_all_dim": 1.0, "beta_fast": 16}), [None]),
    ("yarn-explicit-untruncated", lambda: llama(
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5,
         "truncate": False, "attention_factor": 1.3, "beta_fast": 8, "beta_slow": 2,
         "original_max_position_embeddings": 64}, head_dim=24), [None]),
    ("llama3", lambda: llama({"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}), [None]),
    ("longrope", lambda: llama({"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4,
                                "short_factor": SHORT, "long_factor": LONG,
                                "original_max_position_embeddings": 64}), [None, 64, 65, 300]),
    ("longrope-phi3", lambda: Phi3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        original_max_position_embeddings=128,
        rope_parameters={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                         "rope_theta": 1e4}), [None, 600]),
]


@pytest.mark.parametrize("case,make,seq_lens", CASES, ids=[c[0] for c in CASES])
def test_schedule_equals_hugging_face(case, make, seq_lens):
    config = make()
    rope_type = config.rope_parameters["rope_type"]
    for seq_len in seq_lens:
        hf_inv, hf_att = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len)
        ours = rope_scaling.SCHEDULES[rope_type](rope_settings(config), seq_len)
        assert ours.inv_freq.dtype == np.float64 and ours.inv_freq.shape == tuple(hf_inv.shape)
        # HF computes in float32; ours in float64
        np.testing.assert_allclose(ours.inv_freq, hf_inv.double().numpy(), rtol=2e-6, atol=0,
                                   err_msg=f"{case} seq_len={seq_len}")
        assert ours.attention_factor == pytest.approx(hf_att, rel=1e-12)


def test_schedules_actually_differ_from_plain_rope():
    # a guard that the comparison above is not comparing two defaults
    for case, make, _ in CASES:
        config = make()
        s = rope_settings(config)
        plain = rope_scaling.default(s, None).inv_freq
        scaled = rope_scaling.SCHEDULES[s.rope_type](s, 10_000).inv_freq
        assert not np.allclose(plain, scaled), case


def test_plain_dict_config_matches_the_hf_config():
    rope = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4,
            "original_max_position_embeddings": 32}
    hf = llama(rope)
    as_dict = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 256,
               "rope_parameters": dict(rope)}
    old_style = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 256,
                 "rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 8.0,
                                                     "original_max_position_embeddings": 32}}
    ref = rope_scaling.yarn(rope_settings(hf), None)
    for cfg in (as_dict, old_style):
        got = rope_scaling.yarn(rope_settings(cfg), None)
        np.testing.assert_array_equal(got.inv_freq, ref.inv_freq)
        assert got.attention_factor == ref.attention_factor


def test_default_schedule_is_theta_power(builtins):
    inv, att = rope_frequencies({"head_dim": 8, "rope_theta": 100.0})
    np.testing.assert_allclose(inv, [1.0, 100 ** -0.25, 100 ** -0.5, 100 ** -0.75], rtol=1e-15)
    assert att == 1.0


def test_found_through_the_entry_point_hook(builtins):
    pm = get_plugin_manager()
    assert pm.records["atb_rope_scaling"].status == "loaded"
    config = {c[0]: c[1] for c in CASES}["llama3"]()
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    inv, att = rope_frequencies(config)  # rope type read from config.rope_parameters
    np.testing.assert_allclose(inv, hf_inv.double().numpy(), rtol=2e-6)
    assert pm.hook.atb_rope_frequencies(config=config, rope_type="unknown-kind",
                                        seq_len=None) is None


def test_third_party_plugin_overrides_a_builtin_schedule(builtins):
    class Mine:
        @hookimpl
        def atb_rope_frequencies(self, config, rope_type):
            return RopeFrequencies(np.zeros(2), 9.0) if rope_type == "linear" else None

    get_plugin_manager().register(Mine(), name="mine")
    assert rope_frequencies({"head_dim": 4, "factor": 2.0}, "linear").attention_factor == 9.0
    # the built-in still answers what the override passes on
    inv, _ = rope_frequencies({"head_dim": 4, "rope_type": "dynamic", "factor": 2.0,
                               "max_position_embeddings": 16}, seq_len=8)
    np.testing.assert_allclose(inv, [1.0, 1e-2])
