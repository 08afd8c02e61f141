"""What every worker of a ``model=hf`` run would build for itself before its first step, done
once in the worker server that forks them (``PluginInfo.preload``, on CPU runs): ``transformers``
and its model base classes (3.3 s of CPU per worker here) and its table of checkpoint renames
(0.8 s), which ``transformers`` builds for every model type at its first lookup and keeps."""

import transformers.modeling_utils  # noqa: F401
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

get_checkpoint_conversion_mapping("llama")
