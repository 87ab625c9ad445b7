"""The planner's mixture-of-experts terms (``plan.model`` adds them to a ``Model`` that has
experts): parameters held and run, the experts' working memory, and the bytes of the two
ways to place the experts.

Per MoE layer (X experts of width I, k per token, model width E; T tokens per device, c
bytes of the compute dtype):

  held       E·X router + X·3·E·I experts (+ X·(2I + E) biases)
  run        E·X + k·3·E·I per token (FLOPs: 2 per parameter forward, as dense)
  working    per token of an MLP tile, one layer's forward and backward: the k permuted
             copies of the token and of its output, and their gradients, 4·k·E·c; the k
             gate, up and activated rows and their gradients, 6·k·I·c; the float32 router
             logits and probabilities and their gradients, 16·X bytes. Counted from the
             layer's arrays, not fitted to a compiled program (the dense MLP's 7.5·F' is);
             it assumes a grouped matmul (k rows per token): a masked dense one over the X
             experts (XLA's CPU lowering of ``ragged_dot``) holds X times the rows.

Expert placement (``LlamaConfig.expert_placement``), values each device sends per MoE layer
and pass, with D the devices of the ``seq`` axis and Xd = X / D experts on each:

  (a) "fsdp": experts FSDP-sharded, all-gathered per layer: X·3·E·I, whatever T; the
      gathered layer (and its gradient) held for the layer: 2·X·3·E·I·c bytes;
  (b) "expert": experts split over ``seq``, a tile's (token, expert) pairs sent to their
      experts and back by all-to-all (``models.expert_parallel``): 2·(D-1)·T·min(k, Xd)·E,
      its fixed dropless blocks; the ideal, the used rows only, is about 2·T·k·E. The
      layer's Xd experts held: 2·Xd·3·E·I·c bytes; per tile of t tokens, D·t·min(k, Xd)
      rows through the experts instead of t·k (and D·min(k, Xd)/k times the expert FLOPs:
      the grouped matmul computes every slot), and the blocks sent and received.

``placement`` picks the expert placement where D divides X and it both moves fewer values
and holds less memory, else gathering (its all-gathers can be prefetched behind compute; the
dispatch's all-to-alls wait for the router), and states both. With the used rows only, (a)
would move less above T = 3·X·I / (2k) tokens per device (18,432 for Qwen3-30B-A3B, 34,560
for gpt-oss-20b); with the blocks implemented, above 3·X·I / (2·(D-1)·min(k, Xd)) (2,633 for
Qwen3-30B-A3B on seq = 8): every long-context layout gathers.
"""

_MOE_E, _MOE_I, _MOE_X = 4.0, 6.0, 16.0  # see the module docstring


def layer_params(model) -> int:
  """Parameters of one MoE layer's experts and router (held in every layer of the stack)."""
  e, x, i = model.hidden_dim, model.num_experts, model.expert_mlp_dim
  biases = x * (2 * i + e) + x if model.expert_bias else 0
  return e * x + 3 * x * e * i + biases


def inactive_params(model) -> int:
  """Parameters of one MoE layer that a token does not run: the X - k other experts."""
  e, x, i, k = model.hidden_dim, model.num_experts, model.expert_mlp_dim, model.experts_per_token
  per_expert = 3 * e * i + (2 * i + e if model.expert_bias else 0)
  return (x - k) * per_expert


def working_bytes(model, tile_tokens: int, c: int) -> float:
  """One MoE layer's working set for the backward of one tile of ``tile_tokens`` tokens."""
  k = model.experts_per_token
  return tile_tokens * (c * k * (_MOE_E * model.hidden_dim + _MOE_I * model.expert_mlp_dim)
                        + _MOE_X * model.num_experts)


def placement(model, tokens: int, expert_devices: int = 1, c: int = 2) -> dict:
  """Each expert placement at ``tokens`` per device with ``expert_devices`` (the ``seq``
  axis) to split the experts over and ``c`` bytes per value: values moved per MoE layer and
  pass, the memory the layer holds, the one to use (``"placement"``), and why: the expert
  placement where it both moves fewer values and needs no more memory, else gathering (whose
  all-gathers can be prefetched behind compute, the dispatch's all-to-alls cannot)."""
  e, x, i, k = model.hidden_dim, model.num_experts, model.expert_mlp_dim, model.experts_per_token
  d = expert_devices
  slots = min(k, x // d)
  gathered, dispatched = 3 * x * e * i, 2 * (d - 1) * tokens * slots * e
  tile = min(model.mlp_chunk, tokens) if model.mlp_chunk else tokens
  # Rows through the experts per tile: t·k gathered; D·t·min(k, Xd) dispatched, plus the
  # blocks sent and received (and their gradients).
  rows = d * tile * slots
  memory = {
      "fsdp": 2 * gathered * c + working_bytes(model, tile, c),
      "expert": (2 * gathered // d * c + working_bytes(model, rows / k, c)
                 + 4 * rows * e * c)}
  splits = d > 1 and x % d == 0
  moves_less = dispatched < gathered
  fits_in_less = memory["expert"] <= memory["fsdp"]
  chosen = "expert" if splits and moves_less and fits_in_less else "fsdp"
  crossover = 3 * x * i / (2 * k)
  gib = lambda n: f"{n / 2**30:.2f} GiB"
  why = (f"experts gathered per layer (fsdp): {gathered:,} values per MoE layer and pass, "
         f"{gib(memory['fsdp'])} per device for the layer; ")
  if not splits:
    why += (f"expert parallelism needs seq > 1 dividing the {x} experts (seq = {d}): "
            "gathering")
  else:
    why += (f"split over seq = {d} (expert): {dispatched:,} (2 (D-1) T min(k, X/D) E at "
            f"T = {tokens:,} tokens per device), {gib(memory['expert'])}, "
            f"{d * slots / k:g}x the expert FLOPs (every slot computed): "
            + ("gathering moves less" if not moves_less else
               "expert parallelism moves less but needs more memory: gathering"
               if not fits_in_less else
               "expert parallelism moves less in less memory: "
               "LlamaConfig.expert_placement = 'expert'"))
  return {"placement": chosen, "gathered_values": gathered, "dispatched_values": dispatched,
          "ideal_dispatched_values": 2 * tokens * k * e, "crossover_tokens": crossover,
          "memory_bytes": memory, "expert_flops_factor": d * slots / k, "why": why}
