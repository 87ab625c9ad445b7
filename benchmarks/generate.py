"""Generation on CPU devices: decode time per token against the context length for P = 1, 2,
4, 8 devices on the sequence axis, and prefill tokens/s, beside transformers on the same CPU.

    python -m benchmarks.generate [--contexts 4096 16384 65536] [--devices 1 2 4 8]
        [--prefill_lengths 1024 4096] [--steps 16] [--json PATH] [--plot PATH]

The model (``MODEL``: 4 layers, 8 KV heads of 32, float32, 3.1M parameters) is small so that
at long contexts its KV cache (8 KiB per token) outweighs its weights (12 MiB), as a real
model's does at a million tokens; it is initialised once and written with ``hf.save_llama``,
and transformers loads the same weights.

* ``decode``: for each context S and each P, the cache filled as a prefill of S tokens leaves
  it (random k and v, the positions of S tokens: a decode step does the same work whatever
  the values), then ``--steps`` decode steps after one untimed step (compilation); the median
  wall time of a step, which includes fetching the new token to the host. The mesh is
  ``data=1 x seq=P`` over the first P devices: with 8 KV heads, P divides them and each device
  keeps 8/P heads of every slot. transformers: ``forward`` of one token with a
  ``DynamicCache`` holding S random positions, the same median; ``transformers_ratio`` = its
  time / ours.
* ``prefill``: ``Generator.prefill`` of one prompt of S tokens (one pass, the model's
  Ulysses attention) after an untimed call, on P = 1 and 8; transformers' forward of the
  prompt with a cache (``use_cache=True``); tokens/s of the median of ``--repeats`` runs.

Beside each measured time, the work per device of the compiled decode step (what 1/P scaling
rests on, whatever the cores): the cache each device holds, and XLA's cost analysis of the
program every device runs (bytes accessed, FLOPs); ``work_ratio_vs_1`` is the bytes accessed
per device at P = 1 over those at P.

Measured on this machine's CPU devices (``--xla_force_host_platform_device_count=8``): the
virtual devices share the machine's cores, so the time per token falls as 1/P only while P
stays within the cores. The JSON records the device count, the cores (``os.cpu_count``) and
PyTorch's threads.
"""

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from ulysses_jax import generate as gen  # noqa: E402
from ulysses_jax.generate import cache as cache_lib  # noqa: E402
from ulysses_jax.hf.weights import load_llama, save_llama  # noqa: E402
from ulysses_jax.mesh import make_mesh  # noqa: E402
from ulysses_jax.models.config import LlamaConfig  # noqa: E402
from ulysses_jax.models.llama import init_llama  # noqa: E402

MODEL = LlamaConfig(vocab_size=1024, hidden_dim=256, num_layers=4, num_heads=8, num_kv_heads=8,
                    head_dim=32, mlp_dim=512, rope_theta=10_000.0, remat_policy="none")
DECODE_COLUMNS = ["context", "devices", "ms_per_token", "transformers_ms", "transformers_ratio",
                  "speedup_vs_1", "cache_mib_per_device", "gib_accessed_per_device",
                  "mflop_per_device", "work_ratio_vs_1"]
PREFILL_COLUMNS = ["context", "devices", "tokens_per_s", "transformers_tokens_per_s",
                   "speed_ratio"]


def filled_generator(model, context: int, steps: int) -> gen.Generator:
  """A generator whose cache holds ``context`` positions of random k and v (one row)."""
  config = model.config
  layout = gen.plan_cache(model.mesh, batch=1, prompt_len=context, max_new_tokens=steps + 2,
                          kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                          dtype=config.dtype, layer_windows=config.layer_windows())
  generator = gen.Generator(model, layout)
  shardings = layout.shardings()
  lengths = jnp.array([context], jnp.int32)

  def fill(key):
    k, v = (jax.random.normal(key, layout.stack_shape(None, values), layout.dtype)
            for key, values in zip(jax.random.split(key), (False, True)))  # one stack: all full
    return gen.KVCache((k,), (v,), (cache_lib.chunk_positions(layout, None, 0, lengths),))

  generator.cache = jax.jit(fill, out_shardings=shardings)(jax.random.PRNGKey(0))
  generator.lengths = jax.device_put(np.array([context], np.int32),
                                     gen.steps.rows_sharding(layout))
  generator.tokens = jax.device_put(np.array([1], np.int32), gen.steps.rows_sharding(layout))
  return generator


def time_decode(model, context: int, steps: int) -> tuple[float, dict]:
  """The median wall time of a decode step (s), and the compiled step's work per device: the
  cache it holds (MiB), XLA's cost analysis of its program (bytes accessed, GiB; MFLOP)."""
  generator = filled_generator(model, context, steps)
  generator.decode()  # compiles
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    generator.decode()  # fetches the token: blocks on the step
    times.append(time.perf_counter() - start)
  return statistics.median(times), decode_work(generator)


def decode_work(generator: gen.Generator) -> dict:
  """The per-device work of ``generator``'s compiled decode step (an SPMD program: every
  device runs the same one over its shards)."""
  compiled = generator.decode_step.lower(generator.params, generator.cache, generator.tokens,
                                         np.int32(0), generator.lengths).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost  # a list of one on older JAX
  return {"cache_mib_per_device": generator.layout.bytes_per_device() / 2**20,
          "gib_accessed_per_device": cost["bytes accessed"] / 2**30,
          "mflop_per_device": cost["flops"] / 1e6}


