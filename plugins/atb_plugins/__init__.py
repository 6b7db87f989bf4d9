"""atb's built-in plugins, loaded through the ``atb`` entry-point group like any other."""
