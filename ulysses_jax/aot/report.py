"""Compile a train step for GPUs and read off what the GPU compiler decided: memory per device
(on the GPU and on the host), collectives, kernels, FLOPs, and the roofline prediction.

Memory kinds. The compile-only devices of ``get_topology_desc`` expose no memory spaces, and
jaxlib drops a sharding's ``memory_kind`` when the sharding is built on such devices (it
checks the kind against the devices' memory spaces), so a step built with plain
``NamedSharding(mesh, spec, memory_kind="pinned_host")`` would be compiled with its offloaded
state on the device and its in-program host copies gone. ``sharding.in_memory`` builds
those shardings on the mesh's abstract mesh, which keeps the kind: the compiled program has
the host arguments, copies and outputs a real GPU would run, and ``memory_analysis()``
counts them where they live (``host_argument_size_in_bytes``, host temporaries).
"""

import math
import re
import time

import jax

from ulysses_jax.aot import hlo
from ulysses_jax.aot import cost, roofline
from ulysses_jax.aot.devices import gpu_devices, gpu_spec, parse_topology
from ulysses_jax.gpus import Gpu
from ulysses_jax.metrics import device_breakdown, flops_per_token
from ulysses_jax.run_config import RunConfig
from ulysses_jax.step_builder import TrainStep, build_train_step, run_mesh
from ulysses_jax.xla_log import xla_warnings_explained

GIB = 2**30
# XLA's GPU scheduler and rematerialisation trade time for memory only when their own estimate
# of the program's peak exceeds a limit: xla_gpu_memory_limit_slop_factor percent of the GPU's
# memory (95 by default). A step far below the capacity is compiled as is, with buffers XLA
# could do without; these options set the limit to a tenth of the memory, so the compile shows
# the footprint XLA reaches when memory is tight, as it is near the capacity (Llama-3.1-8B,
# 4x1x8, 256K tokens per GPU: 24.63 GiB as is, 20.57 under pressure; 1M tokens per GPU: 89.16
# GiB compiled for an H200, 76.64 for an H100 and under pressure). Not always smaller: take the
# smaller of the two (compile_and_report(..., under_pressure=True)).
UNDER_PRESSURE = {"xla_gpu_memory_limit_slop_factor": 10}
UNDER_PRESSURE_XLA_FLAGS = " ".join(f"--{k}={v}" for k, v in UNDER_PRESSURE.items())
# That limit is (base - io) * slop / 100 (GetSchedulerMemoryLimit, xla/service/gpu/
# gpu_compiler.cc): io the program's argument and output bytes (aliased ones once, host ones
# included), base the memory JAX's client holds for XLA (its allocator's limit:
# XLA_CLIENT_MEM_FRACTION of the GPU, which the trainer sets to the budget) or, on compile-only
# devices, which have no allocator, 80 % of the GPU's memory.
_DEFAULT_SLOP = 95
_COMPILE_ONLY_BASE = 0.8


def budget_options(gpu: Gpu, io_bytes: int) -> dict:
  """Compiler options that give a compile for compile-only devices the memory limit XLA has
  in a run whose client holds ``gpu.budget_bytes``: rematerialisation and scheduling then aim
  at the budget, as on the GPU. ``io_bytes``: the step's argument and unaliased output bytes
  per device."""
  base = int(gpu.memory_bytes * _COMPILE_ONLY_BASE)
  if base == io_bytes:
    return {}
  slop = round(_DEFAULT_SLOP * (gpu.budget_bytes - io_bytes) / (base - io_bytes))
  return {"xla_gpu_memory_limit_slop_factor": max(-2**31, min(2**31 - 1, slop))}


