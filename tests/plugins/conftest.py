"""Fixtures of the built-in/example plugin tests: the same fake-site support as
tests/core/plugin (one implementation, imported from there)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "plugin"))

from plugin_env import plugin_env  # noqa: F401,E402  (fixture)

from atb_plugins import BUILTINS  # noqa: E402


@pytest.fixture
def builtins(plugin_env):
    """The built-in plugins installed through entry points, as atb's own
    ``[project.entry-points.atb]`` table declares them (a distribution whose
    ``entry_points.txt`` has exactly those lines)."""
    plugin_env.add_dist("atb-builtin-plugins", "0.1.0", dict(BUILTINS))
    return plugin_env
