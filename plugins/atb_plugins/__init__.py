"""atb's built-in plugins, loaded through the ``atb`` entry-point group like any other.

Each module is a pluggy plugin (functions marked ``@hookimpl``), registered by
the ``[project.entry-points.atb]`` table of atb's own ``pyproject.toml``:

* ``atb_rope_scaling`` — :mod:`atb_plugins.rope_scaling`: RoPE frequency schedules
* ``atb_activations`` — :mod:`atb_plugins.activations`: activations by name
* ``atb_tracing`` — :mod:`atb_plugins.tracing`: hook-call tracing (``ATB_TRACE_PLUGINS=1``)

Disable one with ``ATB_DISABLE_PLUGINS=atb_tracing`` like any third-party plugin.
"""

#: entry-point name -> module, exactly as in ``[project.entry-points.atb]``
BUILTINS = {
    "atb_rope_scaling": "atb_plugins.rope_scaling",
    "atb_activations": "atb_plugins.activations",
    "atb_tracing": "atb_plugins.tracing",
}

__all__ = ["BUILTINS"]
