"""Where does all-to-all stop scaling? The planner's time model (``ulysses_jax.plan``) asked
from 8 to 4,096 GPUs: predicted, not measured, and not compiled (``benchmarks.scaling_compiled``
checks the model's collective bytes against the GPU compiler at 8 to 1,024 devices).

    .venv/bin/python -m benchmarks.scaling --json benchmarks/results/scaling.json \\
        --plot-dir benchmarks/plots

For Llama-3.1-8B and 70B, one sequence per step (batch 1), on two networks:

* ``h100``: H100 nodes of 8 GPUs on NVLink (450 GB/s per direction), one 400 Gb/s
  InfiniBand NIC per GPU (50 GB/s);
* ``gb200-nvl72``: GB200 NVL72 racks, 64 of each rack's 72 GPUs used so that every mesh is a
  power of two (NVLink 900 GB/s across the rack), the same NIC per GPU between racks;

in four sweeps: weak scaling with 131,072 and with 1,048,576 tokens per GPU (the sequence
grows with the GPUs), strong scaling of one 16,777,216-token sequence, and of one
1,048,576-token sequence (down to 256 tokens per GPU, where attention no longer hides the
rest); and four meshes:

* ``hybrid``: ``seq`` inside the NVLink domain (as many as the domain and the query heads
  allow), a ring over the rest (``make_mesh(seq=..., ring=...)``);
* ``ulysses_across``: pure Ulysses over every GPU (seq = GPUs, across domains once there
  are several); impossible past the query heads (32 for 8B, 64 for 70B: the head count caps
  seq);
* ``ring``: pure ring attention (seq = 1);
* ``allgather_kv``: the Llama 3 / Megatron baseline, K and V all-gathered over every GPU.

For each point the planner's search with the mesh pinned picks the knobs (remat, groups, head
chunks, offload, precision, MLP tile) that fit the GPU (71.20 GiB of an H100, 167 of a GB200)
and 256 GB of host memory per GPU and are fastest; where none fits, the row says so and times
the layout that needs the least memory (``fits: false``). Each row (``devices`` GPUs) has the
step by term: attention and the other matmuls, the all-to-all (exposed), the ring's transfers
and what attention hides of them, the all-gather-KV baseline's gathers, FSDP's gathers and
reduce-scatters and what compute hides of them, host transfers; the exposed communication and
its share of the step; and model TFLOP/s per GPU (``metrics.flops_per_token``: 6N +
attention). ``crossovers`` gives, for each scheme, the fewest GPUs at which its exposed
communication (and each collective's exposed part alone) reaches 10 % and 50 % of the step.
The all-to-all scan (rows of sweep ``a2a-scan``) runs pure Ulysses over 8, 16, 32 and 64 GPUs
on sequences of 4K to 16M tokens; ``all_to_all_peaks`` is the largest share of the step the
all-to-all reaches there, and at which length. The assumptions are
``ulysses_jax.plan.step.ASSUMPTIONS``; the model has no latency term, so rows whose messages
are small (a few hundred tokens per GPU) are optimistic. Runs in under a minute on one core.
"""

import argparse
import dataclasses
import functools

from benchmarks import common
from ulysses_jax import plan
from ulysses_jax.metrics import flops_per_token
from ulysses_jax.models.config import preset
from ulysses_jax.plan import search
from ulysses_jax.plan.step import ASSUMPTIONS

MODELS = ("llama3.1-8b", "llama3.1-70b")
# name: (GPU, GPUs per NVLink domain used)
NETWORKS = {"h100": ("h100", 8), "gb200-nvl72": ("gb200", 64)}
# name: (scaling, tokens: per GPU for weak scaling, of the sequence for strong scaling)
SWEEPS = {"weak-128k": ("weak", 131072), "weak-1m": ("weak", 1048576),
          "strong-16m": ("strong", 16777216), "strong-1m": ("strong", 1048576)}
DEVICES = tuple(2**k for k in range(3, 13))  # 8 ... 4096
KINDS = ("hybrid", "ulysses_across", "ring", "allgather_kv")
THRESHOLDS = (0.1, 0.5)
# The collectives whose exposed time counts as exposed communication.
COMM_TERMS = ("all_to_all_s", "ring_exposed_s", "allgather_kv_s", "fsdp_exposed_s")
# The all-to-all alone against the sequence length: pure Ulysses over 8 to 64 GPUs (one, two,
# four and eight H100 nodes; inside one GB200 rack), sequences of 4K to 16M tokens.
SCAN_DEVICES = (8, 16, 32, 64)
SCAN_LENGTHS = tuple(2**k for k in range(12, 25, 2))