def argument_bytes(tree) -> int:
  """Bytes per device of a tree of sharded ``ShapeDtypeStruct``s (device and host alike)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


KERNELS = {"triton": "__gpu$xla.gpu.triton", "mosaic": "mosaic_gpu", "cudnn": "__cudnn$",
           "cublas": "__cublas$"}


def compile_and_report(built: TrainStep, gpu: Gpu, nodes: int,
                       under_pressure: bool = False) -> dict:
  """Compiles ``built`` for the devices of its mesh and returns the report (JSON-ready). With
  ``under_pressure`` the same lowering is compiled once more with ``UNDER_PRESSURE``, and the
  report adds that compile's ``device_bytes_under_pressure`` and ``least_device_bytes`` (the
  smaller of the two: the footprint ``ulysses_jax.plan`` predicts)."""
  start = time.perf_counter()
  lowered = built.step.lower(built.state, built.batch)
  # The state is donated and comes back aliased: the arguments are the step's io.
  options = budget_options(gpu, argument_bytes((built.state, built.batch)))
  with xla_warnings_explained():
    compiled = lowered.compile(options)
  report = describe(compiled, built, gpu, nodes, compile_s=time.perf_counter() - start)
  report["compiler_options"] = options
  if under_pressure:
    with xla_warnings_explained(explain=False):  # the limit is low on purpose here
      pressed = sum(device_breakdown(lowered.compile(UNDER_PRESSURE).memory_analysis()).values())
    report.update(device_bytes_under_pressure=pressed,
                  least_device_bytes=min(report["device_bytes"], pressed))
  return report


def describe(compiled, built: TrainStep, gpu: Gpu, nodes: int, compile_s: float = 0.0) -> dict:
  """The report of ``built``'s step as ``compiled`` for GPUs of kind ``gpu`` (see
  ``compile_and_report``); ``python -m ulysses_jax.doctor`` gives it a step compiled for the
  GPUs it runs on."""
  text = compiled.as_text()
  m = compiled.memory_analysis()
  device = device_breakdown(m)
  host = {"offloaded_state": m.host_argument_size_in_bytes,
          "temporaries": m.host_temp_size_in_bytes,
          "outputs": m.host_output_size_in_bytes - m.host_alias_size_in_bytes}
  device_bytes, host_bytes = sum(device.values()), sum(host.values())
  collectives = hlo.executed_collective_bytes(text)
  kernels = {k: len(re.findall(r'custom_call_target="' + re.escape(v), text))
             for k, v in KERNELS.items()}
  ops = cost.operations(text)
  flops = sum(op.count * op.flops for op in ops)
  num_devices = built.mesh.size
  model_flops = flops_per_token(built.model_config, built.seq_len) * built.tokens_per_step
  prediction = roofline.predict(gpu, ops, hlo.executed_collective_bytes(text, sent=True),
                                host_bytes, nodes, model_flops, num_devices)
  return {
      "gpu": gpu.name, "devices": num_devices, "mesh": dict(built.mesh.shape),
      "fits": device_bytes <= gpu.budget_bytes,
      "device_bytes": device_bytes, "device_capacity_bytes": gpu.memory_bytes,
      "reserve_bytes": gpu.runtime_reserve_bytes, "budget_bytes": gpu.budget_bytes,
      "shortfall_bytes": max(0, device_bytes - gpu.budget_bytes),
      "device_breakdown": device, "host_bytes": host_bytes, "host_breakdown": host,
      "collective_bytes": collectives, "kernels": kernels, "flops": flops,
      "model_flops_per_device": model_flops / num_devices, "compile_s": compile_s,
      "tokens_per_step": built.tokens_per_step,
      "prediction": dict(prediction._asdict(), assumptions=list(roofline.ASSUMPTIONS)),
  }


def compile_config(config: RunConfig, gpu: str, topology: str, under_pressure: bool = False,
                   reserve_gib: float | None = None) -> dict:
  """The report of ``config``'s train step compiled for ``topology`` GPUs of kind ``gpu``
  with a runtime reserve of ``reserve_gib`` (default: the GPU table's): what ``python -m
  ulysses_jax.aot`` prints (``under_pressure`` as in ``compile_and_report``). Raises
  ``AotError`` / ``ValueError`` for bad input before compiling."""
  spec = gpu_spec(gpu).with_reserve(reserve_gib)
  slices, hosts, _ = parse_topology(topology)
  built = build_train_step(config, run_mesh(config.train, gpu_devices(gpu, topology)))
  return compile_and_report(built, spec, nodes=slices * hosts, under_pressure=under_pressure)


def format_report(r: dict) -> str:
  """The table the command line prints."""
  gib = lambda n: f"{n / GIB:9.2f} GiB"
  d, h, p = r["device_breakdown"], r["host_breakdown"], r["prediction"]
  lines = [f"{r['gpu']} x {r['devices']}, mesh {r['mesh']}, {r['tokens_per_step']:,} tokens "
           f"per step; compiled in {r['compile_s']:.0f} s (no GPU; not run, not autotuned)",
           "", "per device, on the GPU",
           f"  arguments       {gib(d['arguments'])}  (state kept on the device, batch)",
           f"  outputs         {gib(d['outputs'])}  (not aliased to the donated state)",
           f"  temporaries     {gib(d['temporaries'])}",
           f"  total           {gib(r['device_bytes'])}  of {gib(r['budget_bytes'])}"
           f"  {'fits' if r['fits'] else 'DOES NOT FIT: short by ' + gib(r['shortfall_bytes'])}",
           f"  budget          {gib(r['budget_bytes'])}  = {gib(r['device_capacity_bytes'])} "
           f"less {r['reserve_bytes'] / GIB:.2f} GiB for the CUDA context, libraries and NCCL",
           "per device, on the host",
           f"  offloaded state {gib(h['offloaded_state'])}",
           f"  temporaries     {gib(h['temporaries'] + h['outputs'])}  (offloaded activations)",
           f"  total           {gib(r['host_bytes'])}",
           "collectives per device per step"]
  lines += [f"  {kind:18s}{gib(n)}" for kind, n in r["collective_bytes"].items() if n]
  lines += ["kernels (custom calls in the program)",
            "  " + ", ".join(f"{k} {n}" for k, n in r["kernels"].items()),
            f"FLOPs per device per step  {r['flops']:.3e} compiled, "
            f"{r['model_flops_per_device']:.3e} model (6N + attention)",
            "PREDICTION (roofline, a bound: see assumptions)",
            f"  step time       {p['step_s']:9.3f} s  = compute {p['compute_s']:.3f} + "
            f"collectives {p['collective_s']:.3f} + host transfers {p['host_s']:.3f}",
            f"  MFU             {p['mfu']:9.1%}",
            "  assumptions:"]
  lines += [f"    - {a}" for a in p["assumptions"]]
  return "\n".join(lines)
