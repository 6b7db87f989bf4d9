"""Isolation: a broken plugin is named, skipped (or fatal in strict mode), and
never mistaken for atb or for another plugin."""

from __future__ import annotations

import numpy as np
import pytest

from atbcore.errors import DtypeError, PluginError, ShapeError
from atbcore.plugin import (AtbPluginManager, Plugin, PluginDtypeError, PluginShapeError,
                            apply_point, get_plugin_manager, hookimpl)

GOOD = """
from atbcore.plugin import hookimpl

@hookimpl
def atb_activation(name):
    return "good" if name == "probe" else None
"""


# --------------------------------------------------------------------------- loading
def test_import_failure_is_reported_by_name_and_skipped(plugin_env, caplog):
    plugin_env.add_plugin("broken", "import no_such_module_for_atb_tests\n")
    plugin_env.add_plugin("good", GOOD)
    with caplog.at_level("WARNING", logger="atb"):
        pm = get_plugin_manager()
    rec = pm.records["broken"]
    assert rec.status == "failed" and "no_such_module_for_atb_tests" in rec.error
    assert "plugin 'broken'" in caplog.text and "skipped" in caplog.text
    assert pm.hook.atb_activation(name="probe") == "good"  # the others still load


def test_strict_mode_makes_import_failure_fatal(plugin_env, monkeypatch):
    plugin_env.add_plugin("broken", "raise RuntimeError('kaput at import')\n")
    monkeypatch.setenv("ATB_PLUGINS_STRICT", "1")
    with pytest.raises(PluginError) as ei:
        get_plugin_manager()
    msg = str(ei.value)
    assert "plugin 'broken'" in msg and "kaput at import" in msg and "fake-broken" in msg
    assert isinstance(ei.value.__cause__, RuntimeError)
    # nothing half-initialized is kept: the next call tries (and fails) again
    with pytest.raises(PluginError):
        get_plugin_manager()


def test_failing_setup_hook_skips_the_plugin(plugin_env, caplog):
    plugin_env.add_plugin("badsetup", """
        from atbcore.plugin import hookimpl

        @hookimpl
        def atb_register_ops():
            raise ValueError("cannot register")

        @hookimpl
        def atb_activation(name):
            return "badsetup"
    """)
    with caplog.at_level("WARNING", logger="atb"):
        pm = get_plugin_manager()
    rec = pm.records["badsetup"]
    assert rec.status == "failed"
    assert "atb_register_ops" in rec.error and "cannot register" in rec.error
    assert pm.get_plugin("badsetup") is None  # unregistered again
    assert pm.hook.atb_activation(name="x") is None


def test_invalid_hook_signature_is_reported_by_name(plugin_env, monkeypatch):
    plugin_env.add_plugin("badsig", """
        from atbcore.plugin import hookimpl

        @hookimpl
        def atb_activation(name, not_a_spec_argument):
            return None
    """)
    pm = get_plugin_manager()
    assert pm.records["badsig"].status == "failed"
    assert "not_a_spec_argument" in pm.records["badsig"].error
    assert pm.get_plugin("badsig") is None  # no half-registered hooks remain
    assert all(i.plugin_name != "badsig" for i in pm.hook.atb_activation.get_hookimpls())
    reset = __import__("atbcore.plugin", fromlist=["reset_plugin_manager"]).reset_plugin_manager
    reset()
    monkeypatch.setenv("ATB_PLUGINS_STRICT", "1")
    with pytest.raises(PluginError, match="plugin 'badsig'"):
        get_plugin_manager()


# --------------------------------------------------------------------------- raising hooks
class Raiser:
    @hookimpl
    def atb_activation(self, name):
        raise KeyError("no such table")


class Fine:
    @hookimpl
    def atb_activation(self, name):
        return None


def test_raising_hook_becomes_plugin_error_naming_plugin_and_hook():
    pm = AtbPluginManager()
    pm.register(Fine(), name="fine")
    pm.register(Raiser(), name="raiser")
    with pytest.raises(PluginError) as ei:
        pm.hook.atb_activation(name="x")
    e = ei.value
    assert "plugin 'raiser'" in str(e) and "atb_activation" in str(e) and "KeyError" in str(e)
    assert (e.plugin, e.hook) == ("raiser", "atb_activation")
    assert isinstance(e.__cause__, KeyError)


def test_raising_wrapper_and_inner_plugin_are_each_named():
    pm = AtbPluginManager()
    seen = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def atb_activation(self, name):
            try:
                return (yield)
            except PluginError as e:
                seen.append(e.plugin)
                raise

    pm.register(Raiser(), name="raiser")
    pm.register(Wrapper(), name="wrapper")
    with pytest.raises(PluginError) as ei:
        pm.hook.atb_activation(name="x")
    assert ei.value.plugin == "raiser" and seen == ["raiser"]  # not re-blamed on the wrapper

    class BadWrapper:
        @hookimpl(wrapper=True)
        def atb_activation(self, name):
            yield
            raise RuntimeError("teardown failed")

    pm2 = AtbPluginManager()
    pm2.register(Fine(), name="fine")
    pm2.register(BadWrapper(), name="badwrapper")
    with pytest.raises(PluginError, match="plugin 'badwrapper'.*teardown failed"):
        pm2.hook.atb_activation(name="x")


def test_raising_global_point_hook_is_named(plugin_env):
    class Boom:
        @hookimpl
        def atb_preprocess(self, point, tensors):
            raise ZeroDivisionError("bad math")

    get_plugin_manager().register(Boom(), name="boom")
    with pytest.raises(PluginError, match="plugin 'boom': hook atb_preprocess raised "
                                          "ZeroDivisionError: bad math"):
        apply_point("pre_mlp", [np.ones(2, np.float32)])