def mesh_for(kind: str, devices: int, heads: int, domain: int) -> tuple[tuple, str | None]:
  """``((data, seq, ring), attention)`` of a kind of mesh on ``devices`` GPUs, or ``(None,
  reason)`` where the kind cannot run."""
  if kind == "hybrid":
    seq = 1
    while seq * 2 <= min(domain, heads, devices) and devices % (seq * 2) == 0:
      seq *= 2
    return (1, seq, devices // seq), None
  if kind == "ulysses_across":
    if devices > heads:
      return None, f"seq={devices} exceeds the {heads} query heads"
    return (1, devices, 1), None
  if kind == "ring":
    return (1, 1, devices), None
  return (1, devices, 1), None


@functools.cache
def _model_flops(model_name: str, seq_len: int) -> float:
  return flops_per_token(preset(model_name), seq_len) * seq_len


def _least_memory(model, seq_len, devices, hardware, knobs):
  """The layout needing the least device memory (smallest MLP tile), as a planner row."""
  tile = min(search.MLP_CHUNKS, key=lambda k: k or float("inf"))
  tiled = dataclasses.replace(model, mlp_chunk=tile)
  best = None
  for layout in search.layouts(devices, 1, seq_len=seq_len, remats=search.REMATS,
                               remat_groups=search.REMAT_GROUPS,
                               head_chunks=tuple(k for k in search.HEAD_CHUNKS
                                                 if model.num_kv_heads % k == 0),
                               mesh=knobs.mesh, attention=knobs.attention):
    if model.num_layers % layout.remat_group:
      continue
    for precision in search.PRECISIONS:
      numerics = dict(param_dtype=precision.param_dtype,
                      master_weights=precision.master_weights)
      memory = plan.predict_memory(tiled, layout, batch=1, seq_len=seq_len, **numerics)
      if best is None or memory["total"] < best["memory"]["total"]:
        best = {"layout": layout, "precision": precision, "mlp_chunk": tile, "memory": memory,
                "numerics": numerics}
  best["step"] = plan.predict_step(tiled, best["layout"], batch=1, seq_len=seq_len,
                                   hardware=hardware, **best.pop("numerics"))
  return best


def point(model_name: str, network: str, sweep: str, devices: int, kind: str,
          seq_len: int | None = None) -> dict:
  """One row of the study (see the module docstring); ``seq_len`` for the all-to-all scan."""
  gpu, domain = NETWORKS[network]
  scaling, tokens = SWEEPS.get(sweep, ("scan", seq_len))
  seq_len = tokens * devices if scaling == "weak" else tokens
  config = preset(model_name)
  model = plan.Model.from_config(config)
  row = {"model": model_name, "network": network, "gpu": gpu, "gpus_per_domain": domain,
         "sweep": sweep, "scaling": scaling, "seq_len": seq_len,
         "tokens_per_gpu": seq_len // devices, "devices": devices, "mesh_kind": kind}
  mesh, why_not = mesh_for(kind, devices, config.num_heads, domain)
  if mesh is None:
    return {**row, "possible": False, "why_not": why_not}
  hardware = plan.Hardware.of(gpu, intra_node=domain)
  attention = "allgather_kv" if kind == "allgather_kv" else "ulysses"
  knobs = search.Knobs(mesh=mesh, attention=attention)
  rows = search.plan(model, seq_len=seq_len, devices=devices, hardware=hardware, knobs=knobs)
  best = rows[0] if rows else _least_memory(model, seq_len, devices, hardware, knobs)
  step, lay = best["step"], best["layout"]
  busy = {t["term"]: t["busy_s"] for t in step["breakdown"]}
  exposed = sum(step[name] for name in COMM_TERMS)
  domains = {t["term"]: t["domain"] for t in step["breakdown"] if "domain" in t}
  return {
      **row, "possible": True, "fits": bool(rows),
      "mesh": {"data": lay.data, "seq": lay.seq, "ring": lay.ring},
      "knobs": {"remat": lay.remat, "remat_group": lay.remat_group,
                "attn_head_chunks": lay.attn_head_chunks,
                "offload_optimizer": lay.offload_optimizer,
                "offload_params": lay.offload_params, "mlp_chunk": best["mlp_chunk"],
                "param_dtype": best["precision"].param_dtype,
                "master_weights": best["precision"].master_weights},
      "memory_gib": best["memory"]["total"] / 2**30, "host_gb": best["memory"]["host"] / 1e9,
      "step_s": step["step_s"],
      "terms_s": {"attention": busy["attention"], "matmuls": busy["matmuls"],
                  "all_to_all": step["all_to_all_s"], "ring": busy.get("ring", 0.0),
                  "ring_exposed": step["ring_exposed_s"],
                  "allgather_kv": step["allgather_kv_s"],
                  "fsdp": busy.get("fsdp_all_gather", 0.0)
                  + busy.get("fsdp_reduce_scatter", 0.0),
                  "fsdp_exposed": step["fsdp_exposed_s"],
                  "host": step["offload_exposed_s"] + step["optimizer_transfer_s"]},
      "exposed_comm_s": exposed, "exposed_comm_share": exposed / step["step_s"],
      "shares": {name[:-2]: step[name] / step["step_s"] for name in COMM_TERMS},
      "domains": domains,
      "model_tflops_per_gpu": _model_flops(model_name, seq_len) / step["step_s"] / devices / 1e12,
  }


def crossovers(rows: list[dict]) -> list[dict]:
  """For each model, network, sweep and scheme: the fewest GPUs at which the exposed
  communication, and each collective's exposed part alone, reach each of ``THRESHOLDS`` of
  the step (None: not up to the largest count, or the scheme cannot run there)."""
  found = []
  for key in sorted({(r["model"], r["network"], r["sweep"], r["mesh_kind"]) for r in rows
                     if r["scaling"] != "scan"}):
    series = sorted((r for r in rows if (r["model"], r["network"], r["sweep"],
                                         r["mesh_kind"]) == key and r["possible"]),
                    key=lambda r: r["devices"])
    entry = dict(zip(("model", "network", "sweep", "mesh_kind"), key))
    for threshold in THRESHOLDS:
      entry[f"devices_at_{threshold:.0%}"] = next(
          (r["devices"] for r in series if r["exposed_comm_share"] >= threshold), None)
    entry["largest_possible"] = series[-1]["devices"] if series else None
    entry["by_term"] = {
        term: {f"devices_at_{x:.0%}": next((r["devices"] for r in series
                                            if r["shares"][term] >= x), None)
               for x in THRESHOLDS}
        for term in (name[:-2] for name in COMM_TERMS)}
    found.append(entry)
  return found


def all_to_all_peaks(rows: list[dict]) -> list[dict]:
  """For each model, network and GPU count of the all-to-all scan: the largest share of the
  step the all-to-all takes, and at which sequence length."""
  peaks = []
  for key in sorted({(r["model"], r["network"], r["devices"]) for r in rows
                     if r["scaling"] == "scan" and r["possible"]}):
    series = [r for r in rows if r["scaling"] == "scan" and r["possible"]
              and (r["model"], r["network"], r["devices"]) == key]
    top = max(series, key=lambda r: r["shares"]["all_to_all"])
    peaks.append({"model": key[0], "network": key[1], "devices": key[2],
                  "all_to_all_domain": top["domains"].get("all_to_all"),
                  "peak_share": top["shares"]["all_to_all"], "at_seq_len": top["seq_len"]})
  return peaks


def study(models=MODELS, networks=tuple(NETWORKS), sweeps=tuple(SWEEPS), devices=DEVICES,
          kinds=KINDS) -> list[dict]:
  """The sweeps' rows, then the all-to-all scan's (sweep ``a2a-scan``)."""
  return ([point(m, n, s, d, k) for m in models for n in networks for s in sweeps
           for d in devices for k in kinds]
          + [point(m, n, "a2a-scan", d, "ulysses_across", seq_len=s) for m in models
             for n in networks for d in SCAN_DEVICES for s in SCAN_LENGTHS])


COLUMNS = ["model", "network", "sweep", "devices", "mesh_kind", "mesh", "fits", "step_s",
           "exposed_comm_share", "model_tflops_per_gpu"]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--networks", default=",".join(NETWORKS))
  parser.add_argument("--sweeps", default=",".join(SWEEPS))
  parser.add_argument("--devices", default=",".join(map(str, DEVICES)))
  parser.add_argument("--json", default="", help="write the rows here (nothing without it)")
  parser.add_argument("--plot-dir", default="", help="folder for the PNGs (needs matplotlib)")
  args = parser.parse_args(argv)
  common.check_plotting(parser, args.plot_dir)
  rows = study(args.models.split(","), args.networks.split(","), args.sweeps.split(","),
               tuple(int(d) for d in args.devices.split(",")))
  shown = [{**r, "mesh": "x".join(str(v) for v in r["mesh"].values())} for r in rows
           if r["possible"] and r["scaling"] != "scan"]
  print("Predicted by ulysses_jax.plan (not measured, not compiled): one sequence per step")
  common.print_table(shown, COLUMNS)
  found, peaks = crossovers(rows), all_to_all_peaks(rows)
  print("\nFewest GPUs at which exposed communication reaches 10 % / 50 % of the step")
  common.print_table(found, [c for c in found[0] if c != "by_term"])
  print("\nThe all-to-all's largest share of the step, pure Ulysses, sequences of 4K to 16M")
  common.print_table(peaks, list(peaks[0]))
  if args.json:
    common.write_json(args.json, rows, crossovers=found, all_to_all_peaks=peaks,
                      assumptions=list(ASSUMPTIONS),
                      networks={k: {"gpu": g, "gpus_per_domain": d}
                                for k, (g, d) in NETWORKS.items()})
  if args.plot_dir:
    from benchmarks import scaling_plots  # pylint: disable=import-outside-toplevel
    scaling_plots.plot_all(rows, found, args.plot_dir)
  return rows


if __name__ == "__main__":
  main()
