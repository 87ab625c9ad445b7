"""The evaluation's result as text and as a figure: what ``ulysses-evaluate`` prints and
draws."""


def plot(result: dict, path: str):
  """One panel each: loss by position (log x axis), the pass-key heatmap, RULER accuracy by
  task x length (with the mean), whichever the result holds."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  panels = [k for k in ("buckets", "passkey", "ruler") if k in result]
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
  for ax, panel in zip(axes[0], panels):
    if panel == "buckets":
      buckets = [b for b in result["buckets"] if b["loss"] is not None]
      ax.plot([max(b["start"], 0.5) for b in buckets], [b["loss"] for b in buckets], "o-")
      ax.set(xscale="log", xlabel="position in the row (bucket start)", ylabel="loss (nats)",
             title=f"loss by position, mean {result['loss']:.3f}")
      continue
    if panel == "passkey":
      p = result["passkey"]
      grid, rows, columns = p["accuracy"], [f"{d:.0%}" for d in p["depths"]], p["lengths"]
      title, ylabel = f"pass-key accuracy, overall {p['overall']:.2f}", "needle depth"
    else:
      r = result["ruler"]
      rows, columns = [*r["tasks"], "mean"], r["lengths"]
      grid = [[t["by_length"][str(n)]["accuracy"] for n in columns] for t in r["tasks"].values()]
      grid.append([r["mean_by_length"][str(n)] for n in columns])
      title, ylabel = f"RULER accuracy, effective length {r['effective_length'] or 'none'}", "task"
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set(xticks=range(len(columns)), xticklabels=columns, yticks=range(len(rows)),
           yticklabels=rows, xlabel="context length (tokens)", ylabel=ylabel, title=title)
    fig.colorbar(image, ax=ax)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def format_result(result: dict) -> str:
  """The printed report: totals, one line per bucket, the pass-key table, RULER accuracy by
  task x length, the examples' accuracy."""
  lines = [f"{result['model']}: S={result['seq_len']}, mesh {result['mesh']}"]
  if "loss" in result:
    lines += [f"  loss {result['loss']:.4f} (perplexity {result['perplexity']:.2f}) over "
              f"{result['tokens']:,} tokens", "  positions        loss     tokens"]
  for b in result.get("buckets", []):
    loss = "-" if b["loss"] is None else f"{b['loss']:.4f}"
    lines.append(f"  {b['start']:>6}-{b['end']:<8} {loss:>7} {b['tokens']:>10,}")
  if "ruler" in result:
    r = result["ruler"]
    width = max(map(len, r["tasks"]))
    lines.append(f"  RULER accuracy (effective length at {r['threshold']:.1%}: "
                 f"{r['effective_length']})  " + " ".join(f"{n:>8}" for n in r["lengths"]))
    rows = [(name, [t["by_length"][str(n)]["accuracy"] for n in r["lengths"]])
            for name, t in r["tasks"].items()]
    rows.append(("mean", [r["mean_by_length"][str(n)] for n in r["lengths"]]))
    lines += [f"    {name:<{width}}  " + " ".join(f"{a:>8.2f}" for a in accuracies)
              for name, accuracies in rows]
  if "examples" in result:
    e = result["examples"]
    lines.append(f"  examples: accuracy {e['accuracy']:.3f} over {len(e['results'])} "
                 "(exact match under greedy decoding)")
  if "passkey" in result:
    p = result["passkey"]
    lines.append(f"  pass key (accuracy by depth x length, chance {p['chance']:g}; overall "
                 f"{p['overall']:.2f}):  " + " ".join(f"{n:>7}" for n in p["lengths"]))
    lines += [f"    depth {d:>4.0%}  " + " ".join(f"{a:>7.2f}" for a in row)
              for d, row in zip(p["depths"], p["accuracy"])]
  return "\n".join(lines)
