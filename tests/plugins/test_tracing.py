"""The tracing plugin: every hook call and its duration, when ATB_TRACE_PLUGINS=1."""

from __future__ import annotations

import time

import numpy as np
import pytest

from atbcore.errors import PluginError
from atbcore.plugin import apply_point, get_plugin_manager, hookimpl


class Slow:
    @hookimpl
    def atb_activation(self, name):
        if name == "explode":
            raise RuntimeError("boom")
        time.sleep(0.02)
        return None

    @hookimpl
    def atb_preprocess(self, tensors):
        return None

    @hookimpl
    def atb_register_ops(self):
        pass


def test_traces_every_hook_call_with_duration(builtins, monkeypatch, caplog):
    monkeypatch.setenv("ATB_TRACE_PLUGINS", "1")
    with caplog.at_level("INFO", logger="atb.plugins.trace"):
        pm = get_plugin_manager()
        pm.register(Slow(), name="slow")
        pm.hook.atb_activation(name="nothing")
        apply_point("pre_mlp", [np.ones(2, np.float32)])
        with pytest.raises(PluginError):
            pm.hook.atb_activation(name="explode")
    recs = list(pm.trace_records)
    # set-up hooks of plugins registered after tracing started are traced too
    assert ("atb_register_ops", ("slow",)) in [(r.hook, r.plugins) for r in recs]
    act = [r for r in recs if r.hook == "atb_activation"]
    assert len(act) == 2
    ok, failed = act
    assert ok.plugins[0] == "slow" and "atb_activations" in ok.plugins  # call order
    assert ok.args == ("name",) and ok.error is None
    assert ok.ms >= 20.0  # the 20 ms sleep is inside the measured call
    assert failed.error == "PluginError"
    pre = [r for r in recs if r.hook == "atb_preprocess"]
    assert len(pre) == 1 and pre[0].plugins == ("slow",)
    assert pre[0].args == ("point", "tensors", "node", "payload")
    log = caplog.text
    assert "hook atb_activation(name) [slow, " in log and " ms" in log
    assert "raised PluginError" in log


def test_off_by_default(builtins):
    pm = get_plugin_manager()
    assert pm.records["atb_tracing"].status == "loaded"
    pm.hook.atb_activation(name="gelu")
    assert pm.trace_records is None


def test_tracing_is_undone_on_reset(builtins, monkeypatch):
    from atbcore.plugin import reset_plugin_manager

    monkeypatch.setenv("ATB_TRACE_PLUGINS", "1")
    pm = get_plugin_manager()
    records = pm.trace_records
    reset_plugin_manager()
    n = len(records)
    pm.hook.atb_activation(name="gelu")  # the old manager no longer traces
    assert len(records) == n
