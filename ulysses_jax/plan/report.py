"""What the planner says about its rows, as JSON and in words: a row's mesh, knobs, memory and
step time by term (``describe``), the kind of its mesh (``mesh_kind``), and why the
recommendation puts its axes where it does (``placement``)."""

from ulysses_jax.plan.hardware import NETWORK, Hardware, group_links
from ulysses_jax.plan.model import Layout

GIB = 2**30
# A mesh's kind: where its all-to-all and its ring run.
MESH_KINDS = {
    "data": "no sequence sharding (data parallel only)",
    "ulysses": "Ulysses inside one NVLink domain",
    "hybrid": "Ulysses inside NVLink domains, a ring over the rest",
    "ulysses_across": "Ulysses across NVLink domains",
    "ring": "ring attention alone",
    "allgather_kv": "all-gather KV (Llama 3 / Megatron context parallelism)",
}


def mesh_kind(layout: Layout, hardware: Hardware) -> str:
  """One of ``MESH_KINDS`` for ``layout`` on ``hardware``'s NVLink domains."""
  if layout.attention == "allgather_kv":
    return "allgather_kv"
  devices = layout.data * layout.seq * layout.ring
  if layout.seq > 1 and group_links(hardware, layout.seq, 1, devices).domain == NETWORK:
    return "ulysses_across"
  if layout.ring > 1:
    return "hybrid" if layout.seq > 1 else "ring"
  return "ulysses" if layout.seq > 1 else "data"


def describe(row: dict, hardware: Hardware, tokens_per_step: int) -> dict:
  """A planner row (``search.plan``'s) as JSON: mesh and its kind, knobs, memory (bytes by
  term), step seconds by term with each collective's group, domain and bandwidth."""
  lay, precision, step = row["layout"], row["precision"], row["step"]
  devices = lay.data * lay.seq * lay.ring
  axes = {"seq": group_links(hardware, lay.seq, 1, devices),
          "ring": group_links(hardware, lay.ring, lay.seq, devices),
          "fsdp": group_links(hardware, devices, 1, devices)}
  return {
      "mesh": {"data": lay.data, "seq": lay.seq, "ring": lay.ring},
      "mesh_kind": mesh_kind(lay, hardware), "attention": lay.attention,
      "axes": {name: {"devices": g.width, "domain": g.domain,
                      "bandwidth_gb_s": g.bandwidth() / 1e9} for name, g in axes.items()},
      "knobs": {"remat": lay.remat, "remat_group": lay.remat_group,
                "remat_keep_attention": lay.keep_attention,
                "attn_head_chunks": lay.attn_head_chunks,
                "offload_optimizer": lay.offload_optimizer,
                "offload_params": lay.offload_params, "mlp_chunk": row["mlp_chunk"],
                "param_dtype": precision.param_dtype,
                "master_weights": precision.master_weights, "numerics": precision.trade_off},
      "memory": {**{k: float(v) for k, v in row["memory"].items()},
                 "total_gib": row["memory"]["total"] / GIB},
      "step_s": step["step_s"], "tokens_per_s": tokens_per_step / step["step_s"],
      "terms_s": {k: v for k, v in step.items() if k.endswith("_s") and k != "step_s"},
      "bytes_per_device": {k: v for k, v in step.items() if k.endswith("_bytes")},
      "breakdown": step["breakdown"],
  }


def _busy(row, name):
  return next((t for t in row["step"]["breakdown"] if t["term"] == name), None)


def _axis_words(row, hardware):
  """How the recommendation's all-to-all and ring run, in words."""
  lay = row["layout"]
  words = []
  a2a, ring = _busy(row, "all_to_all"), _busy(row, "ring")
  if a2a:
    where = (f"inside one NVLink domain of {hardware.intra_node} GPUs" if a2a["domain"] != NETWORK
             else f"across NVLink domains of {hardware.intra_node} GPUs, partly on the network")
    words.append(f"seq={lay.seq} keeps the all-to-all {where} ({a2a['bandwidth_gb_s']:.0f} GB/s "
                 f"per GPU, {a2a['busy_s']:.3g} s per step, exposed)")
  if ring:
    share = ring["hidden_s"] / ring["busy_s"] if ring["busy_s"] else 1.0
    words.append(f"the ring over {lay.ring} runs on {_on(ring['domain'])} "
                 f"({ring['bandwidth_gb_s']:.0f} "
                 f"GB/s per GPU, {ring['busy_s']:.3g} s per step) and attention hides "
                 f"{share:.0%} of it")
  if lay.attention == "allgather_kv":
    words.append(f"K and V are all-gathered over seq={lay.seq}")
  return words or [f"no sequence sharding: {lay.data} data-parallel replicas"]


def placement(rows: list[dict], hardware: Hardware) -> dict:
  """Why the recommendation (``rows[0]``) places ``seq`` and ``ring`` as it does: how its
  all-to-all and ring run, and each other kind of mesh's fastest feasible row beside it
  (``rows[1:]`` are fastest first)."""
  best = rows[0]
  kind = mesh_kind(best["layout"], hardware)
  alternatives = []
  for row in rows[1:]:
    other = mesh_kind(row["layout"], hardware)
    if other == kind or other in {a["mesh_kind"] for a in alternatives}:
      continue
    step = row["step"]
    alternatives.append({
        "mesh_kind": other, "mesh": "x".join(map(str, row["layout"].mesh)),
        "step_s": step["step_s"], "slower_s": step["step_s"] - best["step"]["step_s"],
        "slower": step["step_s"] / best["step"]["step_s"] - 1,
        "all_to_all_s": step["all_to_all_s"], "ring_exposed_s": step["ring_exposed_s"],
        "allgather_kv_s": step["allgather_kv_s"], "fsdp_exposed_s": step["fsdp_exposed_s"]})
  mesh = "x".join(map(str, best["layout"].mesh))
  text = [f"mesh {mesh} ({MESH_KINDS[kind]}): " + "; ".join(_axis_words(best, hardware)) + "."]
  attention = _busy(best, "attention")["seconds"] / best["step"]["step_s"]
  if attention > 0.9:
    text.append(f"At this length attention is {attention:.0%} of the step, so where seq and "
                f"ring run changes it little.")
  for a in alternatives:
    comm = {name: a[f"{name}_s"] for name in ("all_to_all", "ring_exposed", "allgather_kv",
                                              "fsdp_exposed") if a[f"{name}_s"] > 0}
    costs = ", ".join(f"{name.replace('_', ' ')} {s:.3g} s" for name, s in comm.items())
    text.append(f"The fastest layout that fits with {MESH_KINDS[a['mesh_kind']]}, {a['mesh']}, "
                f"is predicted {_slower(a['slower_s'], a['slower'])}"
                + (f" ({costs})" if costs else "") + ".")
  return {"mesh_kind": kind, "text": " ".join(text), "alternatives": alternatives}


def _on(domain):
  return "NVLink" if domain != NETWORK else "the network"


def _slower(seconds, fraction):
  if seconds < 0:
    return (f"{-seconds:.3g} s per step faster ({-fraction:.2%}), with less precise numerics "
            f"(the recommendation keeps the best numerics within 2 % of the fastest)")
  if fraction < 1:
    return f"{seconds:.3g} s per step slower ({fraction:.2%})"
  return f"{fraction + 1:.1f}x slower"
