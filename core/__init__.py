"""plait: one thin core, a pluggy hook spec, and every training feature a plugin.

Plugin authors import the two markers from here::

    from plait import hookimpl

    @hookimpl
    def plait_log_metrics(step, metrics):
        ...
"""

import pluggy

PROJECT_NAME = "plait"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__version__ = "0.1.0"

# The hook spec's own version (semver), separate from the package's: within a major version hooks
# and arguments are only added; a removal or rename first warns for at least one minor version
# (docs/plugins.md, "Stability"). ``hookspec_signatures.json`` records it with every hook.
HOOKSPEC_VERSION = "1.5.0"

__all__ = ["hookimpl", "hookspec", "HOOKSPEC_VERSION", "PROJECT_NAME", "__version__"]