def time_prefill(model, context: int, repeats: int) -> float:
  config = model.config
  layout = gen.plan_cache(model.mesh, batch=1, prompt_len=context, max_new_tokens=2,
                          kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                          dtype=config.dtype, layer_windows=config.layer_windows())
  generator = gen.Generator(model, layout)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, layout.prompt_len))
  lengths = np.array([context], np.int32)
  generator.prefill(tokens, lengths)  # compiles
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    generator.prefill(tokens, lengths)  # fetches the first token: blocks
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def torch_times(path: str, contexts, prefill_lengths, steps: int, repeats: int) -> dict:
  """transformers' decode step (s) per context and prefill (s) per length."""
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  c = MODEL
  out = {"decode": {}, "prefill": {}}
  with torch.no_grad():
    for context in contexts:
      cache = transformers.DynamicCache(config=model.config)
      for layer in range(c.num_layers):
        kv = [torch.randn(1, c.num_kv_heads, context, c.head_dim) for _ in range(2)]
        cache.update(*kv, layer)
      token = torch.tensor([[1]])
      times = []
      for i in range(steps + 1):
        position = torch.tensor([[context + i]])
        start = time.perf_counter()
        model(token, past_key_values=cache, position_ids=position, use_cache=True)
        times.append(time.perf_counter() - start)
      out["decode"][context] = statistics.median(times[1:])
    for length in prefill_lengths:
      tokens = torch.randint(0, c.vocab_size, (1, length))
      times = []
      for _ in range(repeats + 1):
        start = time.perf_counter()
        model(tokens, use_cache=True)
        times.append(time.perf_counter() - start)
      out["prefill"][length] = statistics.median(times[1:])
  out["torch_threads"] = torch.get_num_threads()
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--prefill_lengths", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--steps", type=int, default=16, help="timed decode steps")
  parser.add_argument("--repeats", type=int, default=3, help="timed prefills")
  parser.add_argument("--no_transformers", action="store_true")
  parser.add_argument("--json", default="")
  parser.add_argument("--plot")
  args = parser.parse_args()
  common.check_plotting(parser, args.plot)
  with tempfile.TemporaryDirectory() as path:
    save_llama(init_llama(MODEL, make_mesh(1, 1, devices=jax.devices()[:1])), path)
    models = {p: load_llama(path, make_mesh(1, p, devices=jax.devices()[:p]),
                            rules=gen.PARAM_RULES) for p in args.devices}
    theirs = (None if args.no_transformers else
              torch_times(path, args.contexts, args.prefill_lengths, args.steps, args.repeats))
  decode = []
  for context in args.contexts:
    for p in args.devices:
      seconds, work = time_decode(models[p], context, args.steps)
      row = {"context": context, "devices": p, "ms_per_token": 1e3 * seconds, **work}
      if theirs:
        row["transformers_ms"] = 1e3 * theirs["decode"][context]
        row["transformers_ratio"] = row["transformers_ms"] / row["ms_per_token"]
      decode.append(row)
      first = next(r for r in decode if r["context"] == context)
      row["speedup_vs_1"] = first["ms_per_token"] / row["ms_per_token"]
      row["work_ratio_vs_1"] = first["gib_accessed_per_device"] / row["gib_accessed_per_device"]
      print(row, flush=True)
  prefill = []
  for context in args.prefill_lengths:
    for p in sorted({min(args.devices), max(args.devices)}):
      row = {"context": context, "devices": p,
             "tokens_per_s": context / time_prefill(models[p], context, args.repeats)}
      if theirs:
        row["transformers_tokens_per_s"] = context / theirs["prefill"][context]
        row["speed_ratio"] = row["tokens_per_s"] / row["transformers_tokens_per_s"]
      prefill.append(row)
      print(row, flush=True)
  print("decode (per token, batch 1)")
  common.print_table(decode, DECODE_COLUMNS)
  print("prefill (one prompt)")
  common.print_table(prefill, PREFILL_COLUMNS)
  extra = dict(prefill=prefill, cpu_count=os.cpu_count(), model=MODEL.to_dict(),
               torch_threads=theirs and theirs["torch_threads"],
               load_average=os.getloadavg())  # other work on the machine while measuring
  if args.json:
    common.write_json(args.json, decode, **extra)
  if args.plot:
    plot(decode, args.plot)


def plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure, axis = plt.subplots(figsize=(6, 4))
  for p in sorted({r["devices"] for r in rows}):
    mine = [r for r in rows if r["devices"] == p]
    axis.plot([r["context"] for r in mine], [r["ms_per_token"] for r in mine], "o-",
              label=f"ulysses_jax, P={p}")
  theirs = {r["context"]: r.get("transformers_ms") for r in rows}
  if all(v is not None for v in theirs.values()):
    axis.plot(list(theirs), list(theirs.values()), "s--", label="transformers (torch CPU)")
  axis.set_xscale("log", base=2)
  axis.set_yscale("log")
  axis.set_xlabel("context (tokens)")
  axis.set_ylabel("decode ms per token")
  axis.legend()
  common.save_figure(figure, "Decode time per token, CPU devices", path)


if __name__ == "__main__":
  main()
