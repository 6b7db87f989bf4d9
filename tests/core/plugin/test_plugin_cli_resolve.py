"""``atb plugins`` and the compile-time look-ups (activation, RoPE) through hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from atbcore.cli.main import main
from atbcore.errors import CapabilityError, PluginError
from atbcore.plugin import (ActivationSpec, AtbPluginManager, RopeFrequencies,
                            get_plugin_manager, hookimpl, resolve_activation, rope_frequencies)

ACT_PLUGIN = """
import numpy as np
from atbcore.plugin import ActivationSpec, hookimpl

@hookimpl
def atb_activation(name):
    if name == "softsign":
        return ActivationSpec("softsign", lambda x: x / (1 + np.abs(x)))
    if name == "broken":
        return "not a spec"
"""


def test_atb_plugins_json_lists_plugins_hooks_sources_and_failures(plugin_env, capsys):
    plugin_env.add_plugin("softsign", ACT_PLUGIN, dist="softsign-act", version="0.3")
    plugin_env.add_plugin("wrecked", "raise ImportError('missing native lib')\n")
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["softsign"]["status"] == "loaded"
    assert rows["softsign"]["hooks"] == ["atb_activation"]
    assert rows["softsign"]["source"] == "entry point softsign-act 0.3 (fake_softsign)"
    assert rows["wrecked"]["status"] == "failed"
    assert "missing native lib" in rows["wrecked"]["error"]


def test_atb_plugins_table_in_a_fresh_process(plugin_env):
    plugin_env.add_plugin("softsign", ACT_PLUGIN, dist="softsign-act")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_env.root)] + sys.path),
               COLUMNS="200")
    out = subprocess.run([sys.executable, "-m", "atbcore.cli.main", "plugins"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "softsign" in out and "atb_activation" in out and "softsign-act" in out


def test_resolve_activation_by_name(plugin_env):
    plugin_env.add_plugin("softsign", ACT_PLUGIN)
    spec = resolve_activation("softsign")
    x = np.array([-3.0, 0.0, 1.0])
    np.testing.assert_allclose(spec(x), [-0.75, 0.0, 0.5])
    with pytest.raises(CapabilityError, match="no plugin provides activation 'nonesuch'"):
        resolve_activation("nonesuch")
    with pytest.raises(PluginError, match="returned a str"):
        resolve_activation("broken")


def test_rope_frequencies_through_the_firstresult_hook(plugin_env):
    class Fixed:
        @hookimpl
        def atb_rope_frequencies(self, config, rope_type, seq_len):
            if rope_type != "fixed":
                return None
            return RopeFrequencies(np.full(config["head_dim"] // 2, 0.5), 2.0)

    get_plugin_manager().register(Fixed(), name="fixed")
    inv, att = rope_frequencies({"rope_type": "fixed", "head_dim": 8})  # type from the config
    np.testing.assert_array_equal(inv, np.full(4, 0.5))
    assert att == 2.0
    with pytest.raises(CapabilityError, match="no plugin supports rope_type 'mystery'"):
        rope_frequencies({"head_dim": 8}, rope_type="mystery")


def test_activation_spec_is_a_value():
    pm = AtbPluginManager()

    class P:
        @hookimpl
        def atb_activation(self, name):
            return ActivationSpec(name, np.tanh, gated=False)

    pm.register(P(), name="p")
    spec = pm.hook.atb_activation(name="tanh")
    assert spec == ActivationSpec("tanh", np.tanh) and not spec.gated
