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

Expert placement, values moved per MoE layer and pass over the network:

  (a) experts FSDP-sharded, all-gathered per layer (``models.moe``, the one implemented):
      X·3·E·I, whatever T;
  (b) expert parallelism (experts sharded over the devices, tokens sent to them and back by
      all-to-all; not implemented): about 2·T·k·E.

(a) moves less once T > 3·X·I / (2k): 18,432 tokens per device for Qwen3-30B-A3B and 34,560
for gpt-oss-20b, fewer than any long-context layout has.
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


def placement(model, tokens: int) -> dict:
  """Values moved per MoE layer and pass by each expert placement at ``tokens`` per device,
  the one used, and why."""
  e, x, i, k = model.hidden_dim, model.num_experts, model.expert_mlp_dim, model.experts_per_token
  gathered, dispatched = 3 * x * e * i, 2 * tokens * k * e
  crossover = 3 * x * i / (2 * k)
  why = (f"experts gathered per layer (FSDP): {gathered:,} values per MoE layer and pass; "
         f"expert parallelism would move about {dispatched:,} (2 T k E at T = {tokens:,} "
         f"tokens per device), "
         + ("more: gathering moves less" if gathered <= dispatched else
            "less, but it is not implemented")
         + f" (gathering moves less above {crossover:,.0f} tokens per device)")
  return {"placement": "fsdp", "gathered_values": gathered, "dispatched_values": dispatched,
          "crossover_tokens": crossover, "why": why}
