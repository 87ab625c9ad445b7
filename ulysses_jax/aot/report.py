"""Compile a train step for GPUs and read off what the GPU compiler decided: memory per device
(on the GPU and on the host), collectives, kernels, FLOPs, and the roofline prediction.

Memory kinds. The compile-only devices of ``get_topology_desc`` expose no memory spaces
(``addressable_memories()`` is empty, ``default_memory()`` is UNIMPLEMENTED), and jaxlib
canonicalises a sharding's ``memory_kind`` against its devices' memory spaces when the
sharding is built (``CheckAndCanonicalizeMemoryKind``), so on these devices
``memory_kind="pinned_host"`` comes back as None: the jitted step's offloaded arguments get
device layouts, ``host_argument_size_in_bytes`` is 0 and the compiler counts the offloaded
state as device arguments. Offload *inside* the program (the remat policies' ``offload_dst``)
is unaffected and shows as host temporaries. So the state the config puts on the host is
counted here by hand (``TrainStep.host_state``, bytes per device) and moved from the device
column to the host column; on a client that does keep the memory kinds nothing is moved.
"""

import re
import time

import jax

from ulysses_jax import hlo
from ulysses_jax.aot import cost, roofline
from ulysses_jax.aot.step import TrainStep, bytes_per_device
from ulysses_jax.aot.targets import Gpu
from ulysses_jax.metrics import flops_per_token

GIB = 2**30
KERNELS = {"triton": "__gpu$xla.gpu.triton", "mosaic": "mosaic_gpu", "cudnn": "__cudnn$",
           "cublas": "__cublas$"}


def _dropped_host_bytes(built: TrainStep) -> int:
  """Bytes per device of the host state whose memory kind the client dropped."""
  dropped = [x for x in jax.tree.leaves(built.host_state)
             if x.sharding.memory_kind != "pinned_host"]
  return bytes_per_device(dropped)


def compile_and_report(built: TrainStep, gpu: Gpu, nodes: int) -> dict:
  """Compiles ``built`` for the devices of its mesh and returns the report (JSON-ready)."""
  start = time.perf_counter()
  compiled = built.step.lower(built.state, built.batch).compile()
  compile_s = time.perf_counter() - start
  text = compiled.as_text()
  m = compiled.memory_analysis()
  moved = _dropped_host_bytes(built)
  device = {"arguments": m.argument_size_in_bytes - moved,
            "outputs": m.output_size_in_bytes - m.alias_size_in_bytes,
            "temporaries": m.temp_size_in_bytes,
            "code": m.generated_code_size_in_bytes}
  host = {"offloaded_state": moved + m.host_argument_size_in_bytes,
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
  prediction = roofline.predict(gpu, ops, collectives, host_bytes, nodes, model_flops,
                                num_devices)
  return {
      "gpu": gpu.name, "devices": num_devices, "mesh": dict(built.mesh.shape),
      "fits": device_bytes <= gpu.memory_bytes,
      "device_bytes": device_bytes, "device_capacity_bytes": gpu.memory_bytes,
      "shortfall_bytes": max(0, device_bytes - gpu.memory_bytes),
      "device_breakdown": device, "host_bytes": host_bytes, "host_breakdown": host,
      "collective_bytes": collectives, "kernels": kernels, "flops": flops,
      "model_flops_per_device": model_flops / num_devices, "compile_s": compile_s,
      "tokens_per_step": built.tokens_per_step,
      "prediction": dict(prediction._asdict(), assumptions=list(roofline.ASSUMPTIONS)),
  }


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
           f"  total           {gib(r['device_bytes'])}  of {gib(r['device_capacity_bytes'])}"
           f"  {'fits' if r['fits'] else 'DOES NOT FIT: short by ' + gib(r['shortfall_bytes'])}",
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
