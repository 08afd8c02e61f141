"""FROZEN: an in-house observer written against hook spec 1.0 (plait 0.1). Do not edit: it must
keep working for the life of hook spec major version 1."""

import json
import os

from plait import hookimpl


@hookimpl
def plait_on_step_end(step, metrics):
    with open(os.environ["FIRST_SPEC_OBSERVED"], "a") as f:
        f.write(json.dumps({"step": step, "loss": metrics["loss"]}) + "\n")
