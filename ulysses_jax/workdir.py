"""What a workdir records about its runs, and how a new start compares with it.

``config.gin`` holds the operative config of the latest start that trained, and
``config_history/`` one copy per such start (named by UTC time and starting step); both are
written only once a run is known to proceed. Checkpoints carry the run config they were
trained with (``checkpoint.read_run_config``); these helpers compare it with a new start's.
"""

import datetime
import json
import os

from ulysses_jax.checkpoint import read_run_config
from ulysses_jax.run_config import RunConfig


def write_configs(workdir: str, config: RunConfig, start: int):
  """``config.gin`` (this start's operative config) and a copy kept in ``config_history/``."""
  history = os.path.join(workdir, "config_history")
  os.makedirs(history, exist_ok=True)
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
  for path in (os.path.join(workdir, "config.gin"),
               os.path.join(history, f"{stamp}-step{start}.gin")):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.write(config.gin)
    os.replace(path + ".tmp", path)


# Settings that change the train state's tree or shapes: a checkpoint saved with other values
# cannot restore. (Placement, remat and tiling can change on resume.)
STATE_FIELDS = {"model": ("vocab_size", "hidden_dim", "num_layers", "num_heads", "num_kv_heads",
                          "head_dim", "mlp_dim", "tie_embeddings", "qkv_bias", "qk_norm",
                          "attention_sinks", "attn_out_bias", "moe"),
                "train": ("master_weights",)}


def why_no_restore(directory: str, config: RunConfig) -> str | None:
  """Names the settings that change the train state and differ from those of the newest
  checkpoint's run, when it has a run config; None when none differs."""
  try:
    step, saved = read_run_config(directory)
  except Exception:  # pylint: disable=broad-except  # no run config: an older checkpoint
    return None
  now = json.loads(json.dumps(config.to_dict()))  # tuples as lists, as saved
  state_fields = {section: {k: now[section][k] for k in keys}
                  for section, keys in STATE_FIELDS.items()}
  diffs = [f"{section}.{k} = {saved[section][k]!r} (this run: {v!r})"
           for section, fields in state_fields.items() for k, v in fields.items()
           if k in saved.get(section, {}) and saved[section][k] != v]
  if not diffs:
    return None
  return (f"the checkpoints in {directory} (newest: step {step}) hold a different train "
          f"state: they were saved with {'; '.join(diffs)}. Set those values back to resume "
          "(the workdir's config.gin has them), or use a new --workdir for the new settings.")


def changes_since(saved: dict | None, config: RunConfig) -> list[str]:
  """What the optimizer and run length changed since the run config ``saved`` with a
  checkpoint: the learning-rate schedule follows them from the resumed step on."""
  if not saved:
    return []
  now = config.to_dict()
  changes = []
  for section in ("optimizer", "train"):
    for key, value in now[section].items():
      if section == "train" and key != "steps":
        continue
      if key in saved.get(section, {}) and saved[section][key] != value:
        changes.append(f"{section}.{key}: {saved[section][key]!r} -> {value!r}")
  return changes
