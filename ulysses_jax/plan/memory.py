"""The planner's memory per device of a ``Model`` in a ``Layout`` (``predict_memory``; the
shapes are ``plan.model``'s).

With ``accum_steps`` micro-batches the activations are those of one micro-batch, the
gradients are summed in float32 (4·params/N more), and FSDP gathers and reduce-scatters once
per micro-batch.

Memory model (bytes per device; N devices, T = batch·S/N tokens per device, c / p bytes of
the compute / parameter dtype, w bytes of the weights the optimizer updates: 4 with float32
master weights (``master_weights``), else p; parameters, gradients and optimizer state
FSDP-sharded over all N devices; n = ``attn_head_chunks``, Hq' and Hkv' one chunk's query
and KV heads as ``plan_heads(Hq/n, Hkv/n, seq)`` exchanges them, padded and replicated):

  state      (p + o)·params/N            parameters and optimizer state (the step's
                                         arguments), o = 2w (Adam moments) + w with master
                                         weights; p·params/N with the optimizer state on the
                                         host
  grads      p·params/N                  gradients (no update temporary: the compiled GPU
                                         steps write the donated state in place; XLA:CPU keeps
                                         one more w·params/N); with the optimizer state on
                                         the host its update streams it through the device a
                                         layer at a time:
                                         then the device holds params + grads +
                                         2·o·(layer_params + other_params)/N (one layer's state
                                         in and out, the state of the parameters outside the
                                         layers whole). With the layer parameters on the host
                                         too, "params" in state and grads counts other_params
                                         and the k layers of a remat group (a group copies
                                         its layers' weights to the device at once)
  gathered   c·layer_params + c·V·E      one layer's weights (FSDP all-gather); one
                                         vocabulary-sized buffer (below)
             + c·X·3·E·I                 with experts: their gradient, which the MoE tiles
                                         accumulate whole; with the expert placement only
                                         X/seq experts and their gradient (``plan.moe``,
                                         ``Model.expert_placement``; so are the experts'
                                         working set and dispatch blocks)
  saved      L'·T·c·E [+ L·T·c·(2Hq + 2Hkv)·D with save_names]   residuals kept for the
             [+ L·T·c·((Hq + 2Hkv)·D + E + 2F) with save_dots]
             + L·T·Hq'·n·(D·c + 4)       backward: L' layer inputs, L' = L, or L/k + k with
                                         groups of k layers (``remat_group``; the k of the
                                         group being recomputed); ``offload`` keeps the named
                                         ones on the host, ``full_offload`` the inputs; and
                                         attention's output and float32 lse per layer
                                         (``keep_attention``; not with the offloading
                                         policies, which recompute them)
             remat="none" keeps instead, per layer, what the compiled backward reads
             L·T·(8·E + c·(2E + 3Hq'·D + 2Hkv'·D) + 4Hq')   the attention pre-norm's float32
                                         input and output, its output in the compute dtype,
                                         q, the attention output in the kernel's layout and
                                         in the projection's, k, v, the lse, and the MLP's
                                         input; untiled dense MLPs add 8·E + 6c·F (the MLP
                                         pre-norm's float32 pair, gate, up and their
                                         products); and every layer's gathered weights
                                         (``gathered`` counts L layers, not one)
  host       what is offloaded: optimizer state, layer parameters and gradients, per-layer
             residuals; per device, against
             ``Hardware.host_bytes`` per device
  working    T·c·(W + 4·F')              one layer's recomputed forward and its backward:
                                         W = max(6·E + 1.1·A, 4·E + (4 + 2s)·Hq'·D + 2.5·Hkv'·D)
                                         per token, A = (2Hq' + 2Hkv')·D one head chunk's q,
                                         k, v and attention output (below), s = 1 with
                                         attention sinks
             + 2·B'·(Hq'/P)·b²·4         two float32 score tiles of the XLA attention (b <= 512)
             + T·D·Hq'·(4 + c)           ring > 1: one chunk's float32 sum of the output
                                         (forward) or dQ (backward) and one step's partial of
                                         it in the compute dtype

The total is the sum of these terms, or, where it is larger, the chunked loss' peak between
the layers' forward and their backward (``_loss_working``): state, grads and saved (with
remat="none" every layer's gathered weights too) and

  loss       (c + 4)·V·E                 the head gathered and its float32 gradient, summed
             + R·(8 + c)·V               over the chunks and replicated until the
                                         reduce-scatter; one chunk's float32 logits and their
                                         gradient, in float32 and in the compute dtype (R rows
                                         per device: sequences x min(loss_chunk, tokens per
                                         sequence))

The layers' backward waits for the head gradient's reduce-scatter (``loss._to_head_shards``),
so the head and its float32 sum are not live at its peak. Before that barrier XLA kept the sum
through the backward and the model counted 2c·V·E (head and gradient) at the layers' peak;
with it the compiled multi-GPU steps fell by up to 2 GiB (Llama-3.1-8B; one-GPU steps did not
move), and c·V·E is left, fitted: XLA:CPU forms the embedding lookup's zeroed gradient whole
before the layers' backward (its buffer assignment), and with the term the 39 H100 layouts of
``benchmarks.plan_vs_compiler`` (jax 0.12.0.1, 2026-12-08) are predicted within +1.2 … +9.8 %
(one listed gap), the Qwen3-30B-A3B fine-tunes within 11 % under; without it Llama's layouts
fit tighter (-1.5 … +8.3 %) but the fine-tunes fall to 12 % under.

F' = min(T, tokens per MLP tile) / T · F. The pre-norms run inside the head chunks and the MLP
tiles, so the normalised input and its gradient are not among the 6 ``[T, E]`` buffers.
6·E + 1.1·A is fitted (below); the second term of W is counted from the buffers live at the
peak of a 4-layer Qwen3-30B-A3B's step (XLA's buffer assignment under memory pressure, H100,
jax 0.10.2, 1M tokens on 1x1x8, the fine-tune config):
while the MLP or the experts run their backward the recomputed forward holds 4 ``[T, E]``
buffers (the layer's input, its copy in the compute dtype, the residual sum, the MLP tiles'
stacked output), the attention's q and output in both all-to-all layouts (4·Hq'·D), k and v
after it and their projection (2.5·Hkv'·D), and with sinks the output once more in float32
(2·Hq'·D); with experts, their gradient (the ``gathered`` term). Where Hq·D = E (Llama, every
layout of the fit) the count is the smaller, so the 25 layouts below are predicted as before;
it is the larger where the attention is wider than the model (Qwen3-30B-A3B: Hq·D = 4,096,
E = 2,048). With the two terms the planner is 3 to 10 % under the Qwen3-30B-A3B fine-tunes
compiled as is (1M to 4M tokens, jax 0.10.2 and 0.12.0.1; it was 11 to 19 % under) and 3.6 %
and 12.4 % under the 4-layer model under pressure at 1M and 4M tokens: at 4M the peak moves
to the attention's backward (6 q-sized and 3 ``[T, E]`` buffers), which no term counts.

What is predicted is the footprint XLA's GPU compiler reaches when memory is tight. Far below
the GPU's capacity XLA keeps buffers it could do without (Llama-3.1-8B on 4x1x8 at 256K tokens
per GPU: 21.52 GiB compiled for an H100, 17.57 under memory pressure, 18.70 predicted); near it,
it trades time for memory. So a layout fits when this footprint does, and the coefficients are
fitted against the smaller of the step compiled as is (with the memory limit of a run holding
the budget, ``aot.report.budget_options``) and under pressure (``aot.report.UNDER_PRESSURE``),
on H100 compiles (jax 0.10.2, 2026-11-24) of the 25 layouts of ``benchmarks.plan_vs_compiler``
(``CONFIGS`` and ``GRID``: 1B and 8B; 1, 8 and 32 GPUs; 65K to 32M tokens; 1, 2 and 4 head
chunks; state on the GPUs or the host; rings of 4): 6 and 1.1 leave every one within 8.2 %
(-5.7 … +8.2 %). The ring's term was chosen after the ring's memory fix (d9fd7da: no K/V
block kept per ring step), against the three Llama-3.1-8B ring layouts (8M, 16M, 32M tokens on
4x1x8) and the five Llama-3.1-70B ring layouts of ``benchmarks.scaling_compiled --fit`` (rings
of 16 to 256): the former count (incoming K and V blocks and one float32 sum) over-predicted
the 8B ones (+3.8 … +9.3 %, +12.1 % with jax 0.12.0.1) and under-predicted the 70B ones (-1.7
… -4.5 %), which hold 8 times more query than KV heads per device; the float32 sum with a
compute-dtype partial and no K/V term leaves the 8B ones at +0.7 … +6.4 % (jax 0.10.2) and
+0.7 … +9.2 % (jax 0.12.0.1), the five 70B ring layouts at -2.2 … +0.7 % and the two 1B ring
layouts at -1.4 and +3.7 %. Not captured: n = 8 on one GPU (compiled 65.9 GiB, predicted
61.0; the planner tries n <= 4), the ring with n = 1 at 1M tokens per GPU (-23 % before the
ring's squeeze, far over any GPU), and gpt-oss-20b (16 to 25 % under at 2M and 4M tokens, jax
0.10.2 and 0.12.0.1: its compiled peak holds the layer's input in float32 twice and five
copies of q and the attention output, counted by no term here).
4·F' is fitted to five layouts with the MLP untiled, "full" remat, compiled for H100s (jax
0.12.0.1; ``benchmarks.plan_vs_compiler --layouts untiled``: Llama-3.2-1B at 64K and 128K
tokens on one GPU and 1M on 8, Llama-3.1-8B at 256K and 512K on 8), which it leaves at -0.6
to +6.4 %. It was 7.5, a fit to XLA's CPU buffer assignment, 9 to 29 % over those layouts
(``tests/test_plan.py`` still checks the total against ``compiled.memory_analysis()`` on CPU,
untiled MLP, within 15 %: -8 to +4 % now). The GPU configs tile the MLP, so F' is small there.

The ``remat="none"`` terms are the buffers XLA keeps per layer in the compiled step's
memory-usage report (``XLA_FLAGS=--xla_dump_to``; H100, jax 0.12.0.1; Llama-3.2-1B at 16K
tokens on one GPU and at 64K per GPU on 8, tiled and untiled; Llama-3.1-8B at 16K on 1 and 8).
Against the nine layouts of ``benchmarks.plan_vs_compiler --layouts none`` (1B and 8B, 1 and 8
GPUs, 16K to 64K tokens per GPU, MLP tiled or not) the planner is 0.9 to 4.9 % over: the
backward of a layer that is not recomputed needs fewer temporaries than ``working`` counts.
Llama-3.1-8B on 8 GPUs keeps a fourth q-sized buffer per layer, counted by no term. The
earlier estimate (10·E + 4·F' + A per layer in the compute dtype, one layer's weights) was 44 %
over to 24 % under.

With ``Layout.attention="allgather_kv"`` (the Llama 3 / Megatron baseline, which the planner
models but the trainer does not run) each device keeps all heads of its T tokens and gathers K
and V of the whole sequence S: the working set adds them and their gradients, 4·S·(Hkv/n)·D·c,
and the score tiles hold every query head.
"""

