"""Where one decode step's time goes: ``--steps`` steps of a preset under ``jax.profiler``.

    python -m benchmarks.profile_decode --preset llama3.2-1b --prompt 32768 [--batch 1] \\
        [--steps 8] [--json PATH]

The model gets random bf16 weights on one device and a cache of ``--prompt`` slots per row,
allocated but not filled (``generate_gpu.unfilled_generator``: a decode step reads every slot
either way). After two untimed steps, ``--steps`` steps run under the profiler as
``gen.generate`` runs them (``Generator.stream``: each queued before the tokens of the one
before are fetched). Per step (means over the steps, so that they add up): the wall time, the
device's busy time (its kernels, overlaps counted once) and idle time (the span from the first
kernel to the last, less busy: launch gaps, and waits for the host), the kernels launched, and
the busy time by class
(``profile_step.CLASSES``); then the kernels with the most device time. A step far above the
HBM floor (weights + cache bytes over the copy bandwidth) is either idle (launches,
synchronisation: fewer and larger programs help) or busy in kernels that do not stream memory
at its rate (which ones, the table says).

XLA's command buffers stay on (as a user's decode runs): on a GPU a kernel's HLO op may then
read ``command_buffer_N`` and its class fall to "other"; the kernel names still tell.
"""

import argparse
import tempfile
import time

import jax
import numpy as np

from benchmarks import common, generate_gpu, profile_step
from ulysses_jax import generate as gen
from ulysses_jax.mesh import make_mesh
from ulysses_jax.models import llama

COLUMNS = ["class", "ms_per_step", "share_pct", "launches_per_step"]


def profile_decode(generator, steps: int, trace_dir: str) -> dict:
  """Two untimed decode steps of ``generator``, then ``steps`` under the profiler: the device's
  time per step (``profile_step.breakdown`` divided by ``steps``) and the mean wall time per
  step."""
  for _ in range(2):
    generator.decode()
  with jax.profiler.trace(trace_dir):
    start = time.perf_counter()
    for _ in generator.stream(steps):
      pass
    wall = time.perf_counter() - start
  events, mode = profile_step.device_events(profile_step.read_trace(trace_dir))
  args = (generator.params, generator.cache, generator.tokens, np.int32(0),
          generator.lengths)
  hlo = generator.decode_step.lower(*args).compile().as_text()
  result = profile_step.breakdown(events, profile_step.hlo_ops(hlo))
  return {**result, "mode": mode, "events": len(events), "steps": steps,
          "wall_ms_per_step": 1e3 * wall / steps}


def rows_of(result: dict) -> list[dict]:
  """One row per class with its device time per step, then idle, busy and the wall time."""
  steps, wall = result["steps"], result["wall_ms_per_step"]
  rows = [{"class": c, "ms_per_step": result["ms"][c] / steps,
           "share_pct": 100 * result["ms"][c] / steps / wall,
           "launches_per_step": result["launches"].get(c, 0) / steps}
          for c in profile_step.CLASSES if result["launches"].get(c)]
  for name, ms, launches in (("busy (device)", result["busy_ms"], result["events"]),
                             ("idle (device)", result["idle_ms"], None)):
    rows.append({"class": name, "ms_per_step": ms / steps,
                 "share_pct": 100 * ms / steps / wall,
                 "launches_per_step": None if launches is None else launches / steps})
  rows.append({"class": "wall (host)", "ms_per_step": wall, "share_pct": 100.0,
               "launches_per_step": None})
  return rows


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="llama3.2-1b", choices=sorted(llama.PRESETS))
  parser.add_argument("--prompt", type=int, default=32768, help="cache slots per row")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--steps", type=int, default=8, help="profiled decode steps")
  parser.add_argument("--trace-dir", default="",
                      help="keep the profiler's trace here (default: a temporary folder)")
  parser.add_argument("--json", default="")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.prompt < 1 or args.batch < 1:
    parser.error(f"--steps, --prompt and --batch must be >= 1, got {args.steps}, "
                 f"{args.prompt}, {args.batch}")
  device = jax.devices()[0]
  config = llama.preset(args.preset, dtype="bfloat16", param_dtype="bfloat16",
                        remat_policy="none")
  model = llama.init_llama(config, make_mesh(1, 1, devices=[device]), rules=gen.PARAM_RULES)
  generator = generate_gpu.unfilled_generator(model, args.prompt, args.steps + 2, args.batch)
  with tempfile.TemporaryDirectory() as scratch:
    result = profile_decode(generator, args.steps, args.trace_dir or scratch)
  needs = generate_gpu.decode_bytes(config, args.batch, args.prompt)
  print(f"{args.preset}, batch {args.batch}, {args.prompt:,} cache slots per row, "
        f"{device.device_kind}; {args.steps} decode steps; {result['mode']}; reads "
        f"{(needs['weights'] + needs['kv']) / 1e9:.2f} GB a step (weights + cache)")
  rows = rows_of(result)
  common.print_table(rows, COLUMNS)
  print(f"\nthe {profile_step.TOP_KERNELS} kernels with the most device time over "
        f"{args.steps} steps (name, HLO op, class):")
  common.print_table(result["top_kernels"], ["kernel", "hlo_op", "class", "ms", "launches"])
  if args.json:
    common.write_json(args.json, rows, mode=result["mode"], steps=args.steps,
                      top_kernels=result["top_kernels"], read_bytes=needs,
                      config={k: v for k, v in vars(args).items() if k != "json"})
  return result


if __name__ == "__main__":
  main()
