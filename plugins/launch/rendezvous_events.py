"""The names torch elastic's rendezvous gives its events, found without ``inspect.stack()``.

The c10d rendezvous records an event at each of its steps (9 per launch), named by the method
that recorded it. torch finds that name with ``inspect.stack()``, twice per event, which builds
the source context of every frame on the stack, and each frame's module lookup walks
``sys.modules``. From a deep caller holding many modules that cost the launcher 0.8 s of CPU per
launch here (a test session: a 2-process run of 4 steps took 2.3 s in all), from a shell
command 0.03 s. :func:`method_name` gives torch the same name from the frame objects alone.
"""

from __future__ import annotations

import sys


def method_name(depth: int = 2) -> str:
    """``dynamic_rendezvous.get_method_name``: the name of the function ``depth`` frames above
    this one (``"no_method_name"`` on a shallower stack), read from the frames, not their
    source."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def name_events_from_frames() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = method_name
