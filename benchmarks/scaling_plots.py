"""The scaling study's figures (``benchmarks.scaling --plot-dir DIR``; needs matplotlib):

* ``scaling_breakdown_<sweep>.png``: the predicted step by term against the GPUs, one panel
  per model and network (rows) and scheme (columns);
* ``scaling_exposed.png``: the share of the step spent in exposed communication, each scheme
  a line, one panel per model and network (rows) and sweep (columns), 10 % and 50 % dashed;
* ``scaling_crossover.png``: where each scheme's exposed communication passes 10 % (open
  marker) and 50 % (filled) of the step;
* ``scaling_a2a_scan.png``: the all-to-all's share of the step against the sequence length,
  pure Ulysses over 8 to 64 GPUs.
"""

import os

from benchmarks.common import save_figure

TERMS = {"attention": "attention", "matmuls": "other matmuls", "all_to_all": "all-to-all",
         "ring_exposed": "ring (exposed)", "allgather_kv": "all-gather KV",
         "fsdp_exposed": "FSDP (exposed)", "host": "host transfers"}


def _pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def _series(rows, **match):
  chosen = [r for r in rows if r["possible"] and all(r[k] == v for k, v in match.items())]
  return sorted(chosen, key=lambda r: r["devices"])


def _keys(rows, *names):
  return sorted({tuple(r[n] for n in names) for r in rows if r["scaling"] != "scan"})


def _grid(rows, column_key, height):
  """A figure of one panel per (model, network) row and ``column_key`` value: the figure and
  ``((model, network), column, ax)`` for each panel."""
  panels, columns = _keys(rows, "model", "network"), _keys(rows, column_key)
  fig, axes = _pyplot().subplots(len(panels), len(columns), squeeze=False,
                                 figsize=(4.2 * len(columns), height * len(panels)))
  cells = [(panel, column, ax) for panel, row_axes in zip(panels, axes)
           for (column,), ax in zip(columns, row_axes)]
  return fig, cells


def breakdown(rows, sweep, path):
  fig, cells = _grid(rows, "mesh_kind", 3.4)
  for (model, network), kind, ax in cells:
    series = _series(rows, model=model, network=network, sweep=sweep, mesh_kind=kind)
    for i, (term, label) in enumerate(TERMS.items()):
      points = [(r["devices"], r["terms_s"][term]) for r in series if r["terms_s"][term] > 0]
      if points:
        ax.plot(*zip(*points), "o-", ms=3, color=f"C{i}", label=label)
    ax.set(xscale="log", yscale="log", title=f"{model}, {network}\n{kind}",
           xlabel="GPUs", ylabel="seconds per step")
    ax.legend(fontsize=6)
  save_figure(fig, f"Predicted step by term, {sweep} (ulysses_jax.plan; not measured)", path)


def exposed(rows, path):
  fig, cells = _grid(rows, "sweep", 3.2)
  for (model, network), sweep, ax in cells:
    for i, (kind,) in enumerate(_keys(rows, "mesh_kind")):
      series = _series(rows, model=model, network=network, sweep=sweep, mesh_kind=kind)
      ax.plot([r["devices"] for r in series], [r["exposed_comm_share"] for r in series],
              "o-", ms=3, color=f"C{i}", label=kind)
    for level in (0.1, 0.5):
      ax.axhline(level, ls="--", color="gray", lw=0.8)
    ax.set(xscale="log", ylim=(0, 1), title=f"{model}, {network}, {sweep}", xlabel="GPUs",
           ylabel="exposed communication / step")
    ax.legend(fontsize=6)
  save_figure(fig, "Share of the step in exposed communication (predicted)", path)


def crossover(found, path):
  plt = _pyplot()
  models = sorted({f["model"] for f in found})
  fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 6), squeeze=False)
  kinds = sorted({f["mesh_kind"] for f in found})
  for model, ax in zip(models, axes[0]):
    cases = sorted({(f["network"], f["sweep"]) for f in found if f["model"] == model})
    for i, kind in enumerate(kinds):
      for y, case in enumerate(cases):
        entry = next(f for f in found if (f["model"], f["network"], f["sweep"],
                                          f["mesh_kind"]) == (model, *case, kind))
        offset = y + (i - len(kinds) / 2) * 0.12
        for key, fill in (("devices_at_10%", "none"), ("devices_at_50%", f"C{i}")):
          if entry[key]:
            ax.plot(entry[key], offset, "o", mfc=fill, color=f"C{i}")
      ax.plot([], [], "o", color=f"C{i}", label=kind)  # one legend entry per scheme
    ax.set(xscale="log", xlim=(6, 6000), yticks=range(len(cases)),
           yticklabels=[f"{n}\n{s}" for n, s in cases], xlabel="GPUs",
           title=f"{model}\nexposed communication: 10 % (open), 50 % (filled)")
    ax.legend(fontsize=7)
  save_figure(fig, "Crossovers (predicted; no marker: not up to 4,096 GPUs)", path)


def a2a_scan(rows, path):
  plt = _pyplot()
  scan = [r for r in rows if r["scaling"] == "scan" and r["possible"]]
  panels = sorted({(r["model"], r["network"]) for r in scan})
  fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
  for (model, network), ax in zip(panels, axes[0]):
    for i, devices in enumerate(sorted({r["devices"] for r in scan})):
      series = sorted((r for r in scan if (r["model"], r["network"], r["devices"])
                       == (model, network, devices)), key=lambda r: r["seq_len"])
      if series:
        ax.plot([r["seq_len"] for r in series], [r["shares"]["all_to_all"] for r in series],
                "o-", ms=3, color=f"C{i}", label=f"seq={devices}")
    ax.set(xscale="log", title=f"{model}, {network}", xlabel="sequence length",
           ylabel="all-to-all / step")
    ax.legend(fontsize=7)
  save_figure(fig, "The all-to-all's share of the step, pure Ulysses (predicted)", path)


def plot_all(rows, found, folder):
  for (sweep,) in _keys(rows, "sweep"):
    breakdown(rows, sweep, os.path.join(folder, f"scaling_breakdown_{sweep}.png"))
  exposed(rows, os.path.join(folder, "scaling_exposed.png"))
  crossover(found, os.path.join(folder, "scaling_crossover.png"))
  a2a_scan(rows, os.path.join(folder, "scaling_a2a_scan.png"))
