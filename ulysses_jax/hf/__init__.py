"""Hugging Face interoperability: checkpoints in and out, and their configs.

* ``weights``: ``load_llama`` / ``save_llama``, safetensors <-> the FSDP-sharded ``Llama``;
* ``config``: ``config.json`` <-> ``LlamaConfig`` (RoPE scaling included);
* ``moe``: the mixture-of-experts tensors of Qwen3-MoE, Mixtral and gpt-oss;
* ``init_from``: ``TrainConfig.init_from``, a run started from a Hugging Face checkpoint or
  from one of ours;
* ``export``: a checkpoint of ours as a Hugging Face directory (``ulysses-export``).

Until 0.2 ``ulysses_jax.hf`` was one module, now ``hf.weights``; its names still resolve here,
with a ``DeprecationWarning``, for one release.
"""

import warnings

_WEIGHTS_NAMES = ("build_llama", "load_llama", "write_checkpoint", "save_llama",
                  "SAFETENSORS_DTYPES", "ARCHITECTURES", "config_from_hf", "config_to_hf",
                  "model_type_of", "read_config", "rope_scaling_from_hf")


def __getattr__(name):
  if name not in _WEIGHTS_NAMES:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  from ulysses_jax.hf import weights  # pylint: disable=import-outside-toplevel
  warnings.warn(f"ulysses_jax.hf.{name} is now ulysses_jax.hf.weights.{name}; import it from "
                "there (the old name goes in the next release)", DeprecationWarning,
                stacklevel=2)
  return getattr(weights, name)
