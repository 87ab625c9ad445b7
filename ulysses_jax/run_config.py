"""What one training run is: ``TrainConfig`` and ``RunConfig``, the bundle ``train.train`` takes.

``RunConfig`` groups the five config dataclasses of a run (train, model, data, optimizer,
checkpoint). Python users build it directly; the command lines build it from gin files
(``ulysses_jax.cli.gin_config``). ``RunConfig.to_dict()`` is what every checkpoint carries
(``checkpoint.read_run_config``), enough to rebuild the model without the gin files.
"""

import dataclasses
import importlib.util
from typing import Any, Literal

from ulysses_jax.checkpoint import CheckpointConfig
from ulysses_jax.config_checks import ConfigError, at_least, check_fields
from ulysses_jax.data.pipeline import DataConfig
from ulysses_jax.distributed import PLATFORMS
from ulysses_jax.metrics import WANDB_HINT
from ulysses_jax.models.config import LlamaConfig
from ulysses_jax.optimizer import OptimizerConfig
from ulysses_jax.ruler.tasks import TASKS
from ulysses_jax.train_step import MemoryOptions


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The run: length, logging, mesh, devices, fault handling (gin-configurable).

  steps: optimizer steps in total (a resumed run continues up to it).
  log_every: steps between metrics records (step 1 and the last are always logged).
  eval_every: steps between evaluations on held-out data (0: only after the last step).
  eval_batches: held-out batches per evaluation (fewer if the split is smaller).
  mesh_data, mesh_seq: the ("data", "seq") mesh; mesh_data=-1 takes the remaining devices.
  mesh_ring: > 1 adds a "ring" axis: the hybrid, all-to-all over seq and a K/V ring over
    ring (put seq within a node, ring across nodes).
  seed: parameter initialisation.
  accum_steps: micro-batches per step (gradient accumulation).
  z_loss_weight: weight of the z-loss term.
  max_bad_steps: consecutive non-finite steps that stop training.
  offload_optimizer, offload_params, master_weights: the train state's memory options
    (``train_step.MemoryOptions``, which documents and checks them).
  platform: "" (JAX's default), "cpu", "gpu" (the GPU backend installed: CUDA or ROCm;
    ``distributed.resolve_platform``), "cuda" or "tpu". Asked for a GPU where JAX finds
    none, the run stops before any work.
  cpu_devices: virtual CPU devices per process (0: JAX's default).
  peak_flops: per-device peak FLOP/s for MFU (0: measure at start; see ``metrics``).
  progress_bar: show a tqdm bar on a terminal (else a log line per record).
  compilation_cache: directory of JAX's persistent compilation cache ("" = off): a
    restarted or repeated run loads its compiled programs instead of compiling again.
  init_from: start from trained weights ("" = random init): a Hugging Face checkpoint
    directory or a workdir / checkpoint of ours (``ulysses_jax.hf.init_from``; weights only, a
    fresh optimizer). The model's shapes come from it; a resumed run restores its own
    checkpoints instead and never reads it (``step_builder.resolve(config, workdir)``).
  export_at_end: a directory to write the final weights to as a Hugging Face checkpoint
    (``ulysses_jax.export``) when the run finishes ("" = no export).
  position_eval: at eval steps also log the held-out loss by position in the row, in
    log-spaced buckets (``eval_loss_pos_<start>_<end>``): does the long context help?
  ruler_tasks: RULER tasks (``ulysses_jax.ruler.tasks.TASKS``, comma-separated; "" = none)
    scored at eval steps on ``ruler_samples`` examples of each at S/2 and S tokens, in the
    data's tokenizer: ``ruler_mean``, ``ruler_<task>``, ``ruler_mean_<L>`` in the metrics.
  kernel_check: before the first step, run the attention kernel on a small problem against
    the XLA attention and fall back down the chain if it fails (``ulysses_jax.kernel_check``).
  wandb_project: also log the metrics to this Weights & Biases project ("" = off; the
    ``wandb`` extra; ``WANDB_MODE=offline`` keeps the run on disk).
  """
  steps: int = dataclasses.field(default=1000, metadata=at_least(1))
  log_every: int = dataclasses.field(default=10, metadata=at_least(1))
  eval_every: int = dataclasses.field(default=0, metadata=at_least(0))
  eval_batches: int = dataclasses.field(default=8, metadata=at_least(1))
  mesh_data: int = dataclasses.field(default=-1, metadata=at_least(-1))
  mesh_seq: int = dataclasses.field(default=1, metadata=at_least(1))
  mesh_ring: int = dataclasses.field(default=1, metadata=at_least(1))
  seed: int = 0
  accum_steps: int = dataclasses.field(default=1, metadata=at_least(1))
  z_loss_weight: float = dataclasses.field(default=0.0, metadata=at_least(0))
  max_bad_steps: int = dataclasses.field(default=20, metadata=at_least(1))
  offload_optimizer: bool = False
  offload_params: bool = False
  master_weights: bool = False
  platform: Literal[("",) + PLATFORMS] = ""
  cpu_devices: int = dataclasses.field(default=0, metadata=at_least(0))
  peak_flops: float = dataclasses.field(default=0.0, metadata=at_least(0))
  progress_bar: bool = True
  compilation_cache: str = ""
  init_from: str = ""
  export_at_end: str = ""
  position_eval: bool = False
  ruler_tasks: str = ""
  ruler_samples: int = dataclasses.field(default=4, metadata=at_least(1))
  kernel_check: bool = True
  wandb_project: str = ""

  def __post_init__(self):
    check_fields(self)
    if self.wandb_project and importlib.util.find_spec("wandb") is None:
      raise ConfigError(f"TrainConfig.wandb_project={self.wandb_project!r} needs wandb: "
                        f"{WANDB_HINT}")
    if self.mesh_data == 0:
      raise ConfigError("TrainConfig.mesh_data must be >= 1, or -1 for the devices that "
                        "mesh_seq x mesh_ring leave, got 0")
    self.memory.check_accum_steps(self.accum_steps)
    unknown = [n for n in self.ruler_tasks.split(",") if n and n not in TASKS]
    if unknown:
      raise ConfigError(f"TrainConfig.ruler_tasks names unknown tasks {unknown}; choose from "
                        f"{', '.join(TASKS)} (comma-separated)")

  @property
  def memory(self) -> MemoryOptions:
    return MemoryOptions(offload_optimizer=self.offload_optimizer,
                         offload_params=self.offload_params,
                         master_weights=self.master_weights)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything ``train.train`` needs besides the workdir.

  ``gin``: the operative gin config the command line built it from ("" otherwise), kept with
  the checkpoints and written to the workdir's ``config.gin``.
  """
  train: TrainConfig = TrainConfig()
  model: LlamaConfig = LlamaConfig()
  data: DataConfig = DataConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  gin: str = ""

  def __post_init__(self):
    check_fields(self)

  def to_dict(self) -> dict[str, Any]:
    """JSON-able: each config's fields (nested configs as dicts) and the gin text."""
    return {"model": self.model.to_dict(), "gin": self.gin,
            **{k: dataclasses.asdict(getattr(self, k))
               for k in ("train", "data", "optimizer", "checkpoint")}}
