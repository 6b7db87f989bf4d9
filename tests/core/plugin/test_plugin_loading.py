"""Discovery through the entry-point group ``atb``: allowlist, blocklist, idempotence."""

from __future__ import annotations

import importlib.metadata as md
import sys

import pluggy
import pytest

from atbcore.plugin import (AtbPluginManager, get_plugin_manager, hookimpl, reset_plugin_manager)
from atbcore.plugin.loader import load_entry_point_plugins

# A plugin module that counts its imports and set-up calls in a module that
# survives re-imports (sys is never reloaded).
COUNTING = """
import sys
from atbcore.plugin import hookimpl
counts = sys.__dict__.setdefault("_atb_test_counts", {{}})
counts["{name}:import"] = counts.get("{name}:import", 0) + 1

@hookimpl
def atb_register_ops():
    counts["{name}:setup"] = counts.get("{name}:setup", 0) + 1

@hookimpl
def atb_activation(name):
    return "{name}" if name == "who" else None
"""


def _counts() -> dict:
    return sys.__dict__.setdefault("_atb_test_counts", {})


@pytest.fixture(autouse=True)
def _clear_counts():
    _counts().clear()
    yield
    _counts().clear()


def _loaded(pm) -> set[str]:
    return {r.name for r in pm.describe() if r.status == "loaded"}


def test_installed_distribution_is_discovered_like_pip_installed(plugin_env):
    plugin_env.add_plugin("alpha", COUNTING.format(name="alpha"), dist="alpha-dist",
                          version="2.5")
    # the metadata is real: importlib.metadata and pluggy's own loader see it
    assert md.distribution("alpha-dist").version == "2.5"
    assert [ep.value for ep in md.entry_points(group="atb") if ep.name == "alpha"] == ["fake_alpha"]
    raw = pluggy.PluginManager("atb")
    assert raw.load_setuptools_entrypoints("atb", name="alpha") == 1
    assert raw.get_plugin("alpha").__name__ == "fake_alpha"

    pm = get_plugin_manager()
    assert "alpha" in _loaded(pm)
    rec = pm.records["alpha"]
    assert (rec.distribution, rec.version, rec.value) == ("alpha-dist", "2.5", "fake_alpha")
    assert rec.source == "entry point alpha-dist 2.5 (fake_alpha)"
    assert pm.describe()[list(pm.records).index("alpha")].hooks == ["atb_activation",
                                                                     "atb_register_ops"]
    assert pm.hook.atb_activation(name="who") == "alpha"
    assert _counts()["alpha:setup"] == 1


def test_loading_is_idempotent_per_process(plugin_env):
    plugin_env.add_plugin("alpha", COUNTING.format(name="alpha"))
    pm1 = get_plugin_manager()
    pm2 = get_plugin_manager()
    assert pm1 is pm2
    assert load_entry_point_plugins(pm1) == []  # loading again adds nothing
    assert _counts() == {"alpha:import": 1, "alpha:setup": 1}
    assert len([i for i in pm1.hook.atb_activation.get_hookimpls()
                if i.plugin_name == "alpha"]) == 1
    # reset (tests only) builds a fresh manager that loads again; the module stays imported
    reset_plugin_manager()
    pm3 = get_plugin_manager()
    assert pm3 is not pm1 and "alpha" in _loaded(pm3)
    assert _counts() == {"alpha:import": 1, "alpha:setup": 2}


def test_allowlist_by_entry_point_or_distribution_name(plugin_env, monkeypatch):
    plugin_env.add_plugin("alpha", COUNTING.format(name="alpha"))
    plugin_env.add_plugin("beta", COUNTING.format(name="beta"), dist="Beta_Pkg")
    plugin_env.add_plugin("gamma", COUNTING.format(name="gamma"))
    monkeypatch.setenv("ATB_PLUGINS", "alpha, beta-pkg")
    pm = get_plugin_manager()
    loaded = _loaded(pm)
    assert {"alpha", "beta"} <= loaded and "gamma" not in loaded
    assert pm.records["gamma"].status == "not allowed"
    assert "fake_gamma" not in sys.modules  # never imported
    assert "gamma:import" not in _counts()


def test_blocklist_skips_and_blocks_registration_by_name(plugin_env, monkeypatch):
    plugin_env.add_plugin("alpha", COUNTING.format(name="alpha"))
    plugin_env.add_plugin("beta", COUNTING.format(name="beta"))
    monkeypatch.setenv("ATB_DISABLE_PLUGINS", "beta")
    pm = get_plugin_manager()
    assert "alpha" in _loaded(pm) and "beta" not in _loaded(pm)
    assert pm.records["beta"].status == "disabled"
    assert "fake_beta" not in sys.modules

    class Impostor:
        @hookimpl
        def atb_activation(self, name):
            return "impostor"

    assert pm.register(Impostor(), name="beta") is None  # the name stays blocked
    assert pm.hook.atb_activation(name="x") is None


def test_blocklist_wins_over_allowlist(plugin_env, monkeypatch):
    plugin_env.add_plugin("alpha", COUNTING.format(name="alpha"))
    monkeypatch.setenv("ATB_PLUGINS", "alpha")
    monkeypatch.setenv("ATB_DISABLE_PLUGINS", "alpha")
    pm = get_plugin_manager()
    assert pm.records["alpha"].status == "disabled"
    assert "alpha:import" not in _counts()


def test_allowlist_naming_a_missing_plugin_warns(plugin_env, monkeypatch, caplog):
    monkeypatch.setenv("ATB_PLUGINS", "nowhere_to_be_found")
    with caplog.at_level("WARNING", logger="atb"):
        get_plugin_manager()
    assert "nowhere-to-be-found" in caplog.text


def test_class_entry_point_is_instantiated(plugin_env):
    plugin_env.add_dist("klass-dist", "1.0", {"klass": "fake_klass:Provider"}, {"fake_klass.py": """
        from atbcore.plugin import hookimpl

        class Provider:
            def __init__(self):
                self.prefix = "inst"

            @hookimpl
            def atb_activation(self, name):
                return self.prefix + ":" + name
    """})
    pm = get_plugin_manager()
    assert pm.hook.atb_activation(name="x") == "inst:x"


def test_runtime_registration_runs_setup_hooks_once(plugin_env):
    pm = AtbPluginManager()
    calls = []

    class Late:
        @hookimpl
        def atb_configure(self, manager):
            calls.append(("configure", manager))

        @hookimpl
        def atb_register_fusion_rules(self):
            return ["rule-a", "rule-b"]

    class Other:
        @hookimpl
        def atb_register_fusion_rules(self):
            return ["rule-c"]

    late = Late()
    assert pm.register(late, name="late") == "late"
    pm.register(Other(), name="other")
    assert calls == [("configure", pm)]  # not re-run when another plugin registers
    assert pm.fusion_rules == [("late", "rule-a"), ("late", "rule-b"), ("other", "rule-c")]
    assert pm.records["late"].source == "runtime"
    pm.unregister(late)
    assert pm.fusion_rules == [("other", "rule-c")]
    assert "late" not in pm.records
