"""Hugging Face checkpoints <-> ``Llama``: ``load_llama`` and ``save_llama``.

Reads Hugging Face checkpoint directories (``config.json`` plus ``model.safetensors``, or
shards listed in ``model.safetensors.index.json``) of the model types ``llama``, ``mistral``,
``ministral``, ``qwen2``, ``qwen3`` and ``gemma3_text`` (``ulysses_jax.hf.config`` translates
their configs), and writes directories that ``transformers`` loads. Needs the optional extra
``hf`` (``pip install 'ulysses_jax[hf]'``) for ``safetensors``; torch is never imported.

Parameter mapping; ``i`` is the layer, and our layer parameters stack the L layers on axis 0
(``layers.*`` has a leading ``[L]``). Linear kernels are the transposed ``weight``, reshaped:

  ===================================================  =====================================
  Hugging Face                                         ulysses_jax
  ===================================================  =====================================
  model.embed_tokens.weight       [V, E]               embedding               [V, E]
  model.layers.i.input_layernorm.weight  [E]           layers.attn_norm.scale  [L, E]
  ...self_attn.q_proj.weight      [Hq*D, E]  (.T)      layers.attn.q_proj.kernel [L, E, Hq, D]
  ...self_attn.{k,v}_proj.weight  [Hkv*D, E] (.T)      layers.attn.{k,v}_proj.kernel
                                                         [L, E, Hkv, D]
  ...self_attn.{q,k,v}_proj.bias  [H*D]                layers.attn.{q,k,v}_proj.bias [L, H, D]
  ...self_attn.o_proj.weight      [E, Hq*D]  (.T)      layers.attn.o_proj.kernel [L, Hq, D, E]
  ...self_attn.{q,k}_norm.weight  [D]                  layers.attn.{q,k}_norm.scale [L, D]
  ...self_attn.sinks              [Hq]                 layers.attn.sinks [L, Hq]  (gpt_oss)
  model.layers.i.post_attention_layernorm.weight [E]   layers.mlp_norm.scale   [L, E]
    (Gemma 3: ...pre_feedforward_layernorm.weight)
  (Gemma 3) ...post_attention_layernorm.weight [E]     layers.attn_post_norm.scale [L, E]
  (Gemma 3) ...post_feedforward_layernorm.weight [E]   layers.mlp_post_norm.scale [L, E]
  ...mlp.{gate,up}_proj.weight    [F, E]     (.T)      layers.mlp.{gate,up}_proj.kernel [L, E, F]
  ...mlp.down_proj.weight         [E, F]     (.T)      layers.mlp.down_proj.kernel [L, F, E]
  model.norm.weight               [E]                  final_norm.scale        [E]
  lm_head.weight                  [V, E]     (.T)      lm_head.kernel [E, V] (absent if tied)
  ===================================================  =====================================

RoPE needs no permutation: ``ulysses_jax.rope`` uses Hugging Face's rotate-half layout.
"""

import contextlib
import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from ulysses_jax import sharding
from ulysses_jax.hf import moe as hf_moe
from ulysses_jax.hf.config import (  # noqa: F401  (public here too)
    ARCHITECTURES, config_from_hf, config_to_hf, model_type_of, read_config,
    rope_scaling_from_hf)
from ulysses_jax.mesh import make_mesh
from ulysses_jax.models.llama import Llama, LlamaConfig

