"""``UlyssesAttention``: a Flax NNX self-attention layer around ``ulysses_attention``.

Drop it into any NNX model whose activations are ``[B, S, E]`` sharded ``(data, seq)``:

    attn = UlyssesAttention(embed_dim=512, num_heads=8, num_kv_heads=2, mesh=mesh,
                            rngs=nnx.Rngs(0))
    y_BSE = attn(x_BSE, positions=positions_BS, segment_ids=segment_ids_BS)

Inside: q/k/v projections (token-local, on the sequence shards), optional qk-norm, RoPE
from the global ``positions`` (per-call base and scaling for models whose layer types differ),
the two Ulysses all-to-alls around exact local attention,
and the output projection. GQA when ``num_kv_heads < num_heads``.

Parameters (Hugging Face ``*_proj.weight`` is the transposed, reshaped kernel):
``q_proj.kernel [E, Hq, D]``, ``k_proj.kernel / v_proj.kernel [E, Hkv, D]`` (+ ``bias``
``[H, D]`` with ``qkv_bias``), ``o_proj.kernel [Hq, D, E]`` (+ ``bias [E]`` with
``out_bias``), ``q_norm.scale / k_norm.scale [D]`` with ``qk_norm`` (the ``w`` of a factor
``1 + w`` with ``norm_offset_one``), ``sinks [Hq]`` with ``attention_sinks`` (gpt-oss'
``self_attn.sinks``, replicated: Hq numbers). Kernels are FSDP-sharded along E over every
device (``rules``), from the moment they are created (``ulysses_jax.layers.param``).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from ulysses_jax import rope, sharding
from ulysses_jax.attention import backends
from ulysses_jax.attention.common import check_head_chunks
from ulysses_jax.attention.hybrid import ulysses_attention
from ulysses_jax.kernels.variants import check_sliding_window
from ulysses_jax.layers import Dense, RMSNorm, contract, param

# Names of activations that remat policies can save or offload (models.llama.REMAT_POLICIES).
QKV = "qkv"
ATTN_OUT = "attn_out"

_ACT = ("act_batch", "act_seq", "act_heads", "act_head_dim")


class _Unset:
  """The type of ``_CONSTRUCTOR_VALUE``: "not given, use the constructor's value"."""


_CONSTRUCTOR_VALUE = _Unset()


class UlyssesAttention(nnx.Module):
  """Multi-head (or grouped-query) causal self-attention over a sequence-sharded input.

  Args:
    embed_dim: E, the model width.
    num_heads: Hq query heads.
    num_kv_heads: Hkv key/value heads (default Hq); must divide Hq.
    head_dim: D (default E // Hq).
    mesh: a ``("data", "seq")`` mesh (``ulysses_jax.make_mesh``).
    causal: causal mask over positions in the (packed) row.
    sliding_window: None, or W >= 1 with ``causal`` (transformers' definition): the token at
      position p attends to those at p' with ``0 <= p - p' < W`` (itself and the W - 1 before
      it). ``__call__`` takes a per-call override.
    rope_theta, rope_scaling: rotary base and optional ``rope.RopeScaling``; ``__call__``
      takes per-call overrides (Gemma 3's sliding layers rotate with another base).
    qk_norm: RMSNorm over D on q and k before RoPE (Qwen3 / OLMo-2 style).
    norm_offset_one: the q/k norms multiply by ``1 + scale`` (Gemma 3).
    attention_scale: the score scale, ``softmax(scale * q.k)``; None: ``head_dim ** -0.5``
      (Gemma 3: ``query_pre_attn_scalar ** -0.5``).
    qkv_bias: biases on the q/k/v projections (Qwen2).
    out_bias: a bias on the output projection (gpt-oss).
    attention_sinks: a learnable sink logit per query head, one more column of every row's
      softmax with no value (gpt-oss; ``ulysses_jax.kernels.variants``); initialised normal(0,
      ``init_std``) as transformers' ``GptOssPreTrainedModel`` does. Every backend but
      ``"cudnn"`` takes them.
    norm_eps: epsilon of the qk-norm.
    backend: local attention backend, one of ``backends.BACKENDS``.
    head_chunks: run the layer over this many chunks of heads one after another (it must
      divide ``num_kv_heads``): projections, RoPE, attention and the output projection of
      Hq/n query heads at a time, each chunk recomputed in the backward pass, so q, k, v and
      the attention output exist for one chunk at a time (a memory saving of about
      (2·Hq + 2·Hkv)·D·(1 - 1/n) elements per token, for one more attention forward in the
      backward pass). Under Ulysses a chunk's heads are spread over the seq axis like all of
      them (``plan_heads``): where P exceeds a chunk's key/value heads they are replicated,
      more all-to-all traffic. The chunks' output projections are summed in the compute
      dtype (n - 1 more roundings in bfloat16). Default 1: the plain layer.
    dtype, param_dtype: compute and parameter dtypes.
    init_std: standard deviation of the normal kernel init.
    rules: logical-axis sharding rules (``ulysses_jax.sharding``).
  """

  def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, mesh: Mesh, causal: bool = True,
               sliding_window: int | None = None,
               rope_theta: float = 10_000.0, rope_scaling: rope.RopeScaling | None = None,
               qk_norm: bool = False, norm_offset_one: bool = False,
               attention_scale: float | None = None, qkv_bias: bool = False,
               out_bias: bool = False,
               attention_sinks: bool = False,
               norm_eps: float = 1e-6, backend: str = "auto", head_chunks: int = 1,
               dtype=jnp.float32, param_dtype=jnp.float32, init_std: float = 0.02,
               rules: sharding.Rules = sharding.DEFAULT_RULES, rngs: nnx.Rngs):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    check_head_chunks(head_chunks, num_kv_heads)
    check_sliding_window(sliding_window, causal)
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                       f"({num_kv_heads}): each key/value head serves num_heads/num_kv_heads "
                       "query heads.")
    if head_dim is None:
      if embed_dim % num_heads:
        raise ValueError(f"embed_dim ({embed_dim}) is not divisible by num_heads "
                         f"({num_heads}); pass head_dim explicitly.")
      head_dim = embed_dim // num_heads
    if attention_scale is not None and not attention_scale > 0:
      raise ValueError(f"attention_scale must be > 0 (or None for head_dim ** -0.5), got "
                       f"{attention_scale}.")
    if backend not in backends.BACKENDS:
      raise ValueError(f"backend must be one of {backends.BACKENDS}, got {backend!r}.")
    if attention_sinks and backend == "cudnn":
      raise ValueError(f"attention_sinks with backend='cudnn': {backends.NO_SINKS_IN_CUDNN}; "
                       "use backend 'auto', 'pallas_mosaic', 'pallas' or 'xla'.")
    e, hq, hkv, d = embed_dim, num_heads, num_kv_heads, head_dim
    dense = dict(mesh=mesh, dtype=dtype, param_dtype=param_dtype, init_std=init_std,
                 rules=rules, rngs=rngs)
    self.q_proj = Dense((e,), (hq, d), axes=("embed", "heads", "head_dim"), use_bias=qkv_bias,
                        **dense)
    self.k_proj = Dense((e,), (hkv, d), axes=("embed", "kv_heads", "head_dim"),
                        use_bias=qkv_bias, **dense)
    self.v_proj = Dense((e,), (hkv, d), axes=("embed", "kv_heads", "head_dim"),
                        use_bias=qkv_bias, **dense)
    self.o_proj = Dense((hq, d), (e,), axes=("heads", "head_dim", "embed"), use_bias=out_bias,
                        **dense)
    norm = dict(mesh=mesh, eps=norm_eps, offset_one=norm_offset_one, dtype=dtype,
                param_dtype=param_dtype, rules=rules)
    self.q_norm = RMSNorm(d, **norm) if qk_norm else None
    self.k_norm = RMSNorm(d, **norm) if qk_norm else None
    self.sinks = (param(init_std * jax.random.normal(rngs.params(), (hq,), param_dtype),
                        ("heads",), mesh=mesh, rules=rules) if attention_sinks else None)
    self.head_dim = d
    self.rope_theta = float(rope_theta)
    self.rope_scaling = rope_scaling
    self.attention_scale = None if attention_scale is None else float(attention_scale)
    self.mesh = mesh
    self.causal = causal
    self.sliding_window = sliding_window
    self.backend = backend
    self.head_chunks = head_chunks
    self.rules = rules

  def __call__(self, x_BSE: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, *, norm=None,
               sliding_window: int | None | _Unset = _CONSTRUCTOR_VALUE,
               rope_theta: float | _Unset = _CONSTRUCTOR_VALUE,
               rope_scaling: rope.RopeScaling | None | _Unset = _CONSTRUCTOR_VALUE) -> jax.Array:
    """``attention(norm(x))``: ``[B, S, E]`` -> ``[B, S, E]``, both sharded ``(data, seq)``.

    ``norm``: a pre-norm (``[B, S, E]`` -> ``[B, S, E]``) or None. With ``head_chunks`` > 1
    each chunk applies it again, so the normalised input never exists whole.

    ``sliding_window``: this call's window (a Python int or None: it shapes the compiled
    program), e.g. per layer of a model that mixes sliding and full attention; default the
    constructor's. ``rope_theta``, ``rope_scaling``: this call's RoPE, default the
    constructor's.

    ``positions``: int ``[B, S]`` global positions (default ``arange(S)``; restart them at
    each packed document). ``segment_ids``: int ``[B, S]`` >= 0, or None for one document.
    """
    given = lambda value, default: default if value is _CONSTRUCTOR_VALUE else value
    sliding_window = given(sliding_window, self.sliding_window)
    rotary = (float(given(rope_theta, self.rope_theta)), given(rope_scaling, self.rope_scaling))
    check_sliding_window(sliding_window, self.causal)
    b, s, _ = x_BSE.shape
    for name, ids in (("positions", positions), ("segment_ids", segment_ids)):
      _check_ids(name, ids, x_BSE.shape)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    norm = norm or (lambda x: x)
    if self.head_chunks == 1:
      y_BSE = self._attend(norm(x_BSE), self._kernels(), positions, segment_ids,
                           sliding_window, rotary, names=True)
    else:
      y_BSE = self._attend_in_chunks(x_BSE, norm, positions, segment_ids, sliding_window,
                                     rotary)
    if self.o_proj.bias is not None:
      y_BSE = y_BSE + self.o_proj.bias[...].astype(y_BSE.dtype)
    return y_BSE

  def _kernels(self) -> dict:
    """Compute-dtype, all-gathered projection kernels and q/k/v biases, and the float32
    sinks (None without)."""
    kernels = {name: getattr(self, name).compute_kernel()
               for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    for name in ("q_proj", "k_proj", "v_proj"):
      bias = getattr(self, name).bias
      kernels[name + "_bias"] = None if bias is None else bias[...].astype(self.q_proj.dtype)
    kernels["sinks"] = self._sinks()
    return kernels

  def _sinks(self) -> jax.Array | None:
    """The float32 sinks ``[Hq]``, or None without."""
    return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

  def _attend(self, x_BSE, kernels, positions, segment_ids, sliding_window, rotary, *,
              names: bool):
    """The layer on the heads ``kernels`` hold: ``[B, S, E]`` -> ``[B, S, E]``; ``rotary``:
    (RoPE base, scaling)."""
    name = checkpoint_name if names else (lambda x, _: x)
    q, k, v = (name(t, QKV) for t in self._project(x_BSE, kernels, positions, rotary))
    out = self._ulysses(q, k, v, segment_ids, sliding_window, kernels["sinks"])
    out = name(self._constrain(out), ATTN_OUT)
    return self._output(out, kernels)

  def _constrain(self, x_BSHD):
    return sharding.constrain(x_BSHD, _ACT, self.mesh, self.rules)

  def _project(self, x_BSE, kernels, positions, rotary):
    """q ``[B, S, Hq, D]``, k and v ``[B, S, Hkv, D]`` in the compute dtype: projected,
    q/k-normed, rotated by ``positions``."""
    x_BSE = x_BSE.astype(self.q_proj.dtype)

    def project(kind):
      y = contract(x_BSE, kernels[kind], 1)
      bias = kernels[kind + "_bias"]
      return self._constrain(y if bias is None else y + bias)

    q, k, v = (project(kind) for kind in ("q_proj", "k_proj", "v_proj"))
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope.inverse_frequencies(self.head_dim, *rotary)
    # YaRN scales cos and sin, so the attention logits by its square (1 for other kinds).
    factor = rope.attention_factor(rotary[1])
    q, k = (rope.apply_rope(t, positions, inv_freq, scale=factor) for t in (q, k))
    return q, k, v

  def _ulysses(self, q, k, v, segment_ids, sliding_window, sinks):
    return ulysses_attention(q, k, v, mesh=self.mesh, causal=self.causal,
                             segment_ids=segment_ids, backend=self.backend,
                             sliding_window=sliding_window, scale=self.attention_scale,
                             sinks=sinks)

  def _output(self, out_BSHD, kernels):
    y_BSE = contract(out_BSHD, kernels["o_proj"], 2)
    return sharding.constrain(y_BSE, ("act_batch", "act_seq", "act_embed"), self.mesh,
                              self.rules)

  # The pieces of the layer, for callers that attend in their own way (ulysses_jax.generate
  # reads and writes a KV cache between them): always over all heads, whatever head_chunks.

  def project_qkv(self, x_BSE: jax.Array, positions: jax.Array, *, norm=None,
                  rope_theta: float | _Unset = _CONSTRUCTOR_VALUE,
                  rope_scaling: rope.RopeScaling | None | _Unset = _CONSTRUCTOR_VALUE):
    """``(q, k, v)`` of ``norm(x)`` as the layer attends with them: q ``[B, S, Hq, D]``, k and
    v ``[B, S, Hkv, D]`` in the compute dtype, q/k-normed and rotated by ``positions`` (int
    ``[B, S]``) with this call's RoPE (YaRN's attention factor included), sharded like x."""
    _check_ids("positions", positions, x_BSE.shape)
    given = lambda value, default: default if value is _CONSTRUCTOR_VALUE else value
    rotary = (float(given(rope_theta, self.rope_theta)), given(rope_scaling, self.rope_scaling))
    return self._project((norm or (lambda x: x))(x_BSE), self._kernels(), positions, rotary)

  def attend(self, q_BSHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
             segment_ids: jax.Array | None = None, *,
             sliding_window: int | None | _Unset = _CONSTRUCTOR_VALUE) -> jax.Array:
    """The layer's sequence-parallel attention of ``project_qkv``'s outputs: ``[B, S, Hq, D]``,
    sharded like q."""
    window = self.sliding_window if sliding_window is _CONSTRUCTOR_VALUE else sliding_window
    check_sliding_window(window, self.causal)
    return self._constrain(self._ulysses(q_BSHD, k_BSKD, v_BSKD, segment_ids, window,
                                         self._sinks()))

  def project_out(self, out_BSHD: jax.Array) -> jax.Array:
    """The output projection (its bias too, with ``out_bias``): attention output
    ``[B, S, Hq, D]`` -> ``[B, S, E]``."""
    y_BSE = self._output(out_BSHD.astype(self.q_proj.dtype),
                         {"o_proj": self.o_proj.compute_kernel()})
    if self.o_proj.bias is not None:
      y_BSE = y_BSE + self.o_proj.bias[...].astype(y_BSE.dtype)
    return y_BSE

  def sink_logits(self) -> jax.Array | None:
    """The float32 sink logits ``[Hq]`` (``attention_sinks``), or None without."""
    return self._sinks()

  def attention_scale_or_default(self) -> float:
    """The score scale this layer applies: ``attention_scale``, or ``head_dim ** -0.5``."""
    return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

  def _attend_in_chunks(self, x_BSE, norm, positions, segment_ids, sliding_window, rotary):
    """``_attend(norm(x))`` over ``head_chunks`` chunks of heads in a ``lax.scan``, summing
    the chunks' output projections; each chunk (its norm too) is recomputed in the backward
    pass."""
    n = self.head_chunks
    kernels = self._kernels()
    # Query head h belongs to key/value head h // (Hq/Hkv): splitting both head axes into n
    # contiguous chunks keeps each query group with its key/value head.
    heads_axis = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 0, "q_proj_bias": 0,
                  "k_proj_bias": 0, "v_proj_bias": 0, "sinks": 0}
    chunked = {name: None if w is None else jnp.moveaxis(
        w.reshape(*w.shape[:heads_axis[name]], n, -1, *w.shape[heads_axis[name] + 1:]),
        heads_axis[name], 0) for name, w in kernels.items()}

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(y_BSE, chunk_kernels):
      return y_BSE + self._attend(norm(x_BSE), chunk_kernels, positions, segment_ids,
                                  sliding_window, rotary, names=False)

    y_BSE = jnp.zeros(x_BSE.shape, self.q_proj.dtype)
    y_BSE = sharding.constrain(y_BSE, ("act_batch", "act_seq", "act_embed"), self.mesh,
                               self.rules)
    return jax.lax.scan(lambda y, w: (one_chunk(y, w), None), y_BSE, chunked)[0]


def _check_ids(name: str, ids, x_shape):
  """Raises unless ``ids`` is None or an integer ``[B, S]`` array for ``x`` ``[B, S, E]``."""
  if ids is None:
    return
  expected = tuple(x_shape[:2])
  shape, dtype = tuple(jnp.shape(ids)), jnp.result_type(ids)
  if shape != expected or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(
        f"UlyssesAttention: {name} must be an integer [batch, seq] array of shape {expected} "
        f"(x is [B, S, E] = {tuple(x_shape)}), got {dtype} {shape}; give one value per token, "
        f"e.g. jnp.broadcast_to(jnp.arange({expected[1]}), {expected}) for positions.")
