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

__all__ = ["hookimpl", "hookspec", "PROJECT_NAME", "__version__"]