from ulysses_jax.plan import moe
from ulysses_jax.plan.model import (DTYPE_BYTES, Layout, Model, attention_per_token, chunk_heads,
                                    tokens)

_XLA_BLOCK = 512
# One layer's backward: live [T, E] buffers, buffers of one head chunk's q, k, v and attention
# output (per element per token), [T, F] buffers (see the module docstring).
_WORK_E, _WORK_A, _WORK_F = 6.0, 1.1, 4.0
# Counted from the buffers live at the peak of compiled steps (XLA's buffer assignment, H100,
# jax 0.10.2): while a layer's MLP (or experts) runs its backward, its recomputed forward holds
# [T, E] buffers (the layer's input, its compute-dtype copy, the residual sum, the MLP tiles'
# stacked output), the attention's q and output in both all-to-all layouts ([T, Hq'·D] each),
# k and v after the all-to-all and their projection (see the module docstring).
_PEAK_E, _PEAK_Q, _PEAK_KV = 4.0, 4.0, 2.5
# With attention sinks the output is also kept in float32 for the sinks' gradient (gpt-oss).
_SINKS_Q = 2.0


def optimizer_bytes(param_dtype, master_weights):
  """Bytes of optimizer state per parameter (``o``) and bytes of the updated weights (``w``)."""
  w = 4 if master_weights else DTYPE_BYTES[param_dtype]
  return (3 if master_weights else 2) * w, w


