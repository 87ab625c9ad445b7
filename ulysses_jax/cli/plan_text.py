"""What ``ulysses-plan`` prints (``ulysses_jax.cli.plan``): the rows as a table, the
recommendation as the trainer's gin settings and the library's calls, its step by term."""

from ulysses_jax.gpus import GB

GIB = 2**30


def on_host_label(layout):
  return "opt+params" if layout.offload_params else "opt" if layout.offload_optimizer else "-"


def precision_label(precision):
  short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[precision.param_dtype]
  return short + ("+master" if precision.master_weights else "")


def format_rows(rows, batch, seq_len):
  header = (f"{'data':>4} {'seq':>4} {'ring':>4} {'remat':>12} {'group':>5} {'chunks':>6} "
            f"{'on host':>10} {'params':>11} {'mlp tile':>8} "
            f"{'mem GiB':>7} {'host GB':>7} {'a2a GB':>7} {'ring GB':>7} {'fsdp GB':>7} "
            f"{'comm s':>7} {'step s':>8} {'tok/s':>9}")
  lines = [header]
  for r in rows:
    lay, mem, step = r["layout"], r["memory"], r["step"]
    comm = step["step_s"] - step["compute_s"]
    lines.append(
        f"{lay.data:>4} {lay.seq:>4} {lay.ring:>4} {lay.remat:>12} {lay.remat_group:>5} "
        f"{lay.attn_head_chunks:>6} {on_host_label(lay):>10} "
        f"{precision_label(r['precision']):>11} {r['mlp_chunk'] or 'none':>8} "
        f"{mem['total'] / GIB:>7.1f} "
        f"{mem['host'] / GB:>7.1f} {step['all_to_all_bytes'] / GB:>7.2f} "
        f"{step['ring_bytes'] / GB:>7.2f} "
        f"{step['fsdp_bytes'] / GB:>7.2f} {comm:>7.3f} {step['step_s']:>8.2f} "
        f"{batch * seq_len / step['step_s']:>9.0f}")
  shown = {precision_label(r["precision"]): r["precision"].trade_off for r in rows}
  lines += [f"  {label}: {trade_off}" for label, trade_off in shown.items()]
  return "\n".join(lines)


def settings(row: dict, args) -> dict:
  """The row as the trainer's gin settings (``{"TrainConfig.mesh_seq": 8, ...}``)."""
  best, precision = row["layout"], row["precision"]
  settings = {
      "TrainConfig.mesh_data": best.data, "TrainConfig.mesh_seq": best.seq,
      "TrainConfig.mesh_ring": best.ring, "TrainConfig.accum_steps": args.accum_steps,
      "TrainConfig.offload_optimizer": best.offload_optimizer,
      "TrainConfig.offload_params": best.offload_params,
      "TrainConfig.master_weights": precision.master_weights,
      "LlamaConfig.remat_policy": best.remat, "LlamaConfig.remat_group": best.remat_group,
      "LlamaConfig.attn_head_chunks": best.attn_head_chunks,
      "LlamaConfig.mlp_chunk": row["mlp_chunk"],
      "LlamaConfig.dtype": args.dtype, "LlamaConfig.param_dtype": precision.param_dtype,
      "DataConfig.seq_len": args.seq_len, "DataConfig.batch_size": args.batch}
  if best.remat != "none" and not best.keep_attention:
    settings["LlamaConfig.remat_keep_attention"] = False
  if args.init_from:
    settings["TrainConfig.init_from"] = args.init_from
  placement = row["step"].get("experts", {}).get("placement")  # plan.moe.in_use
  if placement == "expert" or (placement and getattr(args, "expert_placement", "auto")
                               != "auto"):  # what the step models, where not the default
    settings["LlamaConfig.expert_placement"] = placement
  return settings


def gin_params(settings: dict) -> list[str]:
  """``settings`` as ``--gin_param`` values (``'LlamaConfig.remat_policy="full"'``)."""
  gin_value = lambda v: f'"{v}"' if isinstance(v, str) else v
  return [f"{k}={gin_value(v)}" for k, v in settings.items()]


def recommendation(row: dict, args) -> str:
  """The row as the trainer's ``--gin_param`` settings and as the library's calls."""
  best, precision = row["layout"], row["precision"]
  flags = " \\\n".join(f"  --gin_param='{p}'" for p in gin_params(settings(row, args)))
  start = f"init_from={args.init_from!r}, " if args.init_from else ""
  recomputed = ("(attention's output and log-sum-exp do not fit beside the rest: the backward "
                "recomputes attention's forward, remat_keep_attention=False)\n"
                if best.remat != "none" and not best.keep_attention else "")
  return (f"({precision.trade_off})\n{recomputed}for python -m ulysses_jax.train:\n{flags}\n"
          f"in Python: make_mesh(data={best.data}, seq={best.seq}, ring={best.ring}); "
          f"LlamaConfig(remat_policy={best.remat!r}, remat_group={best.remat_group}, "
          f"remat_keep_attention={best.keep_attention}, "
          f"attn_head_chunks={best.attn_head_chunks}, mlp_chunk={row['mlp_chunk']}, "
          f"param_dtype={precision.param_dtype!r}); TrainConfig({start}"
          f"offload_optimizer={best.offload_optimizer}, offload_params={best.offload_params}, "
          f"master_weights={precision.master_weights}, accum_steps={args.accum_steps})")


def breakdown(row) -> str:
  """The recommendation's step by term: seconds on the step's path, what compute hides of
  each collective, its group and links."""
  lines = [f"predicted step {row['step']['step_s']:,.2f} s per device, by term:"]
  for term in row["step"]["breakdown"]:
    if not term["busy_s"]:
      continue
    line = f"  {term['term']:20} {term['seconds']:12,.3f} s"
    if "domain" in term:
      hidden = (f"{term['hidden_s']:,.3f} hidden by {term['hidden_by']}" if term["hidden_by"]
                else "exposed")
      line += (f"  of {term['busy_s']:,.3f} s busy ({hidden}); {term['moved_bytes'] / GB:,.1f} "
               f"GB moved over {term['axes']} ({term['group']} GPUs) on {term['domain']} at "
               f"{term['bandwidth_gb_s']:.0f} GB/s")
    lines.append(line)
  return "\n".join(lines)