_RENAME = {"embedding": "embed_tokens", "final_norm": "norm", "attn": "self_attn",
           "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
# With post-norms (Gemma 3) "post_attention" names the norm after attention, not before the MLP.
_RENAME_POST_NORMS = {**_RENAME, "mlp_norm": "pre_feedforward_layernorm",
                      "attn_post_norm": "post_attention_layernorm",
                      "mlp_post_norm": "post_feedforward_layernorm"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints store


def _safetensors():
  try:
    import safetensors.numpy
  except ImportError as e:
    raise ImportError("ulysses_jax.hf.weights needs safetensors: pip install "
                      "'ulysses_jax[hf]'.") from e
  return safetensors


def build_llama(config: LlamaConfig, mesh: Mesh, read, *,
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> Llama:
  """A ``Llama`` of ``config`` on ``mesh`` whose parameters come from ``read``.

  ``read(path, shape)``, for every parameter (``path`` a tuple such as ``("layers", "attn",
  "q_proj", "kernel")``, ``shape`` its global shape), returns ``shard(index)``: the host
  value (``config.param_dtype``) of the slice ``index`` of the parameter. Each device's FSDP
  shard is built from its own slice (``jax.make_array_from_callback``): a process reads only
  what its devices hold, and no full parameter needs to exist on one device.
  """
  graphdef, abstract = nnx.split(
      nnx.eval_shape(lambda: Llama(config, mesh=mesh, rules=rules, rngs=nnx.Rngs(0))))
  shardings = traverse_util.flatten_dict(
      nnx.to_pure_dict(sharding.tree_shardings(abstract, mesh, rules)))
  values = {key: jax.make_array_from_callback(value.shape, shardings[key],
                                              read(key, value.shape))
            for key, value in traverse_util.flatten_dict(nnx.to_pure_dict(abstract)).items()}
  nnx.replace_by_pure_dict(abstract, traverse_util.unflatten_dict(values))
  return nnx.merge(graphdef, abstract)


def _hf_name(path: tuple[str, ...], layer: int | None, config: LlamaConfig) -> str:
  """Hugging Face name of parameter ``path`` (of layer ``layer`` for stacked ones)."""
  if path[0] == "lm_head":
    return "lm_head.weight"
  rename = _RENAME_POST_NORMS if config.post_norms else _RENAME
  modules = [rename.get(p, p) for p in path if p not in ("layers", "kernel", "scale", "bias")]
  prefix = "model." if layer is None else f"model.layers.{layer}."
  if path[-1] == "sinks":  # gpt-oss's self_attn.sinks [Hq], a tensor of its own
    return prefix + ".".join(modules)
  return prefix + ".".join(modules) + (".bias" if path[-1] == "bias" else ".weight")


def _num_in(path: tuple[str, ...]) -> int | None:
  """Input dims of a kernel (its HF weight is ``[prod(out), prod(in)]``); 0 for a bias
  (flattened); None when the layouts agree."""
  if path[-1] == "kernel":
    return 2 if path[-2] == "o_proj" else 1
  return 0 if path[-1] == "bias" else None


def _hf_shape(shape, num_in) -> tuple[int, ...]:
  if num_in is None:
    return tuple(shape)
  if num_in == 0:
    return (math.prod(shape),)
  return (math.prod(shape[num_in:]), math.prod(shape[:num_in]))


def _to_hf(x: np.ndarray, num_in) -> np.ndarray:
  if num_in is None:
    return x
  if num_in == 0:
    return x.reshape(-1)
  return np.ascontiguousarray(x.reshape(math.prod(x.shape[:num_in]), -1).T)


class _Checkpoint:
  """The tensors of a safetensors checkpoint directory by Hugging Face name, read lazily."""

  def __init__(self, path: pathlib.Path, stack: contextlib.ExitStack):
    index = path / "model.safetensors.index.json"
    if index.exists():
      files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
      files = ["model.safetensors"]
    else:
      raise FileNotFoundError(f"{path} has neither model.safetensors nor "
                              "model.safetensors.index.json.")
    safe_open = _safetensors().safe_open
    self.handles = {}
    for file in files:
      handle = stack.enter_context(safe_open(str(path / file), framework="np"))
      self.handles.update((name, handle) for name in handle.keys())
    self.unused = {n for n in self.handles if not n.endswith(_IGNORED_SUFFIXES)}

  def __contains__(self, name: str) -> bool:
    return name in self.handles

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``name``, checked to have ``shape`` (what config.json implies)."""
    if name not in self.handles:
      raise ValueError(f"checkpoint has no tensor {name!r}, which config.json implies.")
    tensor = self.handles[name].get_tensor(name)
    if tensor.shape != shape:
      raise ValueError(f"{name}: config.json implies shape {shape}, the checkpoint has "
                       f"{tensor.shape}.")
    self.unused.discard(name)
    return tensor


def _unused_in_layer(path, layer: int, config) -> bool:
  """Whether layer ``layer`` leaves our parameter ``path`` unused (zero): a model mixing dense
  and MoE layers holds both MLPs in every layer (``models.llama.DecoderLayer``)."""
  kind = {"mlp": False, "moe": True}.get(path[1]) if path[0] == "layers" else None
  return kind is not None and config.sparse_layers()[layer] != kind


def _read_param(checkpoint: _Checkpoint, config, path, shape, dtype) -> np.ndarray:
  """Host value of our parameter ``path`` (``[L, ...]`` stacked for ``layers.*``)."""
  num_in = _num_in(path)
  stacked = path[0] == "layers"
  one_shape = shape[1:] if stacked else shape
  out = np.empty(shape, dtype)
  model_type = model_type_of(config) if path[:2] == ("layers", "moe") else None
  for i in range(shape[0]) if stacked else (None,):
    if stacked and _unused_in_layer(path, i, config):
      out[i] = 0
      continue
    if model_type is not None:
      out[i] = hf_moe.read_expert_param(checkpoint, config, model_type, i, path[2])
      continue
    tensor = checkpoint.get(_hf_name(path, i, config), _hf_shape(one_shape, num_in))
    value = tensor.T.reshape(one_shape) if num_in else tensor.reshape(one_shape)
    out[(i,) if stacked else ()] = value
  return out


def load_llama(path: str | os.PathLike, mesh: Mesh, *, dtype: str | None = None,
               param_dtype: str = "float32", rules: sharding.Rules = sharding.DEFAULT_RULES,
               **config_overrides) -> Llama:
  """A ``Llama`` with the weights of a Hugging Face checkpoint directory, sharded on ``mesh``.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (or sharded safetensors
      with ``model.safetensors.index.json``).
    mesh: a ``("data", "seq")`` mesh (``make_mesh``).
    dtype: compute dtype; None means ``param_dtype``.
    param_dtype: storage dtype the weights are converted to.
    rules: logical-axis sharding rules.
    **config_overrides: other ``LlamaConfig`` fields (``remat_policy``, ``attention_backend``,
      ``mlp_chunk``, ...).

  Parameters go one at a time from the memory-mapped files to their FSDP shards; the host
  holds at most one (layer-stacked) parameter.
  """
  config = read_config(path).replace(dtype=dtype or param_dtype, param_dtype=param_dtype,
                                     **config_overrides)
  with contextlib.ExitStack() as stack:
    checkpoint = _Checkpoint(pathlib.Path(path), stack)

    def read(key, shape):
      host = _read_param(checkpoint, config, key, shape, jnp.dtype(param_dtype))
      return lambda index: host[index]

    model = build_llama(config, mesh, read, rules=rules)
    unused = checkpoint.unused - ({"lm_head.weight"} if config.tie_embeddings else set())
  if unused:
    raise ValueError(f"checkpoint tensors that the model has no place for: "
                     f"{sorted(unused)[:10]}{' ...' if len(unused) > 10 else ''}.")
  return model


def _host(x: jax.Array) -> np.ndarray:
  return np.asarray(x if x.is_fully_addressable else
                    multihost_utils.process_allgather(x, tiled=True))


SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _write_safetensors(file, tensors):
  """Streams ``tensors`` (name, shape, dtype, value thunk) into a safetensors ``file`` (None:
  only evaluate the thunks, for processes that gather but do not write). The header is
  built from the shapes, so the host holds one tensor at a time."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape, dtype, _ in tensors:
    nbytes = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": SAFETENSORS_DTYPES[dtype.name], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)
  with contextlib.ExitStack() as stack:
    f = None if file is None else stack.enter_context(open(file, "wb"))
    if f:
      f.write(len(encoded).to_bytes(8, "little") + encoded)
    for name, shape, dtype, value in tensors:
      x = np.ascontiguousarray(value())
      if x.shape != tuple(shape) or x.dtype != dtype:
        raise AssertionError(f"{name}: expected {dtype} {tuple(shape)}, got {x.dtype} {x.shape}")
      if f:
        f.write(x.reshape(-1).view(np.uint8).data)


def write_checkpoint(config: LlamaConfig, read, path, *, dtype: str, write: bool = True,
                     max_shard_bytes: int = 5 * 2**30, max_read_bytes: int = 2**30) -> None:
  """Writes a Hugging Face checkpoint directory of ``config`` that ``transformers`` loads.

  ``read(key, layers)`` returns the host value of our parameter ``key`` (see ``Llama``'s
  docstring): whole for ``layers=None``, or the layer block ``layers`` (a slice of the
  leading ``[L]`` axis) of a stacked ``layers.*`` parameter. Tensors are written parameter
  by parameter (embedding; each stacked parameter for layers 0..L-1; final norm; head), each
  converted to ``dtype`` and streamed to its file before the next; a stacked parameter is read
  in blocks of as many layers as fit ``max_read_bytes`` (at least one), so the host holds one
  block, or one unstacked parameter, plus one converted tensor. Files: ``config.json``
  (``config_to_hf``, RoPE settings included), ``model.safetensors`` or shards of at most
  ``max_shard_bytes`` plus ``model.safetensors.index.json`` (``transformers`` does not care
  in which order or file tensors are). ``write=False`` calls ``read`` alike (every process
  of a multi-host gather must) but writes nothing.
  """
  dtype = jnp.dtype(dtype)
  hf_config = config_to_hf(config, dtype.name)  # first: it raises for configs with no export
  mesh = make_mesh(1, 1, devices=jax.devices()[:1])
  abstract = nnx.eval_shape(lambda: Llama(config, mesh=mesh, rngs=nnx.Rngs(0)))
  shapes = {k: v.shape for k, v in traverse_util.flatten_dict(
      nnx.to_pure_dict(nnx.state(abstract, nnx.Param))).items()}
  order = sorted(shapes, key=lambda k: (k[0] != "embedding", k[0] != "layers", k))
  block = {}  # the layer block read last: (key, start) -> value

  def layer_value(key, layer, per_read):
    start = layer // per_read * per_read
    if (key, start) not in block:
      block.clear()
      stop = min(start + per_read, config.num_layers)
      block[key, start] = np.asarray(read(key, slice(start, stop)))
    return block[key, start][layer - start]

  def hf_tensors(key, shape, layer, per_read):
    """(name, shape, value thunk) of each Hugging Face tensor of ``key`` (of ``layer``)."""
    if layer is not None and _unused_in_layer(key, layer, config):
      return []
    if key[:2] == ("layers", "moe"):
      moe_value = lambda name: layer_value(("layers", "moe", name), layer, per_read)
      return hf_moe.expert_tensors(config, model_type, layer, key[2], moe_value)
    value = lambda: _to_hf(np.asarray(
        read(key, None) if layer is None else layer_value(key, layer, per_read)), _num_in(key))
    return [(_hf_name(key, layer, config), _hf_shape(shape, _num_in(key)), value)]

  model_type = model_type_of(config)
  tensors, shards, size = {}, [[]], 0
  for key in order:
    stacked = key[0] == "layers"
    shape = shapes[key][1:] if stacked else shapes[key]
    layer_bytes = math.prod(shape) * jnp.dtype(config.param_dtype).itemsize
    per_read = max(1, max_read_bytes // layer_bytes)
    for layer in range(config.num_layers) if stacked else [None]:
      for name, hf_shape, value in hf_tensors(key, shape, layer, per_read):
        nbytes = math.prod(hf_shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
          shards, size = shards + [[]], 0
        converted = lambda value=value: np.asarray(value()).astype(dtype, copy=False)
        shards[-1].append((name, hf_shape, dtype, converted))
        size += nbytes
        tensors[name] = nbytes
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
  path = pathlib.Path(path)
  if write:
    path.mkdir(parents=True, exist_ok=True)
  for file, shard in zip(names, shards):
    _write_safetensors(path / file if write else None, shard)
  if not write:
    return
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(tensors.values())},
             "weight_map": {name: file for file, shard in zip(names, shards)
                            for name, *_ in shard}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
  (path / "config.json").write_text(json.dumps(hf_config, indent=2))


def save_llama(model: Llama, path: str | os.PathLike, *, dtype: str | None = None,
               max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes ``model`` as a Hugging Face checkpoint directory that
  ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads (``write_checkpoint``).

  Weights in ``dtype`` (default: the parameter dtype), gathered to the host one parameter,
  or one block of layers of a stacked parameter (at most 1 GiB), at a time. Every process
  must call it (multi-host gathers); process 0 writes. A ``mistral`` checkpoint without a
  window comes back as ``llama`` (same architecture); sliding windows are written as
  ``mistral`` (every layer), ``ministral`` (some layers) or Qwen's ``layer_types``.
  """
  params = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  read = lambda key, layers: _host(params[key] if layers is None else params[key][layers])
  write_checkpoint(model.config, read, path, dtype=dtype or model.config.param_dtype,
                   write=jax.process_index() == 0, max_shard_bytes=max_shard_bytes)