def predict_memory(model: Model, layout: Layout, *, batch: int, seq_len: int,
                   dtype: str = "bfloat16", param_dtype: str = "float32",
                   master_weights: bool = False, accum_steps: int = 1) -> dict:
  """Predicted bytes per device, by term (see the module docstring), and their ``total``."""
  c, p = DTYPE_BYTES[dtype], DTYPE_BYTES[param_dtype]
  o, w = optimizer_bytes(param_dtype, master_weights)
  n = layout.data * layout.seq * layout.ring
  e, f, d = model.hidden_dim, model.mlp_dim, model.head_dim
  seqs, per_seq, t = tokens(layout, batch // accum_steps, seq_len)
  heads = chunk_heads(model, layout)
  hq, hkv = heads.exchanged_q_heads, heads.exchanged_kv_heads
  mlp_tokens = min(t, seqs * model.mlp_chunk) if model.mlp_chunk else t
  f_eff = f * mlp_tokens / t
  if layout.remat == "none":
    saved = t * _unrematerialised_per_token(model, heads, c, tiled=mlp_tokens < t)
  else:
    saved = (_kept_layer_inputs(model, layout) * t * c * e * (layout.remat != "full_offload")
             + model.num_layers * t * c * named_per_token(model) * (layout.remat == "save_names")
             + t * c * _dots_per_token(model) * (layout.remat == "save_dots")
             + kept_attention_bytes(model, layout, t, c))
  attn_len = seq_len // layout.ring  # keys per step on each device
  block = min(_XLA_BLOCK, attn_len)
  gathered_kv = layout.attention == "allgather_kv"
  tiles = 2 * seqs * (hq if gathered_kv else hq // layout.seq) * block * block * 4
  incoming = 0
  if layout.ring > 1:  # one chunk's float32 output or dQ sum and a step's partial of it
    incoming = t * d * hq * (4 + c)
  if gathered_kv:  # one chunk's K and V of the whole sequence, and their gradients
    incoming = 4 * seqs * seq_len * hkv * d * c
  offload = layout.offload_optimizer
  optimizer = o * model.params / n
  host_params = host_param_count(model, layout)
  device_params = model.params - host_params + _device_layer_params(model, layout)
  placement = moe.in_use(model, t, layout.seq, c) if model.moe_layers else "fsdp"
  experts_held = (moe.held_bytes(model, placement, layout.seq, c)
                  - c * moe.layer_params(model) if model.moe_layers else 0)
  # Without remat every layer's gathered weights stay for the backward, the loss' peak included.
  gathered_layers = c * model.layer_params * (model.num_layers if layout.remat == "none" else 1)
  terms = {
      "state": p * device_params / n + (0 if offload else optimizer),
      "grads": (p + 4 * (accum_steps > 1)) * device_params / n,
      "gathered": gathered_layers + c * model.vocab_size * e + experts_held,
      "saved": saved,
      "working": (t * c * _layer_per_token(model, heads) + tiles + incoming
                  + _mlp_working(model, t, c, f_eff, mlp_tokens, placement, layout.seq)),
  }
  terms["total"] = max(sum(terms.values()), terms["state"] + terms["grads"] + terms["saved"]
                       + gathered_layers * (layout.remat == "none")
                       + _loss_working(model, seqs, per_seq, c))
  if offload:  # the update streams one layer's state through, and the other parameters'
    streamed = model.layer_params + model.params - model.num_layers * model.layer_params
    terms["total"] = max(terms["total"], (2 * p * device_params + 2 * o * streamed) / n)
  terms["host"] = (optimizer * offload + 2 * p * host_params / n
                   + _host_activation_bytes(model, layout, t, c))
  return terms


def _loss_working(model, seqs, per_seq, c):
  """The chunked loss' scan, between the layers' forward and their backward: the head gathered
  (c·V·E), its float32 gradient summed over the chunks, replicated until the reduce-scatter
  (4·V·E), and one chunk's float32 logits and their gradient, in float32 and in the compute
  dtype ((8 + c)·V per token of the chunk)."""
  v, e = model.vocab_size, model.hidden_dim
  return (c + 4) * v * e + seqs * min(model.loss_chunk, per_seq) * v * (8 + c)


def _layer_per_token(model, heads):
  """Elements per token of one layer's backward working set outside the MLP tiles: the larger
  of the fitted ``6·E + 1.1·A`` and the counted peak while the MLP runs its backward,
  ``4·E + 4·Hq'·D + 2.5·Hkv'·D`` (``+ 2·Hq'·D`` with sinks). Where Hq·D = E (Llama, every
  layout the fit used) the fit is the larger, by 1.5 %; the count is larger where the
  attention is wider than the model (Qwen3-30B-A3B: Hq·D = 4,096, E = 2,048)."""
  e, d = model.hidden_dim, model.head_dim
  fitted = _WORK_E * e + _WORK_A * attention_per_token(heads, d)
  q = heads.exchanged_q_heads * d
  counted = (_PEAK_E * e + (_PEAK_Q + _SINKS_Q * model.attention_sinks) * q
             + _PEAK_KV * heads.exchanged_kv_heads * d)
  return max(fitted, counted)


def _mlp_working(model, t, c, f_eff, mlp_tokens, placement, expert_devices):
  """The larger of the dense MLP's and the experts' working set (layers of either kind)."""
  dense = t * c * _WORK_F * f_eff if model.moe_layers < model.num_layers else 0
  experts = (moe.placed_working_bytes(model, placement, mlp_tokens, expert_devices, c)
             if model.moe_layers else 0)
  return max(dense, experts)


def _device_layer_params(model, layout):
  """Layer parameters (and as many gradients) on the device while a layer runs, with the
  layers' on the host: one layer's, or a group's k layers' (a group copies them at once)."""
  return model.layer_params * layout.remat_group * layout.offload_params


def host_param_count(model, layout):
  """Parameters (and as many gradients) in host memory: the layers' with ``offload_params``."""
  return model.num_layers * model.layer_params * layout.offload_params


def _kept_layer_inputs(model, layout):
  """Layer inputs ``[T, E]`` the backward keeps: one per layer, or with groups of k layers one
  per group plus the k of the group being recomputed."""
  k = layout.remat_group
  return model.num_layers if k == 1 else model.num_layers // k + k


def named_per_token(model):
  """Elements per token per layer of q, k, v and the attention output (``remat_names``)."""
  return (2 * model.num_heads + 2 * model.num_kv_heads) * model.head_dim


def _dots_per_token(model):
  """Elements per token that ``save_dots`` keeps over the layers: every layer's q, k, v and
  output projections' results, and a dense MLP's gate and up projections', tiled or not (the
  layer's policy reaches into the tiles; the experts' grouped matmuls are no dots)."""
  e, f = model.hidden_dim, model.mlp_dim
  projections = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim + e
  return (model.num_layers * projections + (model.num_layers - model.moe_layers) * 2 * f)


def _unrematerialised_per_token(model, heads, c, *, tiled):
  """Bytes per token that ``remat="none"`` keeps over the layers (see the module docstring)."""
  e, f, d = model.hidden_dim, model.mlp_dim, model.head_dim
  q, kv = heads.exchanged_q_heads * d, heads.exchanged_kv_heads * d
  attention = 2 * 4 * e + c * (e + 3 * q + 2 * kv) + 4 * heads.exchanged_q_heads
  untiled_mlp = 2 * 4 * e + c * 6 * f
  dense = model.num_layers - model.moe_layers
  return model.num_layers * (attention + c * e) + (0 if tiled else dense * untiled_mlp)


def kept_attention_bytes(model, layout, t, c):
  """Bytes per device of every layer's attention output (c bytes per element) and float32
  log-sum-exp that a rematerialising policy keeps for the backward (``Layout.keep_attention``):
  L·T·Hq'·n·(D·c + 4), T tokens per device, Hq'·n query heads as the all-to-all exchanges them
  (every head chunk's)."""
  if not layout.keeps_attention:
    return 0
  heads = chunk_heads(model, layout).exchanged_q_heads * layout.attn_head_chunks
  return model.num_layers * t * heads * (model.head_dim * c + 4)


def _host_activation_bytes(model, layout, t, c):
  """Bytes of activations the remat policy keeps on the host, per device."""
  if layout.remat == "full_offload":
    return _kept_layer_inputs(model, layout) * t * c * model.hidden_dim
  if layout.remat == "offload":
    return model.num_layers * t * c * named_per_token(model)
  return 0
