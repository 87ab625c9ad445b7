"""The planner for generation (``ulysses-plan --generate``): the KV cache, prefill and decode
memory per device, and the predicted prefill time and decode time per token of
``ulysses_jax.generate`` on a mesh, without compiling (``ulysses-aot --generate`` compiles).

Per device, with N = data·seq·ring devices, c bytes of the compute dtype (the weights are
held in it, replicated: ``generate.PARAM_RULES``), T = B·S/N prompt tokens per device in one
prefill pass (one chunk of ``chunk_len`` tokens with chunked prefill):

  cache      ``CacheLayout.bytes_per_device`` (the cache's own formula, the layout planned by
             ``generate.plan_cache`` on an abstract mesh) plus its positions
  weights    c·params (all of them on every device)
  decode     weights + cache: a step's arguments; its temporaries (a row's logits, one
             layer's partial outputs) are megabytes and not counted
  prefill    weights + cache + the forward's working set of one layer at its peak, the MLP:
             T·c·(2·F' + 3·E) for a dense layer (the layer input, its norm and the output
             being formed, E each; gate and up, F' each, F' = F times the MLP tile's share of
             T: the programs compiled on 2026-11-29 hold no third [T, F'] buffer for their
             product), T·(c·k·(2·E + 3·I) + 8·X) for experts (the k copies of each token and
             of its output; gate, up and product of width I; float32 router logits and
             probabilities). Counted from the arrays, not fitted; 6 % above the compiled
             dense prefills' temporaries (Llama-3.1-8B, 1M tokens on 8 H100s and 4M on 32,
             jax 0.11.2 and 0.12.0.1). Not counted: a ring's incoming K and V blocks (the
             4M-token prefill on 32 H100s compiles to the temporaries of the 1M one on 8;
             training's ring term, ``plan.memory``, would add 2.5 GiB here).

Times, as ``aot.generate`` predicts them from the compiled programs (lower bounds: peak rates,
no overlap), and at the planner's achieved rates (``plan.hardware.ACHIEVED``):

  prefill    forward FLOPs per device (a third of ``metrics.flops_per_token``'s training
             FLOPs) at the dense bf16 peak, plus the attention collectives of one forward
             (``plan.comm.layer_traffic``: the all-to-alls on NVLink, the ring's K/V on the
             network when the ring spans nodes)
  decode     every byte a step reads once at HBM bandwidth: the weights it runs (a token
             runs k of each MoE layer's X experts: a device that routes t tokens reads at
             most min(X, t·k) experts, ``generate.experts.decode_experts_read``, the
             formula ``aot.generate`` uses too: the Mosaic grouped matmul on Hopper reads the
             weights of the groups that have rows; XLA's ``ragged_dot`` rewrite would read all
             X, ``kernels.grouped_matmul``) and the whole cache. The combine's collectives
             (kilobytes) and kernel launches are not counted.
"""

import dataclasses

from jax.sharding import AbstractMesh

from ulysses_jax.generate.cache import plan_cache
from ulysses_jax.generate.experts import decode_experts_read
from ulysses_jax.gpus import Gpu
from ulysses_jax.mesh import AXES, RING_AXES
from ulysses_jax.metrics import flops_per_token
from ulysses_jax.models.config import LlamaConfig
from ulysses_jax.plan import comm, moe
from ulysses_jax.plan.hardware import Hardware
from ulysses_jax.plan.model import DTYPE_BYTES, Layout, Model

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GenerationQuestion:
  """``batch`` prompts of ``prompt_len`` tokens and ``max_new_tokens`` new ones, prefilled in
  chunks of ``chunk_len`` (None: one pass), on a ``data`` x ``seq`` x ``ring`` mesh of
  ``nodes`` NVLink domains, in ``dtype``."""
  prompt_len: int
  data: int = 1
  seq: int = 1
  ring: int = 1
  batch: int = 1
  max_new_tokens: int = 128
  chunk_len: int | None = None
  nodes: int = 1
  dtype: str = "bfloat16"

  def __post_init__(self):
    for name in ("prompt_len", "data", "seq", "ring", "batch", "max_new_tokens", "nodes"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if self.dtype not in DTYPE_BYTES:
      raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}.")


def abstract_mesh(data: int, seq: int, ring: int) -> AbstractMesh:
  """The mesh ``make_mesh(data, seq, ring)`` builds, without devices (no ``ring`` axis when
  ring is 1)."""
  if ring == 1:
    return AbstractMesh((data, seq), AXES)
  return AbstractMesh((data, ring, seq), RING_AXES)


