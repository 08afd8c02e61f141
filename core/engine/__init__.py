"""plait's engine library: the machinery every strategy's engine shares, written once.

A layer of its own between the plugins and the thin core (torchtitan's ``components/``,
Lightning Fabric's ``utilities/``): plugins import ``plait.engine`` and the core, ``plait.engine``
imports the core, and the core imports neither (``[tool.importlinter]`` in ``pyproject.toml``,
checked by ``tests/test_imports.py``). A strategy plugin supplies only what is its own: how it
wraps the model, reduces gradients and steps; the rest is here:

====================  ==========================================================================
``step``              the base step (:class:`~plait.engine.step.TorchEngine`): the learning rate
                      into the param groups, micro-batch accumulation, the mean loss, the
                      gradient norm, clipping and the step guard's call, around the strategy's
                      own sync, reduction and optimizer step
``norm``              the gradient norm over whichever groups hold shards (FSDP's dp shards,
                      tensor-parallel shards, pipeline stages, experts), implemented once
``hyperparameters``   the schedule's learning rate into the param groups; the run's settings kept
                      over a loaded optimizer state
``precision``         autocast and the fp16 loss scaler (torch's ``GradScaler``) and its state
``experts``           how expert parameters are marked, and their gradients averaged
``buckets``           flat gradient buckets handed to a comm plugin's reducer
``stages``            a pipeline rank's stage modules under the unsplit model's names, and the
                      identities a cut leaves in the places of other stages' parts
``fidelity``          whether a layout computes a model's own forward, on a seeded stand-in
``state_by_name``     model and optimizer state by parameter name (DCP's ``get_state_dict``)
``tensor_shards``     a tensor-parallel shard cut from a full tensor, and shards joined again
``layout_free``       the layout-free checkpoint copy (DCP), which any layout loads
``pieces``            a tensor as the pieces a rank holds of it, placed in the whole: what the
                      layout-free copy writes and reads in place, nothing gathered
``replicas``          gradients averaged over replica groups that run as independent torch jobs
``rng``               every random generator a rank draws from, saved and put back
====================  ==========================================================================

:class:`~plait.types.StepOutput` stays in :mod:`plait.types`, where the hook spec names it,
and is re-exported here for engines.
"""

from plait.types import StepOutput

__all__ = ["StepOutput"]
