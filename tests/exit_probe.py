"""Imported by tests/test_launch.py's exit test into the process under test: appends
``imported <pid>`` to the file ``$EXIT_PROBE_MARK``, and holds a reference cycle that the
interpreter's final garbage collections free at exit, whose finalizer then appends
``finalized <pid>``; unless the process froze its objects at exit
(``plait.forkserver.freeze_at_exit``), which no collection visits."""

import os


class Cycle:
    def __init__(self) -> None:
        self.itself = self
        self.pid = os.getpid()
        self.mark = os.environ["EXIT_PROBE_MARK"]
        with open(self.mark, "a") as mark:
            mark.write(f"imported {self.pid}\n")

    # open is bound now: at exit the module's globals and builtins may be gone
    def __del__(self, open=open) -> None:
        with open(self.mark, "a") as mark:
            mark.write(f"finalized {self.pid}\n")


held = Cycle()  # reachable until the interpreter clears this module at exit