def predict_generation(config: LlamaConfig, question: GenerationQuestion, gpu: Gpu) -> dict:
  """Bytes per device and seconds of ``question``'s generation with ``config`` on ``gpu``s
  (the module docstring's model), JSON-ready."""
  q = question
  c = DTYPE_BYTES[q.dtype]
  model = Model.from_config(config)
  n = q.data * q.seq * q.ring
  layout = plan_cache(abstract_mesh(q.data, q.seq, q.ring), batch=q.batch,
                      prompt_len=q.prompt_len, max_new_tokens=q.max_new_tokens,
                      kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=q.dtype,
                      layer_windows=config.layer_windows(), chunk_len=q.chunk_len)
  cache = layout.bytes_per_device() + layout.positions_bytes_per_device()
  weights = c * model.params
  chunk_tokens = layout.batch // q.data * layout.chunk_len // (q.seq * q.ring)
  working = chunk_tokens * _forward_working_per_token(model, c, layout.batch // q.data,
                                                      chunk_tokens)
  hardware = Hardware.of(gpu)
  prefill = _prefill_seconds(config, model, q, layout, gpu, hardware)
  decode_read = _decode_weight_bytes(config, model, c, layout) + cache
  return {
      "question": dataclasses.asdict(q), "devices": n, "gpu": gpu.name,
      "budget_bytes": gpu.budget_bytes,
      "cache_bytes_per_device": layout.bytes_per_device(),
      "cache_positions_bytes_per_device": layout.positions_bytes_per_device(),
      "weights_bytes_per_device": weights,
      "prefill_working_bytes": working,
      "prefill_bytes_per_device": weights + cache + working,
      "decode_bytes_per_device": weights + cache,
      "fits": weights + cache + working <= gpu.budget_bytes,
      "prefill_chunks": layout.chunks,
      **prefill,
      "decode_bytes_read": decode_read,
      "decode_roofline_s": decode_read / gpu.memory_bandwidth,
      "decode_achieved_s": decode_read / hardware.hbm_bw,
  }


def _forward_working_per_token(model: Model, c: int, rows: int, tokens: int) -> float:
  """Bytes per prompt token of one layer's forward at its peak, the MLP (docstring)."""
  e = model.hidden_dim
  tile = min(tokens, rows * model.mlp_chunk) if model.mlp_chunk else tokens
  dense = c * (2 * model.mlp_dim * tile / tokens + 3 * e)
  if not model.moe_layers:
    return dense
  experts = (c * model.experts_per_token * (2 * e + 3 * model.expert_mlp_dim) * tile / tokens
             + 8 * model.num_experts + c * 3 * e)
  return max(experts, dense if model.moe_layers < model.num_layers else 0)


def _prefill_seconds(config, model, q, layout, gpu, hardware) -> dict:
  """The prefill's compute and collectives per device, all passes: at peak (the roofline
  ``aot.generate`` applies to the compiled program) and at the achieved rates."""
  n = q.data * q.seq * q.ring
  flops = flops_per_token(config, layout.prompt_len) / 3 * layout.prompt_len * layout.batch / n
  plan_layout = Layout(q.data, q.seq, q.ring, remat="none")
  traffic = {}
  for window in model.windows():
    for name, nbytes in comm.layer_traffic(model, plan_layout, window,
                                           seq_len=layout.prompt_len, batch=layout.batch,
                                           dtype=q.dtype, forward_passes=1,
                                           backward=False).items():
      traffic[name] = traffic.get(name, 0.0) + nbytes
  all_to_all, ring = traffic.get("all_to_all", 0.0), traffic.get("ring", 0.0)
  across = gpu.network_bandwidth if q.nodes > 1 else gpu.nvlink_bandwidth
  across_achieved = hardware.inter_bw if q.nodes > 1 else hardware.intra_bw
  return {"prefill_flops_per_device": flops, "prefill_all_to_all_bytes": all_to_all,
          "prefill_ring_bytes": ring,
          "prefill_roofline_s": flops / gpu.bf16_flops + all_to_all / gpu.nvlink_bandwidth
                                + ring / across,
          "prefill_achieved_s": flops / hardware.flops + all_to_all / hardware.intra_bw
                                + ring / across_achieved}


def _decode_weight_bytes(config: LlamaConfig, model: Model, c: int, layout) -> float:
  """Weight bytes a decode step reads per device: all, less the experts no token of the
  device routes to (``generate.experts.decode_experts_read``)."""
  if not model.moe_layers:
    return c * model.params
  unread = model.num_experts - decode_experts_read(config, layout)
  per_expert = moe.inactive_params(model) / (model.num_experts - model.experts_per_token)
  return c * (model.params - model.moe_layers * unread * per_expert)


def format_generation_plan(r: dict) -> str:
  """The prediction as the command line prints it."""
  q = r["question"]
  gib = lambda name: f"{r[name] / GIB:.2f} GiB"
  mesh = f"data {q['data']} x seq {q['seq']} x ring {q['ring']}"
  return "\n".join([
      f"generation: {q['batch']} x {q['prompt_len']:,} prompt tokens + {q['max_new_tokens']} "
      f"new on {r['devices']} x {r['gpu']} ({mesh}), {q['dtype']}; predicted, not compiled",
      f"KV cache: {gib('cache_bytes_per_device')} per device (+ "
      f"{gib('cache_positions_bytes_per_device')} of slot positions); weights "
      f"{gib('weights_bytes_per_device')} (replicated)",
      f"prefill: {gib('prefill_bytes_per_device')} per device (working set "
      f"{gib('prefill_working_bytes')}), {r['prefill_chunks']} pass(es); decode: "
      f"{gib('decode_bytes_per_device')}; budget {gib('budget_bytes')}: "
      + ("fits" if r["fits"] else "DOES NOT FIT"),
      f"PREDICTED prefill: {r['prefill_roofline_s']:.1f} s at peak rates (the bound aot "
      f"--generate gives), {r['prefill_achieved_s']:.1f} s at the planner's achieved rates",
      f"PREDICTED decode: {r['decode_roofline_s'] * 1e3:.2f} ms per token at peak HBM "
      f"bandwidth ({r['decode_bytes_read'] / GIB:.2f} GiB read), "
      f"{r['decode_achieved_s'] * 1e3:.2f} ms at the achieved rate"])
