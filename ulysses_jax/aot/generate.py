"""Generation compiled for GPUs: ``ulysses_jax.generate``'s prefill and decode programs for
compile-only devices, their memory per device, and a prediction of their time.

Nothing runs: the programs are lowered with abstract weights and cache (``ShapeDtypeStruct``s
carrying their shardings) and compiled by XLA's GPU compiler, as ``report.compile_and_report``
does for a train step. Predictions, both lower bounds:

* prefill: ``roofline.predict`` over the compiled program (FLOPs at the dense bf16 peak,
  bytes at HBM bandwidth, collectives at the link's bandwidth, no overlap);
* decode, per token: every byte a decode step reads once at HBM bandwidth, plus its
  collectives at the link's bandwidth: its arguments (the weights and the whole cache on the
  device), less the experts no token chose. Where the step's grouped matmul is the Mosaic
  kernel (``generate.experts.uses_stacked_experts``), it reads the weights of the experts
  that have rows only: a device routing t tokens to k of X experts reads at most min(X, t·k)
  experts per MoE layer (``generate.experts.decode_experts_read``, the planner's formula too)
  and none of a dense layer's share of the stacked experts; with XLA's ``ragged_dot`` every
  expert is counted. A decode step is bound by memory traffic; kernel launches and latencies
  are not counted.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ulysses_jax import generate as gen
from ulysses_jax import sharding
from ulysses_jax.aot import hlo
from ulysses_jax.aot import cost, roofline
from ulysses_jax.aot.devices import gpu_devices, gpu_spec, parse_topology
from ulysses_jax.aot.report import argument_bytes, budget_options
from ulysses_jax.generate import cache as cache_lib
from ulysses_jax.generate import experts, steps
from ulysses_jax.mesh import DATA, make_mesh, sequence_axes
from ulysses_jax.metrics import device_breakdown
from ulysses_jax.models.config import LlamaConfig
from ulysses_jax.models.llama import Llama

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GenerationSetup:
  """What is compiled: ``batch`` prompts of ``prompt_len`` tokens and ``max_new_tokens`` new
  ones, prefilled in chunks of ``chunk_len`` (None: one pass) on a ``mesh_data`` x
  ``mesh_ring`` x ``mesh_seq`` mesh, weights replicated (``gen.PARAM_RULES``) or, with
  ``fsdp_params``, sharded as in training; the decode step's attention as ``decode_backend``
  says (``generate.attention.DECODE_BACKENDS``)."""
  prompt_len: int
  max_new_tokens: int = 128
  batch: int = 1
  chunk_len: int | None = None
  mesh_data: int = -1
  mesh_seq: int = 1
  mesh_ring: int = 1
  fsdp_params: bool = False
  decode_backend: str = "auto"


def abstract_generator(config: LlamaConfig, mesh, setup: GenerationSetup):
  """(``gen.Generator`` over abstract weights, its layout, the abstract cache)."""
  rules = sharding.DEFAULT_RULES if setup.fsdp_params else gen.PARAM_RULES
  graphdef, state = nnx.split(nnx.eval_shape(
      lambda: Llama(config, mesh=mesh, rules=rules, rngs=nnx.Rngs(0))))
  shardings = sharding.tree_shardings(state, mesh, rules)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings)
  layout = gen.plan_cache(mesh, batch=setup.batch, prompt_len=setup.prompt_len,
                          max_new_tokens=setup.max_new_tokens,
                          kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                          dtype=config.dtype, layer_windows=config.layer_windows(),
                          chunk_len=setup.chunk_len)
  layout = dataclasses.replace(layout, decode_backend=setup.decode_backend)
  generator = gen.Generator(nnx.merge(graphdef, params), layout)
  return generator, layout, cache_lib.abstract_cache(layout)


def lower_steps(generator, layout, cache) -> dict:
  """The lowered prefill (one chunk) and decode programs."""
  rows = steps.rows_sharding(layout)
  per_row = lambda dtype, *shape: jax.ShapeDtypeStruct((layout.batch, *shape), dtype,
                                                       sharding=steps.rows_sharding(
                                                           layout, 1 + len(shape)))
  tokens = jax.ShapeDtypeStruct(
      (layout.batch, layout.chunk_len), jnp.int32,
      sharding=NamedSharding(layout.mesh, P(DATA, sequence_axes(layout.mesh))))
  lengths = jax.ShapeDtypeStruct((layout.batch,), jnp.int32, sharding=rows)
  return {
      "prefill": generator.prefill_step.lower(
          generator.params, cache, tokens, np.int32(0), lengths,
          per_row(jnp.float32, generator.config.hidden_dim)),
      "decode": generator.decode_step.lower(generator.params, cache, lengths, np.int32(0),
                                            lengths)}


def unread_expert_bytes(config: LlamaConfig, layout, params) -> int:
  """Bytes per device of the expert weights (gate, up, down and their biases: the arrays
  stacked ``[L, X, ...]`` under ``layers.moe``, the router excluded) that a decode step of
  ``layout`` does not read: of the L·X experts held, all but ``decode_experts_read`` of each
  MoE layer's X (a dense layer's share of the stack is not read). ``params``: the model's
  abstract weights with their shardings."""
  if config.moe is None:
    return 0
  stack = params["layers"]["moe"]
  held = argument_bytes([stack[name] for name in experts.EXPERT_WEIGHTS if name in stack])
  layers, num_experts = config.num_layers, config.moe.num_experts
  read_experts = sum(config.sparse_layers()) * experts.decode_experts_read(config, layout)
  return held * (layers * num_experts - read_experts) // (layers * num_experts)


def _program_report(name, lowered, io_bytes, gpu, nodes, model_flops, num_devices,
                    unread_bytes=0) -> dict:
  start = time.perf_counter()
  compiled = lowered.compile(budget_options(gpu, io_bytes))
  m = compiled.memory_analysis()
  device = device_breakdown(m)
  text = compiled.as_text()
  collectives = hlo.executed_collective_bytes(text)
  ops = cost.operations(text)
  report = {"device_breakdown": device, "device_bytes": sum(device.values()),
            "alias_bytes": m.alias_size_in_bytes,
            "fits": sum(device.values()) <= gpu.budget_bytes,
            "collective_bytes": collectives,
            "flops": sum(op.count * op.flops for op in ops),
            "compile_s": time.perf_counter() - start}
  sent = hlo.executed_collective_bytes(text, sent=True)
  if name == "prefill":
    prediction = roofline.predict(gpu, ops, sent, 0, nodes, model_flops, num_devices)
    report["predicted_s"] = prediction.step_s
    report["predicted_compute_s"] = prediction.compute_s
    report["predicted_collective_s"] = prediction.collective_s
  else:
    report["unread_expert_bytes"] = unread_bytes
    report["bytes_read"] = device["arguments"] - unread_bytes
    report["predicted_s"] = (report["bytes_read"] / gpu.memory_bandwidth
                             + roofline.link_seconds(gpu, sent, nodes))
  return report


def compile_generation(config: LlamaConfig, setup: GenerationSetup, gpu: str = "h100",
                       topology: str = "1x1x8", reserve_gib: float | None = None) -> dict:
  """Compiles generation of ``config`` as ``setup`` says for ``topology`` GPUs of kind
  ``gpu``; returns the report (JSON-ready): the cache per device, and per program
  (``prefill``: one chunk, ``decode``: one token) memory per device, fit, collectives,
  FLOPs, compile time and predicted seconds."""
  spec = gpu_spec(gpu).with_reserve(reserve_gib)
  slices, hosts, _ = parse_topology(topology)
  devices = gpu_devices(gpu, topology)
  mesh = make_mesh(setup.mesh_data, setup.mesh_seq, setup.mesh_ring, devices=devices)
  generator, layout, cache = abstract_generator(config, mesh, setup)
  lowered = lower_steps(generator, layout, cache)
  io_bytes = argument_bytes((generator.params, cache))  # the cache is donated, aliased
  forward_flops = _forward_flops(config, layout)
  stacked = experts.uses_stacked_experts(config, mesh)
  unread = unread_expert_bytes(config, layout, generator.params) if stacked else 0
  report = {"gpu": spec.name, "devices": mesh.size, "mesh": dict(mesh.shape),
            "jax": jax.__version__, "model": config.preset or "from a checkpoint",
            "setup": dataclasses.asdict(setup), "budget_bytes": spec.budget_bytes,
            "cache_bytes_per_device": layout.bytes_per_device(),
            "cache": gen.describe_memory(layout),
            "model_flops_prefill": forward_flops}
  if config.moe is not None:
    report["decode_experts_read"] = _experts_read_note(config, layout, stacked)
  for name, program in lowered.items():
    report[name] = _program_report(name, program, io_bytes, spec, slices * hosts,
                                   forward_flops if name == "prefill" else 0.0, mesh.size,
                                   unread if name == "decode" else 0)
  report["prefill"]["predicted_total_s"] = report["prefill"]["predicted_s"] * layout.chunks
  return report


def _experts_read_note(config: LlamaConfig, layout, stacked: bool) -> str:
  """The decode prediction's assumption about the experts, as the JSON states it."""
  moe = config.moe
  if not stacked:
    return (f"all {moe.num_experts} experts of every layer (the grouped matmul is not the "
            f"Mosaic kernel: XLA's ragged_dot reads every expert)")
  return (f"at most {experts.decode_experts_read(config, layout)} of {moe.num_experts} experts "
          f"per MoE layer: min(X, t*k) for t = {experts.decode_tokens_per_device(layout)} "
          f"tokens per device and k = {moe.experts_per_token} (the Mosaic grouped matmul reads "
          f"only the experts that have rows; distinct choices assumed, an upper bound)")


