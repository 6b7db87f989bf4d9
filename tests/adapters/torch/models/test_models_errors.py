"""Unsupported architectures, config options and arguments are refused by name
(CapabilityError / ParamsError), never run silently wrong; a plugin can add an
architecture through ``atb_model_architecture``."""

import pytest
import torch
from transformers.cache_utils import DynamicCache
import transformers as tf

from atbcore.errors import CapabilityError, InputError, ParamsError
from atbcore.numerics import assert_close
from atbcore.plugin import get_plugin_manager, hookimpl
from atb_torch.models import ArchSpec, compile
from atb_torch.models.arch import ARCHITECTURES
from tiny_models import config, left_padded, tiny


def _raises(exc, *fragments):
    def check(fn):
        with pytest.raises(exc) as e:
            fn()
        for f in fragments:
            assert f in str(e.value), str(e.value)
    return check


def test_unknown_architecture():
    torch.manual_seed(0)
    m = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=64,
                                               vocab_size=64))
    _raises(CapabilityError, "architecture", "gpt_neox")(lambda: compile(m))


@pytest.mark.parametrize("option,value,fragment", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("rope_parameters", {"rope_type": "made_up", "rope_theta": 10000.0}, "made_up"),
    ("hidden_act", "no_such_act", "no_such_act"),
])
def test_unsupported_config_options(option, value, fragment):
    m = tiny("llama")
    setattr(m.config, option, value)
    _raises(CapabilityError, fragment)(lambda: compile(m))


def test_cross_attention_refused():
    m = tiny("gpt2", add_cross_attention=True)
    _raises(CapabilityError, "add_cross_attention")(lambda: compile(m))
    bert = tiny("bert", is_decoder=True)
    _raises(CapabilityError, "is_decoder")(lambda: compile(bert))


def test_bad_compile_arguments():
    m = tiny("llama")
    _raises(ParamsError, "opt_level")(lambda: compile(m, opt_level=4))
    _raises(ParamsError, "quantize")(lambda: compile(m, quantize="w3"))
    _raises(ParamsError, "dtype")(lambda: compile(m, dtype=torch.int32))
    _raises(CapabilityError, "mode")(lambda: compile(m, mode="train"))
    _raises(CapabilityError, "model type")(lambda: compile(torch.nn.Linear(2, 2)))


def test_forward_options_refused():
    c = compile(tiny("llama"))
    ids, _ = left_padded([5])
    _raises(ParamsError, "one of cache= and past_key_values=")(
        lambda: c(ids, cache=DynamicCache(), past_key_values=DynamicCache()))
    _raises(CapabilityError, "cu_seq_lens_q")(lambda: c(ids, cu_seq_lens_q=torch.tensor([0, 5])))
    _raises(InputError, "out of range")(lambda: c(ids + 1000))
    _raises(CapabilityError, "packed sequences")(
        lambda: c(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1]]), use_cache=False))


def test_dynamic_rope_refused_past_its_length():
    m = tiny("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
             max_position_embeddings=16)
    c = compile(m)
    ids = torch.randint(3, 256, (1, 12))
    with torch.no_grad():  # within max_position_embeddings the frequencies are the default ones
        assert_close(c(ids).logits, m(ids).logits, "fp32", "dynamic rope within its length")
    _raises(CapabilityError, "dynamic")(lambda: c(torch.randint(3, 256, (1, 20))))


class _RenamedLlama:
    """A plugin answering for model_type 'renamed_llama' with the Llama description."""

    @hookimpl
    def atb_model_architecture(self, config):
        if getattr(config, "model_type", None) != "renamed_llama":
            return None
        base = ARCHITECTURES["llama"]
        return ArchSpec("renamed_llama", ("renamed_llama",), "decoder", base.describe,
                        base.extract)


def test_plugin_adds_an_architecture():
    m = tiny("llama")
    m.config.model_type = "renamed_llama"  # an instance attribute: the class keeps "llama"
    pm = get_plugin_manager()
    _raises(CapabilityError, "renamed_llama")(lambda: compile(m))
    plugin = _RenamedLlama()
    pm.register(plugin, name="renamed-llama-test")
    try:
        c = compile(m)
    finally:
        pm.unregister(plugin)
    ids, mask = left_padded([4, 7])
    with torch.no_grad():
        ref = m(ids, attention_mask=mask).logits[mask.bool()]
        out = c(ids, attention_mask=mask).logits[mask.bool()]
    assert_close(out, ref, "fp32", "plugin architecture")
    assert c.atb_runner.spec.arch == "renamed_llama"


def test_bad_plugin_answer_is_a_plugin_error():
    from atbcore.errors import PluginError

    class Bad:
        @hookimpl
        def atb_model_architecture(self, config):
            return "not an ArchSpec" if config.model_type == "weird" else None

    m = tiny("llama")
    m.config.model_type = "weird"
    pm = get_plugin_manager()
    bad = Bad()
    pm.register(bad, name="bad-arch-test")
    try:
        _raises(PluginError, "ArchSpec")(lambda: compile(m))
    finally:
        pm.unregister(bad)


def test_config_helper_defaults():
    assert config("llama").num_key_value_heads == 2  # the tiny configs the suite relies on


def test_compiled_decoders_run_the_plugin_points_without_a_warning(caplog):
    """A plugin implementing an execution point (here ``atb_rope``): a decoder compiled
    on any device runs on the core engine, which runs the points (tested with the
    example plugin), so compile() has nothing to warn about."""
    import logging

    class Rope:
        @hookimpl
        def atb_rope(self, payload):
            return None

    pm = get_plugin_manager()
    plugin = Rope()
    m = tiny("llama")
    with caplog.at_level(logging.WARNING, logger="atb"):
        pm.register(plugin, name="rope-warning-test")
        try:
            fast = compile(m)
        finally:
            pm.unregister(plugin)
    assert type(fast.atb_runner).__name__ == "CoreRunner"
    assert not [r for r in caplog.records if "plugin points" in r.getMessage()]
