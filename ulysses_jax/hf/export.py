"""Export a checkpoint of ours as a Hugging Face model directory.

  ulysses-export --workdir=DIR [--step=N] --out=HF_DIR [--param_dtype=bfloat16]

(or ``python -m ulysses_jax.export``; ``ulysses_jax.cli.export``) writes what
``transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)`` loads:
safetensors shards of at most ~5 GB with ``model.safetensors.index.json``, ``config.json``
with the run's RoPE settings (``rope_theta``, ``rope_scaling``: what the run trained with,
context extension included), and the tokenizer files when the run's ``DataConfig.tokenizer``
named a ``tokenizer.json`` (it and the ``tokenizer_config.json``, ``special_tokens_map.json``
and ``generation_config.json`` beside it).

No mesh and no accelerator are needed: the model comes from the run config saved with the
step, and the weights are read from the orbax checkpoint one parameter at a time
(``finetune.SavedParams``; a stacked layer parameter in blocks of layers of at most 1 GiB),
converted, and streamed into the safetensors files (``hf.write_checkpoint``).

Peak host memory: about twice the largest unstacked tensor (the head, read and then
transposed to Hugging Face's layout) plus one orbax chunk being decoded (at most one
device's shard of a parameter), or a 1 GiB layer block, whichever is more. Measured on a
200M-parameter float32 checkpoint (762 MiB of weights, head 125 MiB, saved from 8 devices):
+305 MiB RSS over the process before the export, 12 s (float32 out), +297 MiB, 8 s
(bfloat16 out). For Llama-3.1-8B saved in float32 from 8 devices (computed, not measured):
head [4096, 128256] = 2.1 GB read + 2.1 GB (float32 out) or 1.05 + 1.05 GB (bfloat16 out)
converted and transposed, + a 0.26 GB chunk: about 4.5 GB, whatever the model's size beyond.
"""

import os
import shutil

from ulysses_jax.hf import weights as hf
from ulysses_jax.hf.init_from import SavedParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def export_checkpoint(workdir: str, out: str, *, step: int | None = None,
                      dtype: str | None = None, max_shard_bytes: int = 5 * 2**30) -> str:
  """Writes checkpoint ``step`` (default: the newest) of ``workdir`` (or its
  ``checkpoints/``) to the Hugging Face directory ``out``; returns ``out``.

  ``dtype``: of the written weights (default: the run's ``param_dtype``). Raises
  ``ConfigError`` before writing anything when there is no such checkpoint (naming the steps
  there are). Call it on one process (it reads files, no devices).
  """
  saved = SavedParams(workdir, step, copy_concurrency=1)
  config = saved.config
  hf.write_checkpoint(
      config, lambda key, layers: saved.slice(key, () if layers is None else (layers,)), out,
      dtype=dtype or config.param_dtype, max_shard_bytes=max_shard_bytes)
  tokenizer = saved.run.get("data", {}).get("tokenizer", "byte")
  if tokenizer.endswith(".json") and os.path.isfile(tokenizer):
    source = os.path.dirname(os.path.abspath(tokenizer))
    shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.json"))
    for name in TOKENIZER_FILES[1:]:
      if os.path.isfile(os.path.join(source, name)):
        shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
  return out
