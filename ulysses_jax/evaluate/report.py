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
      scoring = ruler_scoring(r)
      rows, columns, grid = [*r["tasks"], "mean"], r["lengths"], ruler_grid(r, scoring)
      grid = [[float("nan") if v is None else v / 100 for v in row] for row in grid]
      title = (f"RULER ({scoring} score), effective length {r['effective_length'] or 'none'}")
      ylabel = "task"
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
    for scoring in r["scoring"]:
      samples = sorted({c["samples"] for t in r["tasks"].values()
                        for c in t["by_length"].values()})
      lines.append(f"  RULER, {scoring} score (percent +- standard error, "
                   f"{'/'.join(map(str, samples))} samples a cell):  "
                   + " ".join(f"{n:>12}" for n in r["lengths"]))
      stderr = ruler_grid(r, scoring, "_stderr")
      for name, row, errors in zip([*r["tasks"], "mean"], ruler_grid(r, scoring), stderr):
        cells = ["-" if v is None else f"{v:.1f}" + ("" if e is None else f" +-{e:.1f}")
                 for v, e in zip(row, errors)]
        lines.append(f"    {name:<{width}}  " + " ".join(f"{c:>12}" for c in cells))
    lines.append(f"    effective length at {r['threshold']}: {r['effective_length']}"
                 + (f" ({r['effective_length_note']})" if r["effective_length_note"] else ""))
    lines += [f"    skipped {s['task']} at {s['length']}: does not fit"
              for s in r.get("skipped", [])]
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


def ruler_scoring(report: dict) -> str:
  """The report's main scoring: RULER's where answers were generated, else the strict one."""
  return "ruler" if "ruler" in report["scoring"] else "strict"


def ruler_grid(report: dict, scoring: str, suffix: str = "") -> list[list[float | None]]:
  """Rows per task, then the mean, of ``scoring + suffix`` by length (None: not run)."""
  rows = [[t["by_length"].get(str(n), {}).get(scoring + suffix) for n in report["lengths"]]
          for t in report["tasks"].values()]
  return rows + [[report["mean_by_length"][str(n)][scoring + suffix] for n in report["lengths"]]]
