"""The planner's step time: compute, the collectives of ``plan.comm`` and what compute hides
of them, host transfers (``predict_step``).

Compute: 6·params·T + 12·K·n·Hq'·D·T FLOPs, K the sum over layers of the keys a query sees on
average (S/2 causal, about W with a sliding window W: ``reference.mean_visible_keys``; padded
heads compute too; with the expert placement the expert matmuls ``plan.moe.flops_factor`` times
over, every slot of the dispatch blocks), plus one forward of the layers under "full" and
"save_names" (less q, k and v) and their offloading forms (not the embedding, the LM head or
the layers' down projections), one more with remat groups (both without attention's when the
layers keep its residuals, ``Layout.keep_attention``), the MLPs' gate and up projections once
more under "none" when they are tiled (``mlp_chunk``: each tile is recomputed in its
backward), the experts' under "save_dots", and the attention layer (projections and
attention) once more with head chunks. Passes over attention: the
forward, the backward, and one more forward for each of: rematerialising and remat groups
(unless the layers keep attention's residuals), head chunks (each chunk recomputes its
attention in the backward). Each ring step also rescales a float32 ``[T, Hq', D]`` accumulator
in HBM.

What overlaps (an assumption each; ``ASSUMPTIONS``): the all-to-alls and the all-gather-KV
baseline's gathers sit between attention and the rest of the layer and are exposed whole. The
ring's transfers overlap the attention steps, all but one step's worth (the last hop's
transfer has nothing left to hide behind): attention hides up to s/(s + 1) of its time, s the
ring's steps from other devices. FSDP's gathers and reduce-scatters overlap compute, less the
time the ring already keeps the same links busy. Host transfers at ``pcie_bw``: offloaded
activations, and with ``offload_params`` the layer weights each forward pass fetches (a remat
group once for its k layers, in the forward and in its recompute) and the gradients it sends
back, overlap with compute; the update's streams (the optimizer state in and out; the
parameters and gradients the gradient norm and the update read, the parameters written back)
do not.
"""

from ulysses_jax.attention.reference import mean_visible_keys
from ulysses_jax.plan import comm, moe
from ulysses_jax.plan.hardware import Hardware
from ulysses_jax.plan.memory import host_param_count, named_per_token, optimizer_bytes
from ulysses_jax.plan.model import DTYPE_BYTES, Layout, Model, chunk_heads, ring_steps, tokens

ASSUMPTIONS = (
    "compute at the achieved FLOP/s (40 % of the dense bf16 peak), HBM at 90 %",
    "an all-to-all is exposed whole; its parts for the same NVLink domain at two thirds of "
    "NVLink's rate, the rest on the network at 90 % of the NIC's, both at once",
    "the ring's transfers overlap attention: up to s/(s + 1) of its time, s the ring's steps "
    "from other devices",
    "FSDP's all-gathers and reduce-scatters overlap compute, less the time the ring keeps the "
    "same links busy",
    "the all-gather-KV baseline's gathers are exposed whole (Llama 3 gathers before attention)",
    "a collective whose group spans NVLink domains runs at the network's rate; one NIC per GPU, "
    "no congestion beyond it",
)


