"""Attention sinks (gpt-oss): the dense reference against transformers and float64 numpy, the
choice of backend, bad inputs, and the parameter. Every attention path is compared with the
dense reference with sinks in its own tests (test_ulysses, test_ring, test_chunked,
test_flash_attention, test_flash_hopper, test_module)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh

from attention_cases import large_sinks, mesh_of, random_inputs
from ulysses_jax import optimizer
from ulysses_jax.attention import backends
from ulysses_jax.attention.chunked import chunked_attention
from ulysses_jax.attention.module import UlyssesAttention
from ulysses_jax.attention.reference import attention_mask, dense_attention
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.hf.config import model_type_of
from ulysses_jax.kernels.flash_attention import flash_attention
from ulysses_jax.mesh import DATA, SEQ
from ulysses_jax.models.llama import Llama, LlamaConfig

H100 = "NVIDIA H100 80GB HBM3"


def _dense_vjp(q, k, v, sinks, d_out, **mask):
  """(out, dq, dk, dv, dsinks) of dense_attention with sinks (float32)."""
  def run(q, k, v, sinks, d_out):
    out, vjp = jax.vjp(lambda q, k, v, s: dense_attention(q, k, v, sinks=s, **mask), q, k, v,
                       sinks)
    return (out, *vjp(d_out))
  return jax.jit(run)(q, k, v, sinks, d_out)


@pytest.mark.slow  # importing torch and transformers alone takes ~10 s on CI
def test_dense_reference_matches_transformers_gpt_oss_eager_attention():
  """``dense_attention(sinks=...)`` against transformers' ``GptOssAttention`` eager path
  (``eager_attention_forward``, the sink a column appended to the scaled and masked scores,
  dropped after the softmax) in float64 torch: output and dq, dk, dv, d(sinks), with GQA,
  packed segments and a sliding window."""
  torch = pytest.importorskip("torch")
  gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
  q, k, v, d_out, segment_ids = random_inputs(0, 2, 24, 6, 2, 8, num_segments=3)
  sinks = large_sinks(6)
  mask = dict(causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
              sliding_window=7)
  ours = _dense_vjp(q, k, v, sinks, d_out, **mask)

  as_torch = lambda x: torch.tensor(np.asarray(x, np.float64), requires_grad=True)
  tq, tk, tv, ts = (as_torch(x) for x in (q, k, v, sinks))
  visible = torch.tensor(np.asarray(attention_mask(24, 24, **mask)))[:, None]
  additive = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(
      ~visible, torch.finfo(torch.float64).min)  # transformers' additive mask
  module = types.SimpleNamespace(sinks=ts, num_key_value_groups=3, training=False)
  out, _ = gpt_oss.eager_attention_forward(
      module, tq.transpose(1, 2), tk.transpose(1, 2), tv.transpose(1, 2), additive,
      scaling=8 ** -0.5)
  out.backward(torch.tensor(np.asarray(d_out, np.float64)))
  theirs = [out.detach().numpy(), *(x.grad.numpy() for x in (tq, tk, tv, ts))]
  for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), ours, theirs):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5, err_msg=name)
  no_sinks = dense_attention(q, k, v, **mask)
  assert np.max(np.abs(np.asarray(no_sinks - ours[0]))) > 0.3  # the sinks matter here


def test_dense_reference_matches_the_float64_formula():
  """The sink as out · σ(lse - s) in float64 numpy, lse = logaddexp(lse, s), and d(sinks) =
  -Σ p_sink · rowsum(d_out · out); rows that see no key (segment 7 has no keys) give 0, lse s,
  and finite gradients."""
  q, k, v, d_out, _ = random_inputs(1, 1, 16, 4, 2, 8)
  sinks = large_sinks(4, seed=1)
  q_ids = jnp.zeros((1, 16), jnp.int32).at[0, 5].set(7)
  kv_ids = jnp.zeros((1, 16), jnp.int32)
  mask = dict(causal=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids)

  @jax.jit
  def run(q, k, v, sinks, d_out):
    (out, lse), vjp = jax.vjp(lambda q, k, v, s: dense_attention(q, k, v, sinks=s,
                                                                 return_lse=True, **mask),
                              q, k, v, sinks)
    return out, lse, vjp((d_out, jnp.zeros_like(lse)))
  out, lse, grads = run(q, k, v, sinks, d_out)

  f64 = lambda x: np.asarray(x, np.float64)
  q64, k64, v64, s64 = f64(q), f64(np.repeat(k, 2, axis=2)), f64(np.repeat(v, 2, axis=2)), f64(
      sinks)
  scores = np.einsum("bqhd,bkhd->bhqk", q64, k64) / np.sqrt(8)
  visible = np.asarray(attention_mask(16, 16, **mask))[:, None]
  scores = np.where(visible, scores, -np.inf)
  exps = np.exp(scores - np.max(scores, -1, keepdims=True, initial=-1e300))
  row_sum = exps.sum(-1, keepdims=True)
  plain = np.einsum("bhqk,bkhd->bqhd", exps / np.where(row_sum == 0, 1, row_sum), v64)
  with np.errstate(divide="ignore"):
    plain_lse = np.where(row_sum[..., 0] == 0, -np.inf,
                         np.log(row_sum[..., 0]) + np.max(scores, -1, initial=-1e300))
  weight = 1 / (1 + np.exp(s64[None, :, None] - plain_lse))  # σ(lse - s)
  want_out = plain * weight.transpose(0, 2, 1)[..., None]
  want_lse = np.logaddexp(plain_lse, s64[None, :, None])
  p_sink = np.exp(s64[None, :, None] - want_lse)
  want_dsinks = -np.sum(p_sink * np.einsum("bqhd,bqhd->bhq", f64(d_out), want_out), axis=(0, 2))

  np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grads[3]), want_dsinks, rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(out[0, 5]) == 0)
  np.testing.assert_allclose(np.asarray(lse[0, :, 5]), np.asarray(sinks))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
  assert np.all(np.asarray(grads[0][0, 5]) == 0)


def _on_h100(monkeypatch):
  """A mesh of (abstract) H100s, as ``ulysses_jax.aot`` compiles for."""
  from ulysses_jax.kernels import target as target_lib
  monkeypatch.setitem(target_lib._CAPABILITIES, H100, 9.0)
  device = AbstractDevice(device_kind=H100, num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(AbstractMesh((1, 8), (DATA, SEQ), abstract_device=device))


def test_auto_skips_cudnn_for_sinks_and_says_why(monkeypatch):
  """Head dim 96 leaves cuDNN first in line on (simulated) H100s; with sinks "auto" passes it
  over for the XLA attention, naming the reason, and asking for cuDNN is an error."""
  case = dict(dtype=jnp.bfloat16, head_dim=96, num_q_heads=8, num_kv_heads=2, causal=True,
              segment_ids_given=False)
  with _on_h100(monkeypatch):
    without = backends.choose_backend(**case)
    with_sinks = backends.choose_backend(**case, sinks_given=True)
    with pytest.raises(ValueError, match=r"backend='cudnn' does not support attention sinks: "
                                         r"JAX's dot_product_attention takes no sinks"):
      backends.resolve_backend("cudnn", **case, sinks_given=True)
  assert without.backend == "cudnn"
  assert (with_sinks.backend, with_sinks.fallbacks) == ("xla", ())
  assert ", with sinks on NVIDIA H100" in with_sinks.reason
  assert ("not cuDNN's attention: does not support attention sinks: JAX's dot_product_attention "
          "takes no sinks, and its backward drops the cotangent of the log-sum-exp it returns"
          in with_sinks.reason)


def test_bad_sinks_are_clear_errors():
  q, k, v, _, _ = random_inputs(2, 1, 16, 4, 2, 16)
  expected = r"sinks must be a float32 array of shape \[query heads\] = \(4,\)"
  for call, where in (
      (lambda s: chunked_attention(q, k, v, sinks=s), "chunked_attention"),
      (lambda s: flash_attention(q, k, v, sinks=s), "flash_attention")):
    for sinks in (jnp.zeros(2), jnp.zeros((1, 4)), jnp.zeros(4, jnp.int32)):
      with pytest.raises(ValueError, match=f"{where}: {expected}"):
        call(sinks)
  with pytest.raises(ValueError, match=r"backend='cudnn' JAX's dot_product_attention takes no "
                                       r"sinks.*use backend='pallas_mosaic', 'pallas' or 'xla'"):
    backends.local_attention("cudnn", q, k, v, causal=True, segment_ids=None, scale=None,
                             sinks=jnp.zeros(4))
  with pytest.raises(ValueError, match=r"attention_sinks with backend='cudnn'"):
    UlyssesAttention(32, 4, mesh=mesh_of(1, 1), attention_sinks=True, backend="cudnn",
                     rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match=r"attention_sinks needs an attention_backend other than "
                                        r"'cudnn'"):
    LlamaConfig(preset="tiny", attention_sinks=True, attention_backend="cudnn")
  with pytest.raises(ConfigError, match=r"attention_sinks: of the Hugging Face architectures "
                                        r"only gpt_oss has them"):
    model_type_of(LlamaConfig(preset="tiny", attention_sinks=True))


def test_sinks_are_a_replicated_parameter_per_query_head_without_weight_decay():
  """[Hq] float32 per layer, replicated (Hq numbers), normal(0, init_std) as transformers
  initialises them, and no weight decay (a logit per head, like a bias); LlamaConfig's
  attention_sinks gives every layer its own."""
  attn = UlyssesAttention(32, 8, num_kv_heads=2, mesh=mesh_of(2, 4), attention_sinks=True,
                          init_std=0.5, rngs=nnx.Rngs(0))
  sinks = attn.sinks[...]
  assert sinks.shape == (8,) and sinks.dtype == jnp.float32
  assert sinks.sharding.is_fully_replicated
  assert 0.1 < float(jnp.std(sinks)) < 1.5
  decay = optimizer._decay_mask(nnx.state(attn, nnx.Param))
  assert not decay["sinks"].get_value() and decay["q_proj"]["kernel"].get_value()
  with_sinks = nnx.eval_shape(lambda: Llama(LlamaConfig(preset="tiny-gqa", attention_sinks=True),
                                            mesh=mesh_of(1, 1), rngs=nnx.Rngs(0)))
  assert with_sinks.layers.attn.sinks.shape == (2, 4)  # [L, Hq]
