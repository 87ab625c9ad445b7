"""Expert parallelism: a tile's (token, expert) pairs sent to the devices that hold their
experts and the outputs sent back, by two all-to-alls over one mesh axis (``seq``).

Runs inside the MoE layer's ``shard_map`` (``models.moe``, ``LlamaConfig.expert_placement =
"expert"``). The ``D`` devices of the axis each hold ``Xd = X / D`` experts, device d experts
``[d·Xd, (d+1)·Xd)``. For one tile of ``t`` local tokens with k experts each::

  the t·k pairs sorted by expert (so by device); pair p goes to slot s_p of device d_p's
  block: send_DCE[d_p, s_p] = x[token of p]; send_expert_DC the expert's local index, Xd in
  the unused slots
  recv_DCE = all_to_all(send_DCE)          block j: what device j sent here
  the D·C received rows sorted by local expert (unused slots last), through the local
  experts (a grouped matmul whose groups leave the unused rows out: they come out zero)
  back_DCE = all_to_all(outputs)           each pair's output in the slot it was sent from

Dropless without knowing the counts in advance: a block holds C = t·min(k, Xd) rows, the
most one device can receive from another (a token's k experts are distinct, at most
min(k, Xd) of them on one device). Why a fixed block and not ``jax.lax.ragged_all_to_all``,
which would send only the used rows: it compiles for H100, its transpose too (jax 0.10.2 and
0.12.0.1), but XLA:CPU cannot run it ("UNIMPLEMENTED: HLO opcode ragged-all-to-all"), so it
could not be tested against the reference here; and its receive buffer would need the same
worst case, D·C rows.

Cost per tile, compared with the k·t pairs the gathered placement handles:

  moved      each all-to-all sends (D - 1)·C·E values of the compute dtype per device and
             receives as many: 2·(D - 1)·C·E per pass (there and back), the backward as many
             again; C = t·min(k, Xd), so D·min(k, Xd)/k times the (D - 1)/D·t·k·E per
             direction that sending only the used rows would need (with routing spread
             evenly)
  memory     the send and receive buffers, 2·D·C·E, and the experts' rows (D·C of them:
             the input, gate, up, activation and output rows) for D·C instead of t·k rows
  expert FLOPs  of the D·C rows, D·min(k, Xd)/k times the t·k pairs': JAX's Hopper grouped
             matmul kernels (``kernels.grouped_matmul``, "mosaic") run every block of rows,
             past the last group too (a static grid; those rows' outputs are left unwritten,
             and ``expert_mlp`` zeroes them); XLA:CPU's ``ragged_dot`` is dense anyway

So the placement pays off only where the gathered experts cost more than D·min(k, Xd)/k
times the pairs: few tokens per device, many experts (``plan.moe.placement``).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def exchange(x_tE: jax.Array, weights_tk: jax.Array, experts_tk: jax.Array,
             local_experts: Callable, *, num_experts: int, axis: str,
             axis_size: int) -> jax.Array:
  """``sum_k weights · expert_k(x)`` ``[t, E]`` of this device's tokens ``x_tE`` (compute
  dtype), their experts ``experts_tk`` (global indices) computed on the devices of ``axis``
  (``axis_size`` of them) that hold them.

  ``local_experts(x_RE, expert_R, sizes_Xd, valid_R) -> y_RE`` runs this device's ``Xd``
  experts on rows sorted by local expert ``expert_R`` (``sizes_Xd`` rows each; the rows where
  ``valid_R`` is False, the unused slots, come last in no group: zero in, never read out).
  """
  t, k = experts_tk.shape
  e = x_tE.shape[-1]
  per_device = num_experts // axis_size
  capacity = t * min(k, per_device)

  # Pairs sorted by expert, so by destination; each one's slot in its destination's block.
  experts_p = experts_tk.reshape(-1)
  order_p = jnp.argsort(experts_p, stable=True)
  expert_p = experts_p[order_p]
  device_p = expert_p // per_device
  sent_D = jnp.bincount(device_p, length=axis_size)
  slot_p = jnp.arange(t * k) - (jnp.cumsum(sent_D) - sent_D)[device_p]
  send_DCE = jnp.zeros((axis_size, capacity, e), x_tE.dtype).at[device_p, slot_p].set(
      x_tE[order_p // k], unique_indices=True)
  send_expert_DC = jnp.full((axis_size, capacity), per_device, jnp.int32).at[
      device_p, slot_p].set(expert_p % per_device, unique_indices=True)

  to_devices = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)
  recv_RE = to_devices(send_DCE).reshape(axis_size * capacity, e)
  recv_expert_R = to_devices(send_expert_DC).reshape(-1)

  # On the experts' device: rows sorted by local expert, the unused slots (index Xd) last.
  order_R = jnp.argsort(recv_expert_R, stable=True)
  expert_R = recv_expert_R[order_R]
  sizes = jnp.bincount(expert_R, length=per_device + 1)[:per_device].astype(jnp.int32)
  valid_R = expert_R < per_device
  y_RE = local_experts(recv_RE[order_R], jnp.minimum(expert_R, per_device - 1), sizes,
                       valid_R)
  unsort_R = jnp.zeros_like(order_R).at[order_R].set(
      jnp.arange(order_R.shape[0], dtype=order_R.dtype))
  back_DCE = to_devices(y_RE[unsort_R].reshape(axis_size, capacity, e))

  # Back home: each pair's output from the slot it was sent from, in the pairs' order.
  y_pE = back_DCE[device_p, slot_p]
  unsort_p = jnp.zeros_like(order_p).at[order_p].set(jnp.arange(t * k, dtype=order_p.dtype))
  y_tkE = y_pE[unsort_p].reshape(t, k, e)
  return jnp.einsum("tke,tk->te", y_tkE, weights_tk.astype(y_tkE.dtype))
