"""The planner's mixture-of-experts terms (``plan.memory`` adds them to a ``Model`` that has
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
             layer's arrays, not fitted to a compiled program (the dense MLP's 4·F' is);
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

``plan.memory``, ``plan.comm`` and ``plan.step`` model the placement in use (``in_use``:
``Model.expert_placement``, or with "auto" the one ``placement`` picks) with the terms below
(``held_bytes``, ``placed_working_bytes``, ``block_values``, ``flops_factor``).

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


def run_params(model) -> int:
  """Expert parameters one token runs in one MoE layer: its k experts' (the router aside)."""
  e, i, k = model.hidden_dim, model.expert_mlp_dim, model.experts_per_token
  return k * (3 * e * i + (2 * i + e if model.expert_bias else 0))


def working_bytes(model, tile_tokens: int, c: int) -> float:
  """One MoE layer's working set for the backward of one tile of ``tile_tokens`` tokens."""
  k = model.experts_per_token
  return tile_tokens * (c * k * (_MOE_E * model.hidden_dim + _MOE_I * model.expert_mlp_dim)
                        + _MOE_X * model.num_experts)


PLACEMENTS = ("fsdp", "expert")  # ``models.config.EXPERT_PLACEMENTS``; the planner adds "auto"


def slots(model, expert_devices: int) -> int:
  """Rows per token of a dispatch block: min(k, X/D)."""
  return min(model.experts_per_token, model.num_experts // expert_devices)


def splits(model, expert_devices: int) -> bool:
  """Whether the expert placement can split the experts over ``expert_devices`` (seq)."""
  return expert_devices > 1 and model.num_experts % expert_devices == 0


def split_params(model) -> int:
  """Parameters of one MoE layer that the expert placement splits over ``seq``: the experts
  and their biases (the router, E·X, stays whole)."""
  return layer_params(model) - model.hidden_dim * model.num_experts


def block_values(model, tokens: int, expert_devices: int) -> int:
  """Values in one MoE layer's dispatch blocks per pass with the expert placement, as the
  all-to-alls return them: there and back, D blocks of T·min(k, X/D) rows of E each; (D-1)/D
  of them leave the device."""
  d = expert_devices
  return 2 * d * tokens * slots(model, d) * model.hidden_dim


def held_bytes(model, placement: str, expert_devices: int, c: int) -> float:
  """One MoE layer's weights gathered for the layer and their gradient (the tiles accumulate
  it whole): every expert gathered (fsdp); the router and the X/D experts of this device
  (expert)."""
  if placement == "fsdp":
    return 2 * c * layer_params(model)
  return 2 * c * (layer_params(model) - split_params(model) + split_params(model) / expert_devices)


def placed_working_bytes(model, placement: str, tile_tokens: int, expert_devices: int,
                         c: int) -> float:
  """``working_bytes`` of one tile in the placement: with the expert placement D·t·min(k, X/D)
  rows through the experts instead of t·k, plus the blocks sent and received (and their
  gradients)."""
  if placement == "fsdp":
    return working_bytes(model, tile_tokens, c)
  rows = expert_devices * tile_tokens * slots(model, expert_devices)
  return (working_bytes(model, rows / model.experts_per_token, c)
          + 4 * rows * model.hidden_dim * c)


def flops_factor(model, placement: str, expert_devices: int) -> float:
  """The expert matmuls' FLOPs over the gathered placement's: D·min(k, X/D)/k with the
  expert placement (the grouped matmul computes every slot of the blocks), else 1."""
  if placement == "fsdp":
    return 1.0
  return expert_devices * slots(model, expert_devices) / model.experts_per_token


def in_use(model, tokens: int, expert_devices: int, c: int = 2) -> str:
  """The placement the planner models: ``model.expert_placement``, or with ``"auto"`` the one
  ``placement`` recommends. Raises where the expert placement cannot split the experts."""
  chosen = model.expert_placement
  if chosen == "auto":
    return placement(model, tokens, expert_devices, c)["placement"]
  if chosen not in PLACEMENTS:
    raise ValueError(f"expert_placement must be 'auto' or one of {PLACEMENTS}, got "
                     f"{chosen!r}.")
  if chosen == "expert" and not splits(model, expert_devices):
    raise ValueError(f"expert_placement='expert' splits the {model.num_experts} experts over "
                     f"seq, which must be > 1 and divide them, got seq = {expert_devices}; "
                     "give a mesh whose seq divides the experts, or expert_placement='fsdp'.")
  return chosen


def placement(model, tokens: int, expert_devices: int = 1, c: int = 2) -> dict:
  """Each expert placement at ``tokens`` per device with ``expert_devices`` (the ``seq``
  axis) to split the experts over and ``c`` bytes per value: values moved per MoE layer and
  pass, the memory the layer holds, the one to use (``"placement"``), and why: the expert
  placement where it both moves fewer values and needs no more memory, else gathering (whose
  all-gathers can be prefetched behind compute, the dispatch's all-to-alls cannot)."""
  e, x, i, k = model.hidden_dim, model.num_experts, model.expert_mlp_dim, model.experts_per_token
  d = expert_devices
  gathered = 3 * x * e * i
  dispatched = block_values(model, tokens, d) * (d - 1) // d
  tile = min(model.mlp_chunk, tokens) if model.mlp_chunk else tokens
  can_split = splits(model, d)
  memory = {p: held_bytes(model, p, d, c) + placed_working_bytes(model, p, tile, d, c)
            for p in PLACEMENTS}
  moves_less = dispatched < gathered
  fits_in_less = memory["expert"] <= memory["fsdp"]
  chosen = "expert" if can_split and moves_less and fits_in_less else "fsdp"
  crossover = 3 * x * i / (2 * k)
  gib = lambda n: f"{n / 2**30:.2f} GiB"
  why = (f"experts gathered per layer (fsdp): {gathered:,} values per MoE layer and pass, "
         f"{gib(memory['fsdp'])} per device for the layer; ")
  if not can_split:
    why += (f"expert parallelism needs seq > 1 dividing the {x} experts (seq = {d}): "
            "gathering")
  else:
    why += (f"split over seq = {d} (expert): {dispatched:,} (2 (D-1) T min(k, X/D) E at "
            f"T = {tokens:,} tokens per device), {gib(memory['expert'])}, "
            f"{flops_factor(model, 'expert', d):g}x the expert FLOPs (every slot computed): "
            + ("gathering moves less" if not moves_less else
               "expert parallelism moves less but needs more memory: gathering"
               if not fits_in_less else
               "expert parallelism moves less in less memory: "
               "LlamaConfig.expert_placement = 'expert'"))
  return {"placement": chosen, "gathered_values": gathered, "dispatched_values": dispatched,
          "ideal_dispatched_values": 2 * tokens * k * e, "crossover_tokens": crossover,
          "memory_bytes": memory, "expert_flops_factor": flops_factor(model, "expert", d),
          "why": why}