def predict_step(model: Model, layout: Layout, *, batch: int, seq_len: int,
                 hardware: Hardware, dtype: str = "bfloat16", param_dtype: str = "float32",
                 master_weights: bool = False, accum_steps: int = 1) -> dict:
  """Predicted seconds of one training step per device, by term, with the bytes of each
  collective: ``step_s`` and its terms (``compute_s``, ``all_to_all_s``, ``ring_exposed_s``,
  ``allgather_kv_s``, ``fsdp_exposed_s``, ``offload_exposed_s``, ``optimizer_transfer_s``),
  the bytes each device sends (``all_to_all_bytes``, ``ring_bytes``, ``fsdp_bytes``,
  ``allgather_kv_bytes``), and ``breakdown``: every term with its seconds on the step's
  critical path, what is hidden, and for a collective its group, domain and bandwidth."""
  c, p = DTYPE_BYTES[dtype], DTYPE_BYTES[param_dtype]
  o, _ = optimizer_bytes(param_dtype, master_weights)
  n = layout.data * layout.seq * layout.ring
  _, _, t = tokens(layout, batch, seq_len)
  heads = chunk_heads(model, layout)
  hq = heads.exchanged_q_heads  # per head chunk
  n_layers, e, d = model.num_layers, model.hidden_dim, model.head_dim
  chunks = layout.attn_head_chunks
  regroup, rechunk = layout.remat_group > 1, chunks > 1
  forward_passes = 1 + (layout.remat != "none") + regroup + rechunk
  # Kept residuals spare attention's forward in the layer's and the group's recomputation.
  attention_passes = forward_passes - layout.keeps_attention * (1 + regroup)
  # Causal: 4·h FLOPs per visible key (scores and values), a query seeing S/2 keys on average
  # (about W with a window), over the heads as exchanged (padding computes too).
  windows = model.windows()
  layer_attn = [4 * mean_visible_keys(seq_len, w) * chunks * hq * d * t for w in windows]
  attn_flops = sum(layer_attn)
  # The expert placement's grouped matmuls compute every slot of the dispatch blocks.
  _, _, micro_t = tokens(layout, batch // accum_steps, seq_len)
  experts = moe.placement(model, micro_t, layout.seq, c) if model.moe_layers else None
  placement = moe.in_use(model, micro_t, layout.seq, c) if experts else "fsdp"
  extra_experts = (moe.flops_factor(model, placement, layout.seq) - 1) * moe.run_params(model)
  forward = 2 * (model.compute_params + model.moe_layers * extra_experts) * t + attn_flops
  projections = 2 * n_layers * e * (model.num_heads + 2 * model.num_kv_heads) * d * t
  # Rematerialising recomputes the layers, not the embedding or the LM head, and of a layer
  # not its last matmul, the MLP's down projection, whose output the backward does not need.
  # A tiled MLP (``mlp_chunk``) checkpoints each tile: without a layer policy ("none") the
  # tile's backward runs its gate and up projections again. "save_dots" keeps every matmul's
  # output, tiles or not (the layer's policy reaches into the tiles), but the experts' grouped
  # matmuls (no dots); it recomputes attention, taken off below where the layers keep it.
  embedding = model.vocab_size * e * (1 if model.tie_embeddings else 2)
  layers = forward - 2 * embedding * t
  dense_layers, expert_mlp = n_layers - model.moe_layers, moe.run_params(model) + extra_experts
  dense_up = 2 * t * dense_layers * 2 * e * model.mlp_dim  # gate and up
  experts_up = 2 * t * model.moe_layers * (2 * expert_mlp / 3 + e * model.num_experts)
  down = 2 * t * (dense_layers * e * model.mlp_dim + model.moe_layers * expert_mlp / 3)
  recompute = {"full": layers - down, "full_offload": layers - down,
               "save_names": layers - projections - down, "offload": layers - projections - down,
               "save_dots": attn_flops + experts_up,
               "none": dense_up + experts_up if model.mlp_chunk else 0}[layout.remat]
  # A head chunk's backward recomputes its projections (q, k, v, output) and attention.
  attention_layer = attn_flops + projections + 2 * n_layers * e * model.num_heads * d * t
  compute = (3 * forward + recompute + layers * regroup + attention_layer * rechunk
             - (forward_passes - attention_passes) * attn_flops) / hardware.flops
  # Attention runs in every forward pass it is not kept from and twice over in the backward.
  attention = (attention_passes + 2) * attn_flops / hardware.flops
  steps = [ring_steps(layout.ring, seq_len, w) for w in windows]
  merge = (sum(s + 1 for s in steps) * chunks * (attention_passes + 1) * 12 * t * hq * d
           / hardware.hbm_bw if layout.ring > 1 else 0)
  collectives = {x.name: x for x in comm.step_collectives(
      model, layout, hardware, seq_len=seq_len, batch=batch, dtype=dtype,
      param_dtype=param_dtype, accum_steps=accum_steps, forward_passes=forward_passes)}
  seconds = lambda name: collectives[name].seconds if name in collectives else 0.0
  # The ring hides behind the attention of its layers, all but one step's worth each.
  ring_cover = sum(a * s / (s + 1) for a, s in zip(layer_attn, steps)) * (
      (attention_passes + 2) / hardware.flops)
  ring_hidden = min(seconds("ring"), ring_cover)
  gathers = ("fsdp_all_gather", "expert_all_gather")
  fsdp = sum(seconds(x) for x in (*gathers, "fsdp_reduce_scatter", "expert_reduce_scatter"))
  shares_links = ("ring" in collectives and "fsdp_all_gather" in collectives
                  and collectives["ring"].links.domain
                  == collectives["fsdp_all_gather"].links.domain)
  fsdp_hidden = min(fsdp, max(0.0, compute - ring_hidden * shares_links))
  host = _host_transfers(model, layout, t, c, p, o, n, hardware, compute)
  times = {
      "compute_s": compute + merge,
      "all_to_all_s": seconds("all_to_all") + seconds("expert_all_to_all"),
      "ring_exposed_s": seconds("ring") - ring_hidden,
      "allgather_kv_s": seconds("allgather_kv") + seconds("allgather_kv_grad"),
      "fsdp_exposed_s": fsdp - fsdp_hidden,
      **host,
  }
  moved = lambda *names: sum(collectives[x].moved_bytes for x in names if x in collectives)
  hidden = {"ring": ring_hidden}
  for name in ("fsdp_all_gather", "expert_all_gather", "fsdp_reduce_scatter",
               "expert_reduce_scatter"):  # FSDP's hidden time, shared by their seconds
    if name in collectives:
      hidden[name] = fsdp_hidden * seconds(name) / fsdp if fsdp else 0.0
  breakdown = [_term("attention", attention + merge, hidden_by=None),
               _term("matmuls", compute - attention, hidden_by=None)]
  for x in collectives.values():
    hidden_s = hidden.get(x.name, 0.0)
    breakdown.append({**x.describe(), "term": x.name, "seconds": max(0.0, x.seconds - hidden_s),
                      "busy_s": x.seconds, "hidden_s": hidden_s,
                      "hidden_by": {"ring": "attention"}.get(x.name, "compute")
                      if x.name in hidden else None})
  breakdown += [_term("host_offload", host["offload_exposed_s"], hidden_by="compute"),
                _term("optimizer_transfer", host["optimizer_transfer_s"], hidden_by=None)]
  return {"all_to_all_bytes": moved("all_to_all", "expert_all_to_all"),
          "ring_bytes": moved("ring"),
          "fsdp_bytes": moved("fsdp_all_gather", "fsdp_reduce_scatter", "expert_all_gather",
                              "expert_reduce_scatter"),
          "allgather_kv_bytes": moved("allgather_kv", "allgather_kv_grad"), **times,
          "step_s": sum(times.values()), "breakdown": breakdown,
          **({"experts": {**experts, "placement": placement,
                          "recommended": experts["placement"]}} if experts else {})}


def _term(name, seconds, hidden_by):
  return {"term": name, "seconds": seconds, "busy_s": seconds, "hidden_s": 0.0,
          "hidden_by": hidden_by}


def _host_transfers(model, layout, t, c, p, o, n, hardware, compute):
  """Exposed seconds of host transfers: what compute does not hide of the offloaded
  activations and layer weights, and the optimizer update's streams (module docstring)."""
  regroup = layout.remat_group > 1
  # Offloaded activations go to the host and back; the layers' inputs, and the groups'
  # inputs with remat groups.
  moved_inputs = model.num_layers + (model.num_layers // layout.remat_group if regroup else 0)
  moved = {"full_offload": moved_inputs * model.hidden_dim,
           "offload": model.num_layers * named_per_token(model)}
  host_param_bytes = p * host_param_count(model, layout) / n
  # A group copies its layers' weights once per pass over it (the forward, its recompute in
  # the backward); its layers' own recomputes reuse that copy.
  fetches = 1 + (layout.remat != "none")
  overlapped = 2 * t * c * moved.get(layout.remat, 0) + (fetches + 1) * host_param_bytes
  update_streams = 2 * o * model.params / n * layout.offload_optimizer + 4 * host_param_bytes
  return {"offload_exposed_s": max(0.0, overlapped / hardware.pcie_bw - compute),
          "optimizer_transfer_s": update_streams / hardware.pcie_bw}