def _forward_flops(config: LlamaConfig, layout) -> float:
  """Model FLOPs of the prefill, all devices: a third of training's (forward only)."""
  from ulysses_jax.metrics import flops_per_token  # pylint: disable=import-outside-toplevel
  return flops_per_token(config, layout.prompt_len) / 3 * layout.prompt_len * layout.batch


def format_generation_report(r: dict) -> str:
  gib = lambda n: f"{n / GIB:8.2f} GiB"
  lines = [f"{r['gpu']} x {r['devices']}, mesh {r['mesh']}; compiled, not run (no GPU)",
           r["cache"]]
  for name in ("prefill", "decode"):
    p = r[name]
    d = p["device_breakdown"]
    lines += [f"{name}: arguments {gib(d['arguments'])}, temporaries {gib(d['temporaries'])}, "
              f"outputs not aliased {gib(d['outputs'])}, total {gib(p['device_bytes'])} of "
              f"{gib(r['budget_bytes'])} ({'fits' if p['fits'] else 'DOES NOT FIT'}); "
              f"compiled in {p['compile_s']:.0f} s",
              "  collectives " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in
                                          p["collective_bytes"].items() if v)]
  pre, dec = r["prefill"], r["decode"]
  lines += [f"PREDICTED prefill: {pre['predicted_total_s']:.1f} s (roofline: compute "
            f"{pre['predicted_compute_s']:.1f} s + collectives "
            f"{pre['predicted_collective_s']:.2f} s per pass)",
            f"PREDICTED decode: {dec['predicted_s'] * 1e3:.2f} ms per token ("
            f"{dec['bytes_read'] / GIB:.2f} GiB of weights and cache read at HBM bandwidth, "
            f"plus collectives)"]
  if "decode_experts_read" in r:
    lines.append(f"  experts read: {r['decode_experts_read']}")
  return "\n".join(lines)
