"""Fixtures of the plugin tests (see plugin_env.py)."""

from plugin_env import plugin_env  # noqa: F401  (fixture)
