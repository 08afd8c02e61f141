"""What every worker of a ZeRO run would do for itself before its first step, done once in the
worker server that forks them (``PluginInfo.preload``, on CPU runs):

- import DeepSpeed's Muon optimizer: ``deepspeed.initialize`` checks the optimizer with
  ``is_zero_supported_optimizer``, which imports it, and its ``torch.compile`` decorators import
  torch's inductor (1.8 s of CPU per worker here, 40% of a ZeRO-3 engine's build);
- probe which DeepSpeed ops this machine can build (``deepspeed.ops.__compatible_ops__``):
  ``deepspeed.comm``'s set-up asks for it in every worker, and the probe imports setuptools'
  ``distutils`` and compiles and links a test program for the async I/O op (0.5 s of CPU per
  worker in the test suite's profile). DeepSpeed keeps the answer in the module, so the forks
  inherit it.
"""

import deepspeed.ops
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

deepspeed.ops.__compatible_ops__  # noqa: B018  (computed and kept on first access)
