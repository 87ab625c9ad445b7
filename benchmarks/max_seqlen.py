"""Longest sequence a training step (or the eval forward) fits per memory config; speed there.

    python -m benchmarks.max_seqlen --preset llama3.2-1b \\
        --configs none,full,full+opt,offload+opt+mlp2048,eval
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.max_seqlen \\
        --preset small --budget-gib 0.25 --configs none,full,full+opt,eval

A memory configuration is ``POLICY[+groupK][+opt][+params][+master][+mlpN]``: the per-layer
remat policy (one of ``llama.REMAT_POLICIES``), ``+groupK`` for rematerialised groups of K
layers (``LlamaConfig.remat_group``), ``+opt`` for the optimizer state in pinned host memory,
streamed through the device a layer at a time (``offload_optimizer``), ``+params`` (with
``+opt``) for the layer parameters and their gradients there too (``offload_params``),
``+master`` for float32 master weights of lower-precision parameters (``master_weights``;
with ``--param-dtype bfloat16``), ``+mlpN`` for the MLP tiled into chunks of N tokens per
device. ``eval[+mlpN]`` is not a training step but the evaluation forward pass of
``ulysses_jax.evaluate.PositionEval`` (per-token losses summed by position; no gradients, no
optimizer state, no remat), sequence-parallel on the same mesh: how much longer S evaluation
reaches than training on the same devices.

The search doubles S from ``--start-len`` (default: ``--granularity``; both rounded to
multiples of the granularity and the seq axis) while the step fits, up to ``--max-len``, then
bisects between the last fit (or 0) and the first failure down to one granularity step.
"Fits" means (``--criterion``; for a GPU cluster compiled on any machine, ``--gpu=...``, see
``benchmarks.max_seqlen_gpu``):

* ``run`` (the default on GPU): one real step (forward, backward, AdamW) runs without XLA's
  RESOURCE_EXHAUSTED. Each try runs in a fresh child process, so a failed try leaves nothing
  behind and the allocator's ``peak_bytes_in_use`` (``device.memory_stats()``) is that
  step's alone.
* ``compiled`` (the default elsewhere): the compiled step's per-device memory ``argument +
  output + temp - alias`` bytes (``compiled.memory_analysis()``; optimizer state in host
  memory not counted when the compiler does not report it apart; on CPU, where host and device
  are the same RAM, host temporaries such as offloaded gradients still count) is at most
  ``--budget-gib`` (on GPU by default the allocator's limit). The step is compiled on
  abstract inputs (``ShapeDtypeStruct``), so nothing is allocated or run: on GPU, the way
  to search lengths whose one step takes longer than a benchmark can wait (an 8B model at
  500K tokens).

At the S found, a few timed steps give step time, tokens/s and MFU, when S is at most
``--time-max-tokens`` (default: any on GPU, 4096 elsewhere). MFU formula: see
``benchmarks.train_step``.
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import math
import multiprocessing
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # tries run in children

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.train_step import FORMULA, synthetic_batch  # noqa: E402
from ulysses_jax import evaluate, make_mesh, metrics, sharding, step_builder  # noqa: E402
from ulysses_jax.doctor.timing import time_fn  # noqa: E402
from ulysses_jax.data.pipeline import DataConfig  # noqa: E402
from ulysses_jax.models import llama  # noqa: E402
from ulysses_jax.run_config import RunConfig, TrainConfig  # noqa: E402

GIB = 2**30
EVAL_NOTE = ("eval = the evaluation forward pass (evaluate.PositionEval: no gradients, no "
             "optimizer state); its step is a forward pass, its flops_per_token a third")


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
  """Remat policy and group, optimizer state (and layer parameters) on the host or not,
  float32 master weights or not, MLP tile (0 = untiled); ``evaluate``: the evaluation forward
  pass instead of a training step (remat ``none``, nothing offloaded)."""
  remat: str = "full"
  remat_group: int = 1
  offload_optimizer: bool = False
  offload_params: bool = False
  master_weights: bool = False
  mlp_chunk: int = 0
  evaluate: bool = False

  @property
  def name(self) -> str:
    return "+".join(["eval" if self.evaluate else self.remat] +
                    [f"group{self.remat_group}"] * (self.remat_group > 1) +
                    ["opt"] * self.offload_optimizer + ["params"] * self.offload_params +
                    ["master"] * self.master_weights +
                    [f"mlp{self.mlp_chunk}"] * bool(self.mlp_chunk))



def parse_config(spec: str) -> MemoryConfig:
  """``"full+opt+mlp1024"`` -> ``MemoryConfig("full", offload_optimizer=True,
  mlp_chunk=1024)``; ``"eval+mlp1024"`` -> ``MemoryConfig("none", mlp_chunk=1024,
  evaluate=True)``."""
  remat, *flags = spec.split("+")
  evaluate = remat == "eval"
  config = MemoryConfig(remat="none" if evaluate else remat, evaluate=evaluate)
  for flag in flags:
    if flag == "opt":
      config = dataclasses.replace(config, offload_optimizer=True)
    elif flag == "params":
      config = dataclasses.replace(config, offload_params=True)
    elif flag == "master":
      config = dataclasses.replace(config, master_weights=True)
    elif flag.startswith("group") and flag[5:].isdigit():
      config = dataclasses.replace(config, remat_group=int(flag[5:]))
    elif flag.startswith("mlp") and flag[3:].isdigit():
      config = dataclasses.replace(config, mlp_chunk=int(flag[3:]))
    else:
      raise ValueError(f"unknown flag {flag!r} in memory config {spec!r}: expected "
                       f"POLICY[+groupK][+opt][+params][+master][+mlpN] or eval[+mlpN], "
                       f"e.g. full+opt+mlp1024.")
  if evaluate and config != MemoryConfig("none", mlp_chunk=config.mlp_chunk, evaluate=True):
    raise ValueError(f"{spec!r}: eval is a forward pass (no remat, gradients or optimizer "
                     f"state); only +mlpN goes with it.")
  if config.remat not in llama.REMAT_POLICIES:
    raise ValueError(f"remat policy of {spec!r} must be one of {llama.REMAT_POLICIES} "
                     f"(or eval).")
  if config.offload_params and not config.offload_optimizer:
    raise ValueError(f"{spec!r}: +params needs +opt (offload_params needs offload_optimizer).")
  return config


@dataclasses.dataclass(frozen=True)
class Setup:
  """What every try shares: model preset, dtypes, mesh shape and batch size."""
  preset: str
  dtype: str
  data: int
  seq: int
  batch: int
  loss_chunk: int = 1024
  param_dtype: str = "float32"

  def model_config(self, memory: MemoryConfig) -> llama.LlamaConfig:
    return llama.preset(self.preset, dtype=self.dtype, param_dtype=self.param_dtype,
                        remat_policy=memory.remat, remat_group=memory.remat_group,
                        mlp_chunk=memory.mlp_chunk,
                        loss_chunk=self.loss_chunk)

  def run_config(self, memory: MemoryConfig, seq_len: int) -> RunConfig:
    """The training run of one try (``step_builder`` builds its step)."""
    return RunConfig(
        train=TrainConfig(mesh_data=self.data, mesh_seq=self.seq,
                          offload_optimizer=memory.offload_optimizer,
                          offload_params=memory.offload_params,
                          master_weights=memory.master_weights),
        model=self.model_config(memory), data=DataConfig(seq_len=seq_len, batch_size=self.batch))


def device_bytes(compiled, host_state=()) -> int:
  """Per-device bytes of a compiled step: arguments + outputs + temporaries - aliased.

  ``host_state`` (the step's arguments in pinned host memory, ShapeDtypeStructs) is taken off
  when the compiler counts it with device memory (CPU, where both are the same RAM).
  """
  stats = compiled.memory_analysis()
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes +
           stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  if not stats.host_argument_size_in_bytes:
    total -= sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                 for x in host_state)
  return total


def abstract_params(config: llama.LlamaConfig, mesh):
  """``(graphdef, model state of ShapeDtypeStruct)`` sharded as in training: shapes only."""
  graphdefs = []

  def build():
    graphdef, params = nnx.split(llama.init_llama(config, mesh))
    graphdefs.append(graphdef)
    return params

  params = jax.eval_shape(build)
  return graphdefs[0], jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
      sharding.tree_shardings(params, mesh))


def compile_step(setup: Setup, memory: MemoryConfig, seq_len: int, *, abstract: bool):
  """Compiles the train step at ``seq_len`` (with ``memory.evaluate``, the evaluation forward
  ``PositionEval.step`` on one window of S tokens per row). Returns ``(compiled, state, batch,
  bytes)``, the state a ``TrainState`` (the model state alone for eval); with ``abstract``
  the state and batch are ShapeDtypeStructs."""
  mesh = make_mesh(data=setup.data, seq=setup.seq,
                   devices=jax.devices()[:setup.data * setup.seq])
  config = setup.model_config(memory)
  if memory.evaluate:
    graphdef, state = (abstract_params(config, mesh) if abstract else
                       nnx.split(llama.init_llama(config, mesh)))
    step = evaluate.PositionEval(graphdef).step
  else:
    built = step_builder.build_train_step(setup.run_config(memory, seq_len), mesh)
    step = built.step
    state = built.state if abstract else step_builder.initial_state(built)
  # Eval rows are whole windows, as evaluate's: positions 0..S-1, one segment per row.
  batch_sharding = NamedSharding(mesh, sharding.batch_spec(mesh, seq_len))
  if abstract:
    keys = ("tokens", "labels") + ("positions", "segment_ids") * memory.evaluate
    batch = {k: jax.ShapeDtypeStruct((setup.batch, seq_len), "int32", sharding=batch_sharding)
             for k in keys}
  else:
    batch = jax.device_put(synthetic_batch(setup.batch, seq_len, config.vocab_size,
                                           seq_len if memory.evaluate else 0), batch_sharding)
  compiled = step.lower(state, batch).compile()
  host_state = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                for x in jax.tree.leaves(state) if x.sharding.memory_kind == "pinned_host"]
  return compiled, state, batch, device_bytes(compiled, host_state)


@functools.cache
def compiled_bytes(setup: Setup, memory: MemoryConfig, seq_len: int) -> int:
  """Per-device bytes of the step compiled on abstract inputs (cached: compiling is slow)."""
  return compile_step(setup, memory, seq_len, abstract=True)[3]


def run_steps(setup: Setup, memory: MemoryConfig, seq_len: int, steps: int) -> dict:
  """Compiles and runs ``steps`` timed steps (after 2 warm-up steps) at ``seq_len`` (eval:
  forward passes).

  Returns ``{"fits": False}`` when the device runs out of memory, else ``fits``, ``step_s``,
  ``est_GiB`` (compiled analysis) and ``peak_GiB`` (allocator peak; NaN where unreported).
  """
  try:
    compiled, state, batch, nbytes = compile_step(setup, memory, seq_len, abstract=False)
    holder = {"state": state}

    def one_step():
      if memory.evaluate:  # the forward pass: sums out, the parameters unchanged
        return compiled(holder["state"], batch)
      holder["state"], step_metrics = compiled(holder["state"], batch)
      return step_metrics

    timing = time_fn(one_step, warmup=min(steps, 2), iters=steps)
  except jax.errors.JaxRuntimeError as error:
    if "RESOURCE_EXHAUSTED" not in str(error):
      raise
    return {"fits": False}
  return {"fits": True, "step_s": timing["median_s"], "est_GiB": nbytes / GIB,
          "peak_GiB": metrics.peak_memory_gib() or float("nan")}


def run_in_child(setup: Setup, memory: MemoryConfig, seq_len: int, steps: int) -> dict:
  """``run_steps`` in a fresh process: clean allocator, clean peak, no leftovers of an OOM."""
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
    return pool.submit(run_steps, setup, memory, seq_len, steps).result()


def measure(setup: Setup, memory: MemoryConfig, *, granularity: int, max_len: int,
            start_len: int, criterion: str, budget_gib: float, steps: int,
            time_max_tokens: int, on_gpu: bool, peak_flops: float) -> dict:
  """Searches the longest fitting S for one memory configuration and times a step there."""
  step = math.lcm(granularity, setup.seq)
  if criterion == "run":
    fits = lambda s: run_in_child(setup, memory, s, 1)["fits"]  # noqa: E731
  else:
    fits = lambda s: compiled_bytes(setup, memory, s) <= budget_gib * GIB  # noqa: E731
  best, first_fail = common.search(fits, step, max_len, start_len)
  row = {"config": memory.name, "max_tokens": best, "first_fail": first_fail,
         "est_GiB": float("nan"), "step_s": float("nan"), "tokens_per_s": float("nan"),
         "MFU": float("nan"), "peak_GiB": float("nan")}
  if not best:
    return row
  row["est_GiB"] = compiled_bytes(setup, memory, best) / GIB
  if best <= time_max_tokens:
    timed = (run_in_child if on_gpu else run_steps)(setup, memory, best, steps)
    if timed["fits"]:
      tokens_per_s = setup.batch * best / timed["step_s"]
      flops_per_token = (metrics.flops_per_token(setup.model_config(memory), best) /
                         (3 if memory.evaluate else 1))  # forward: a third of 6*N + 6*L*S*h
      row.update(step_s=timed["step_s"], tokens_per_s=tokens_per_s, peak_GiB=timed["peak_GiB"],
                 MFU=flops_per_token * tokens_per_s / peak_flops)
  return row


def plot(rows: list[dict], path: str, title: str) -> None:
  """Bar charts of max tokens and tokens/s per memory configuration."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure, axes = plt.subplots(1, 2, figsize=(10, 4))
  names = [r["config"] for r in rows]
  axes[0].bar(names, [r["max_tokens"] for r in rows])
  axes[0].set_ylabel("longest sequence (tokens)")
  axes[1].bar(names, [r["tokens_per_s"] for r in rows])
  axes[1].set_ylabel("tokens/s at that length")
  for axis in axes:
    axis.tick_params(axis="x", rotation=30)
  common.save_figure(figure, title, path)


def main(argv=None) -> list[dict]:
  argv = sys.argv[1:] if argv is None else argv
  if any(a.startswith("--gpu") for a in argv):  # compiled for a GPU cluster, on any machine
    from benchmarks import max_seqlen_gpu
    return max_seqlen_gpu.main(argv)
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="small", choices=sorted(llama.PRESETS))
  parser.add_argument("--configs", default="none,full,full+opt",
                      help="comma-separated POLICY[+groupK][+opt][+params][+master][+mlpN], "
                           "or eval[+mlpN] for the evaluation forward pass")
  parser.add_argument("--data", type=int, default=1)
  parser.add_argument("--seq", type=int, default=-1, help="seq axis (default: devices/data)")
  parser.add_argument("--batch", type=int, default=0, help="global batch (default: data axis)")
  parser.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
  parser.add_argument("--param-dtype", default="float32",
                      help="parameters, gradients and Adam moments (bfloat16: no float32 copy)")
  parser.add_argument("--loss-chunk", type=int, default=1024)
  parser.add_argument("--granularity", type=int, default=1024 if on_gpu else 128)
  parser.add_argument("--max-len", type=int, default=2**20)
  parser.add_argument("--start-len", type=int, default=0,
                      help="first length tried (default: --granularity); near the answer, it "
                           "saves compiles of big models")
  parser.add_argument("--criterion", choices=("run", "compiled"),
                      default="run" if on_gpu else "compiled")
  parser.add_argument("--budget-gib", type=float, default=None,
                      help="per-device budget of the compiled criterion (default: the GPU "
                           "allocator's limit, 1 GiB elsewhere)")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--time-max-tokens", type=int, default=2**62 if on_gpu else 4096,
                      help="time the step only up to this S")
  parser.add_argument("--json", default="")
  parser.add_argument("--plot", default="", help="PNG path")
  args = parser.parse_args(argv)
  common.check_plotting(parser, args.plot)

  if args.criterion == "run" and not on_gpu:
    parser.error("--criterion run needs a GPU (off GPU nothing reports running out of memory).")
  if args.budget_gib is None:
    args.budget_gib = jax.devices()[0].memory_stats()["bytes_limit"] / GIB if on_gpu else 1.0
  seq_axis = jax.device_count() // args.data if args.seq == -1 else args.seq
  setup = Setup(args.preset, args.dtype, args.data, seq_axis, args.batch or args.data,
                args.loss_chunk, args.param_dtype)
  peak_flops = metrics.measure_peak_flops(args.dtype)
  rows = [measure(setup, parse_config(spec), granularity=args.granularity,
                  max_len=args.max_len, start_len=args.start_len, criterion=args.criterion,
                  budget_gib=args.budget_gib, steps=args.steps,
                  time_max_tokens=args.time_max_tokens, on_gpu=on_gpu, peak_flops=peak_flops)
          for spec in args.configs.split(",")]
  criterion = ("a real step without RESOURCE_EXHAUSTED" if args.criterion == "run" else
               f"compiled memory analysis <= {args.budget_gib:.3g} GiB per device")
  print(f"{args.preset}, mesh {args.data}x{seq_axis}, batch {setup.batch}, {args.dtype} "
        f"compute, {args.param_dtype} parameters; "
        f"fits = {criterion}")
  print("est = compiled args + out + temp - alias per device; peak = allocator peak (GPU)")
  print(FORMULA)
  notes = {"eval_note": EVAL_NOTE} if any(r["config"].startswith("eval") for r in rows) else {}
  if notes:
    print(EVAL_NOTE)
  common.print_table(rows, list(rows[0]))
  if args.json:
    common.write_json(args.json, rows, setup=dataclasses.asdict(setup), criterion=criterion,
                      formula=FORMULA, **notes)
  if args.plot:
    plot(rows, args.plot, f"{args.preset}: {criterion}")
  return rows


if __name__ == "__main__":
  main()