def test_raising_local_plugin_is_named(plugin_env):
    class Exploding(Plugin):
        def postprocess(self, outputs):
            raise IndexError("oops")

    with pytest.raises(PluginError, match="plugin 'Exploding': hook postprocess raised IndexError"):
        apply_point("post_attention", [np.ones(2, np.float32)], [Exploding()], node="blk")


# --------------------------------------------------------------------------- wrong results
class Reshaper(Plugin):
    name = "reshaper"

    def preprocess(self, inputs):
        return [x.reshape(-1, 1) for x in inputs]


class Caster(Plugin):
    def postprocess(self, outputs):
        return [x.astype(np.float16) for x in outputs]


def test_wrong_shape_from_local_plugin_is_caught_with_plugin_named(plugin_env):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = x.copy()
    with pytest.raises(PluginShapeError) as ei:
        apply_point("pre_attention", [x], [Reshaper()], node="layer0.attn")
    e = ei.value
    assert isinstance(e, PluginError) and isinstance(e, ShapeError)
    assert "plugin 'reshaper'" in str(e) and "pre_attention" in str(e) and "layer0.attn" in str(e)
    assert (e.expected, e.given) == ([2, 3], [6, 1])
    np.testing.assert_array_equal(x, before)


def test_wrong_dtype_is_caught_with_plugin_named(plugin_env):
    with pytest.raises(PluginDtypeError) as ei:
        apply_point("post_mlp", [np.ones((2, 2), np.float32)], [Caster()])
    assert isinstance(ei.value, DtypeError)
    assert "plugin 'Caster'" in str(ei.value)
    assert (ei.value.expected, ei.value.given) == ("fp32", "fp16")


def test_wrong_shape_from_global_hook_is_caught_with_plugin_named(plugin_env):
    class Trimmer:
        @hookimpl
        def atb_postprocess(self, tensors):
            return [t[:1] for t in tensors]

    get_plugin_manager().register(Trimmer(), name="trimmer")
    with pytest.raises(PluginShapeError, match="plugin 'trimmer': atb_postprocess at "
                                               "model_output"):
        apply_point("model_output", [np.ones((3, 2), np.float32)])


def test_wrong_count_kind_and_framework_are_caught(plugin_env):
    torch = pytest.importorskip("torch")
    x = np.ones((2, 2), np.float32)
    with pytest.raises(PluginError, match="plugin 'dropper'.*wrong number of tensors"):
        apply_point("pre_mlp", [x, x], [_named("dropper", lambda ts: ts[:1])])
    with pytest.raises(PluginError, match="plugin 'stringer'.*returned a str"):
        apply_point("pre_mlp", [x], [_named("stringer", lambda ts: "nope")])
    t = torch.ones(2, 2)
    with pytest.raises(PluginError, match="plugin 'numpyfier'.*framework: expected torch, "
                                          "given numpy"):
        apply_point("pre_block", [t], [_named("numpyfier", lambda ts: [ts[0].numpy()])])


def _named(name, fn):
    class Named(Plugin):
        def preprocess(self, inputs):
            return fn(inputs)

    p = Named()
    p.name = name
    return p


# --------------------------------------------------------------------------- BaseException
def test_sys_exit_at_import_is_contained_and_named(plugin_env, caplog):
    plugin_env.add_plugin("quitter", "import sys\nsys.exit(3)\n")
    plugin_env.add_plugin("good", GOOD)
    with caplog.at_level("WARNING", logger="atb"):
        pm = get_plugin_manager()                       # no SystemExit escapes
    rec = pm.records["quitter"]
    assert rec.status == "failed" and rec.error == "SystemExit: 3"
    err = pm.failures["quitter"]
    assert isinstance(err, PluginError) and err.plugin == "quitter"
    assert "plugin 'quitter'" in str(err) and "SystemExit" in str(err)
    assert isinstance(err.__cause__, SystemExit)
    assert "plugin 'quitter'" in caplog.text and "skipped" in caplog.text
    assert pm.hook.atb_activation(name="probe") == "good"  # the others still load


def test_sys_exit_at_import_in_strict_mode_is_a_plugin_error(plugin_env, monkeypatch):
    plugin_env.add_plugin("quitter", "raise SystemExit('bye')\n")
    monkeypatch.setenv("ATB_PLUGINS_STRICT", "1")
    with pytest.raises(PluginError, match="plugin 'quitter'") as ei:
        get_plugin_manager()
    assert isinstance(ei.value.__cause__, SystemExit)


def test_keyboard_interrupt_at_import_still_interrupts(plugin_env):
    plugin_env.add_plugin("ctrlc", "raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        get_plugin_manager()


def test_sys_exit_in_a_hook_is_a_plugin_error():
    class Quitter(Plugin):
        @hookimpl
        def atb_activation(self, name):
            raise SystemExit(2)

    pm = AtbPluginManager()
    pm.register(Quitter(), name="quitter")
    with pytest.raises(PluginError) as ei:
        pm.hook.atb_activation(name="x")
    assert ei.value.plugin == "quitter" and "SystemExit" in str(ei.value)


def test_sys_exit_at_import_in_a_real_process_keeps_it_running(tmp_path):
    """End to end in a child process: the plugin's sys.exit(7) does not end it."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    site.mkdir()
    (site / "atb_quitter.py").write_text("import sys\nsys.exit(7)\n")
    info = site / "atb_quitter-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: atb-quitter\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[atb]\nquitter = atb_quitter\n")
    code = ("from atbcore.plugin import get_plugin_manager\n"
            "pm = get_plugin_manager()\n"
            "print('alive', pm.records['quitter'].status)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *sys.path]))
    env.pop("ATB_PLUGINS", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "alive failed" in r.stdout
    assert "plugin 'quitter'" in r.stderr and "SystemExit" in r.stderr
