"""plait's built-in plugins. Each module is registered through the ``plait`` entry-point group,
the same way an installed third-party plugin is; none is imported by the core."""
