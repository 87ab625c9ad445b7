"""Generation (``ulysses_jax.generate``) against transformers' ``generate`` (greedy, float32),
token for token, on Ulysses, data x seq and Ulysses x ring meshes; the decode attention against
a dense reference; the cache's memory formula and its donation; sampling against
transformers' logits warpers; the command line's errors."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import GEMMA3, random_hf_model  # noqa: E402
from ulysses_jax.hf import init_from as finetune  # noqa: E402
from ulysses_jax import generate as gen  # noqa: E402
from ulysses_jax.attention.reference import dense_attention  # noqa: E402
from ulysses_jax.cli import generate as generate_cli  # noqa: E402
from ulysses_jax.generate import attention as gen_attention  # noqa: E402
from ulysses_jax.generate.cache import EMPTY  # noqa: E402
from ulysses_jax.generate.sampling import Sampling, filter_logits, sample  # noqa: E402
from ulysses_jax.hf.weights import load_llama  # noqa: E402
from ulysses_jax.mesh import make_mesh  # noqa: E402

# Random models (test_hf's TINY: vocabulary 128, 2 layers of 4 query heads of 16), windows of
# 5 tokens: prompts of unequal lengths, all longer than the windows, whose short rows leave
# shards of the cache empty; 8 new tokens wrap the rolling buffers.
CASES = {
    "llama_gqa": ("LlamaForCausalLM", dict(num_key_value_heads=2)),
    # 4 KV heads: split over seq where seq divides them (2 x 4, 1 x 2 x 4 meshes).
    "llama_mha": ("LlamaForCausalLM", {}),
    "mistral_window": ("MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=5)),
    "qwen3_yarn": ("Qwen3ForCausalLM", dict(num_key_value_heads=2, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
        rope_theta=10_000.0))),
    "gemma3": ("Gemma3ForCausalLM", GEMMA3),
}
PROMPT_LENGTHS = (13, 7, 21)
NEW_TOKENS = 8
MESHES = {"ulysses_1x8": (1, 8), "data_2x4": (2, 4), "ulysses_ring_1x2x4": (1, 2, 4)}


class Reference:
  """A random transformers model saved as a checkpoint, with its greedy continuations of
  ``prompts`` (no EOS: all ``NEW_TOKENS``), drawn with ``seed``."""

  def __init__(self, model, directory, seed):
    model.save_pretrained(directory)
    self.path = directory
    self.eos_id = model.generation_config.eos_token_id
    rng = np.random.default_rng(seed)
    self.prompts = [rng.integers(0, 128, n).tolist() for n in PROMPT_LENGTHS]
    self.expected = []
    for prompt in self.prompts:
      ids = torch.tensor([prompt])
      with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
      self.expected.append(out[0, len(prompt):].tolist())
    assert len({tuple(e) for e in self.expected}) == len(self.expected)

  def until_eos(self):
    """The continuations cut after the first EOS id (kept), as generation stops there."""
    cut = lambda ids: ids[:ids.index(self.eos_id) + 1] if self.eos_id in ids else ids
    return [cut(e) for e in self.expected]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
  made = {}

  def get(case):
    if case not in made:
      cls_name, overrides = CASES[case]
      made[case] = Reference(random_hf_model(cls_name, **overrides),
                             tmp_path_factory.mktemp(case), len(case))
    return made[case]
  return get


@pytest.mark.slow
def test_command_line_matches_transformers_on_ulysses_x_ring(references, tmp_path, capsys):
  """The hold-out check's command: a windowed model, prompts of unequal lengths longer than
  the window, Ulysses x ring; the outputs stop at the config's EOS."""
  ref = references("mistral_window")
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ref.prompts))
  out = tmp_path / "out.json"
  code = generate_cli.main([f"--hf={ref.path}", f"--prompts={prompts}",
                            f"--max_new_tokens={NEW_TOKENS}", "--mesh_seq=2", "--mesh_ring=4",
                            "--platform=cpu", "--cpu_devices=8", f"--json={out}"])
  assert code == 0
  results = json.loads(out.read_text())["results"]
  assert [r["output_ids"] for r in results] == ref.until_eos()
  assert "KV cache:" in capsys.readouterr().err


# Every family on Ulysses x ring (Mistral's is the quick test above), and the other meshes
# where they take another path: 4 KV heads split over seq (2 x 4, 1 x 2 x 4; on 1 x 8 the slots
# are split instead, as for 2 KV heads), windows on 1 x 8 and 2 x 4. Chosen to keep the slow
# suite's budget; each family's prefill and decode run the same code on every mesh.
GREEDY_CASES = [("llama_gqa", "ulysses_1x8"), ("llama_gqa", "data_2x4"),
                ("llama_mha", "data_2x4"), ("llama_mha", "ulysses_ring_1x2x4"),
                ("mistral_window", "ulysses_1x8"), ("mistral_window", "data_2x4"),
                ("qwen3_yarn", "ulysses_ring_1x2x4"),
                ("gemma3", "ulysses_1x8"), ("gemma3", "data_2x4"),
                ("gemma3", "ulysses_ring_1x2x4")]


@pytest.mark.slow
@pytest.mark.parametrize("case, mesh", GREEDY_CASES)
def test_greedy_equals_transformers(case, mesh, references):
  ref = references(case)
  model = load_llama(ref.path, make_mesh(*MESHES[mesh]))
  assert gen.generate(model, ref.prompts, max_new_tokens=NEW_TOKENS) == ref.expected


# Chunks of 8 tokens: three for the longest prompt, the rolling buffers hold W + T - 1 slots;
# Gemma 3's 2 KV heads are split over seq = 2.
@pytest.mark.slow
@pytest.mark.parametrize("case", ["mistral_window", "gemma3"])
def test_chunked_prefill_equals_transformers(case, references):
  ref = references(case)
  model = load_llama(ref.path, make_mesh(1, 2, 4))
  assert gen.generate(model, ref.prompts, max_new_tokens=NEW_TOKENS,
                      chunk_len=8) == ref.expected


def _random_cache(layout, rng, q_heads, lengths):
  """Random k, v and q, and a full layer's positions as a prefill of ``lengths`` leaves
  them (shards beyond a row's length empty)."""
  b, c = layout.batch, layout.full_capacity
  k, v = (rng.standard_normal((b, layout.kv_heads, c, layout.head_dim)).astype(np.float32)
          for _ in range(2))
  v = v.transpose(0, 1, 3, 2)  # [B, Hkv, D, C]: the cache's layout of values
  q = rng.standard_normal((b, 1, q_heads, layout.head_dim)).astype(np.float32)
  from ulysses_jax.generate.cache import chunk_positions
  positions = np.asarray(chunk_positions(layout, None, 0, jnp.asarray(lengths)))
  return q, k, v, positions


@pytest.mark.parametrize("dtype, tolerance", [
    ("float32", 1e-5), pytest.param("bfloat16", 2e-2, marks=pytest.mark.slow)])
def test_decode_attention_equals_dense_with_empty_shards(dtype, tolerance):
  """Rows of 3 and 29 tokens over 8 shards of 4 prompt slots: most shards of the first row
  are empty (lse = -inf there); a window of 6 empties the first shards of the second."""
  mesh = make_mesh(1, 8)
  layout = gen.plan_cache(mesh, batch=2, prompt_len=32, max_new_tokens=9, kv_heads=2,
                          head_dim=16, dtype=dtype, layer_windows=(None,))
  lengths = np.array([3, 29])
  q, k, v, positions = _random_cache(layout, np.random.default_rng(0), 4, lengths)
  query_positions = lengths[:, None].astype(np.int32) - 1
  cast = lambda x: jnp.asarray(x, dtype)
  for window in (None, 6):
    got = jax.jit(lambda q, k, v, window=window: gen_attention.cache_attention(
        layout, q, k, v, jnp.asarray(query_positions), jnp.asarray(positions), scale=0.25,
        window=window))(cast(q), cast(k), cast(v))
    for row in range(2):
      keys = np.flatnonzero(positions[row] >= 0)
      keys = keys[np.argsort(positions[row, keys])]
      if window is not None:
        keys = keys[-window:]
      upcast = lambda x: jnp.asarray(cast(x), jnp.float32)  # noqa: B023
      k_row = upcast(k[row:row + 1, :, keys].transpose(0, 2, 1, 3))
      v_row = upcast(v[row:row + 1, :, :, keys].transpose(0, 3, 1, 2))
      expected = dense_attention(upcast(q[row:row + 1]), k_row, v_row, causal=False,
                                 scale=0.25)
      np.testing.assert_allclose(np.asarray(got[row:row + 1], np.float32), expected,
                                 atol=tolerance, rtol=0)


def test_a_query_that_sees_nothing_gets_zeros_not_nans():
  q = jnp.ones((1, 1, 1, 1, 4))
  kv = jnp.ones((1, 1, 3, 4))
  attend = jax.jit(lambda q, k, v, q_pos, k_pos: gen_attention.partial_attention(
      q, k, v, q_pos, k_pos, scale=1.0, window=None))  # one compile, not one per operation
  o, lse = attend(q, kv, kv.transpose(0, 1, 3, 2), jnp.array([[5]]), jnp.array([[-1, 7, 9]]))
  assert np.all(np.asarray(o) == 0) and np.all(np.asarray(lse) == -np.inf)
  combined, combined_lse = jax.jit(lambda o, lse: gen_attention.combine(o, lse, ()))(o, lse)
  assert np.all(np.asarray(combined) == 0) and np.all(np.asarray(combined_lse) == -np.inf)


def test_cache_memory_formula_and_the_decode_step_donates_the_cache(references):
  """The formula equals the cache's shards; the compiled decode step aliases the whole cache
  to its output. (That it holds no copy of it is checked where it matters, in the program
  compiled for H100s: tests/test_gpu_compile_models.py. XLA's CPU compiler copies the cache to lay
  it out for its own matrix products.)"""
  model = load_llama(references("llama_gqa").path, make_mesh(2, 4))
  config = model.config
  layout = gen.plan_cache(model.mesh, batch=2, prompt_len=8192, max_new_tokens=16,
                          kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                          dtype=config.dtype, layer_windows=config.layer_windows())
  assert (layout.slot_shards, layout.head_shards) == (4, 1)  # 2 KV heads: slots over seq
  # 2 · L · ⌈Hkv/U⌉ · D · bytes · ⌈C/R'⌉ · ⌈B/data⌉
  # 14 new slots fed back, rounded up to 64 per device (the decode kernel's block of slots)
  formula = 2 * 2 * 2 * 16 * 4 * (8192 + 4 * 64) // 4 * 1
  assert layout.bytes_per_device() == formula
  cache = gen.cache.empty_cache(layout)
  assert sum(x.addressable_shards[0].data.nbytes for x in cache.k + cache.v) == formula
  generator = gen.Generator(model, layout)
  tokens = jax.device_put(np.zeros(2, np.int32), gen.steps.rows_sharding(layout))
  compiled = generator.decode_step.lower(generator.params, cache, tokens, np.int32(0),
                                         tokens).compile()
  memory = compiled.memory_analysis()
  assert memory.alias_size_in_bytes >= formula + layout.positions_bytes_per_device()


def test_a_windowed_layer_keeps_a_rolling_buffer_of_its_window():
  """Window 3 over 8 slot shards: 8 slots (24 for the full layer: fewer than a decode kernel
  block per device, so not rounded to one), in the formula too; an empty cache's positions are
  all empty."""
  layout = gen.plan_cache(make_mesh(1, 8), batch=1, prompt_len=16, max_new_tokens=4,
                          kv_heads=2, head_dim=8, dtype="float32", layer_windows=(None, 3))
  cache = gen.cache.empty_cache(layout)
  assert [x.shape for x in cache.k] == [(1, 1, 2, 16 + 8, 8), (1, 1, 2, 8, 8)]  # [L, B, K, C, D]
  assert layout.bytes_per_device() == 2 * 2 * 8 * 4 * (24 + 8) // 8
  assert all(np.all(np.asarray(p) == EMPTY) for p in cache.positions)
  assert [p.shape for p in cache.positions] == [(1, 24), (1, 8)]


def test_sampling_keeps_what_transformers_warpers_keep():
  from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                      TopKLogitsWarper, TopPLogitsWarper)
  logits = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32) * 3
  for temperature, top_k, top_p in ((0.7, 0, 0.9), (1.3, 10, 1.0), (1.0, 20, 0.5),
                                    (0.5, 0, 0.05)):
    ours = np.asarray(filter_logits(jnp.asarray(logits), Sampling(temperature, top_k, top_p)))
    theirs = torch.tensor(logits)
    for warper in (TemperatureLogitsWarper(temperature),
                   TopKLogitsWarper(top_k) if top_k else None,
                   TopPLogitsWarper(top_p) if top_p < 1 else None):
      theirs = theirs if warper is None else warper(None, theirs)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs.numpy()))
    np.testing.assert_allclose(ours[np.isfinite(ours)], theirs.numpy()[np.isfinite(ours)],
                               rtol=1e-6)


def test_a_seed_reproduces_the_draws_which_stay_in_the_kept_set():
  logits = jnp.asarray(np.random.default_rng(1).standard_normal((64, 30)), jnp.float32)
  sampling = Sampling(temperature=1.0, top_k=5, seed=3)
  draws = [np.asarray(sample(logits, sampling, step)) for step in (1, 1, 2)]
  np.testing.assert_array_equal(draws[0], draws[1])
  assert np.any(draws[0] != draws[2])
  assert np.any(draws[0] != np.asarray(sample(logits, Sampling(1.0, 5, seed=4), 1)))
  kept = np.isfinite(np.asarray(filter_logits(logits, sampling)))
  assert kept[np.arange(64), draws[2]].all()
  assert np.array_equal(np.asarray(sample(logits, Sampling(), 0)), np.argmax(logits, -1))


@pytest.mark.parametrize("flags, message", [
    (["--top_p=0"], r"top_p must be in \(0, 1\]"),
    (["--top_p=1.5"], r"top_p must be in \(0, 1\]"),
    (["--mesh_seq=3"], r"needs a multiple of 3 devices but 8 are available"),
    (["--prompts={empty}"], r"prompt 2 is empty"),
    (["--prompts={long}"], r"prompt 1 has 2040 tokens; with max_new_tokens=10 it needs 2050 "
                           r"positions but the model has 2048"),
    (["--prompts={text}"], r"line 1: a text prompt needs a tokenizer"),
])
def test_bad_input_is_one_error_line_before_the_model_loads(flags, message, references,
                                                            tmp_path, capsys, monkeypatch):
  files = {"ok": [{"prompt_ids": [1, 2]}], "empty": [{"prompt_ids": [1, 2]}, {"prompt_ids": []}],
           "long": [{"prompt_ids": [1] * 2040}], "text": [{"prompt": "hello"}]}
  for name, lines in files.items():
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  flags = [f.format(**{n: tmp_path / f"{n}.jsonl" for n in files}) for f in flags]
  if not any(f.startswith("--prompts") for f in flags):
    flags.append(f"--prompts={tmp_path / 'ok.jsonl'}")
  monkeypatch.setattr(finetune, "load_model", lambda *a, **k: pytest.fail("model loaded"))
  hf_dir = references("llama_gqa").path
  capsys.readouterr()  # the first test to ask writes the model (a progress bar on stderr)
  code = generate_cli.main([f"--hf={hf_dir}", "--max_new_tokens=10",
                            "--platform=cpu", "--cpu_devices=8", *flags])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
  assert re.search(message, err[0]), err[0]


@pytest.mark.slow
def test_workdir_generates_from_its_checkpoint(references, tmp_path):
  """``--workdir``: a run of one step from the reference checkpoint (the learning rate warms up
  from 0, so the weights are the reference's) generates transformers' tokens."""
  from ulysses_jax import train
  from ulysses_jax.checkpoint import CheckpointConfig
  from ulysses_jax.data.pipeline import DataConfig
  from ulysses_jax.run_config import RunConfig, TrainConfig
  ref = references("llama_gqa")
  np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 128, 512))
  train.train(str(tmp_path / "run"), RunConfig(
      train=TrainConfig(init_from=str(ref.path), steps=1, mesh_data=2, mesh_seq=4,
                        progress_bar=False, kernel_check=False),
      data=DataConfig(source="files", paths=(str(tmp_path / "data.npy"),), seq_len=32,
                      batch_size=2),
      checkpoint=CheckpointConfig(async_save=False)))
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ref.prompts))
  result = generate_cli.run([f"--workdir={tmp_path / 'run'}", f"--prompts={prompts}",
                             f"--max_new_tokens={NEW_TOKENS}", "--mesh_seq=8",
                             "--platform=cpu", "--cpu_devices=8"])
  assert [r["output_ids"] for r in result["results"]] == ref.expected


@pytest.mark.slow
def test_a_bf16_run_generates_in_bf16_unless_told(tmp_path, capsys):
  """``--workdir`` of a bfloat16 run computes and caches in bfloat16 (its LlamaConfig.dtype),
  and says so; ``--dtype`` still overrides, with a cache twice the size."""
  from ulysses_jax import train
  from ulysses_jax.checkpoint import CheckpointConfig
  from ulysses_jax.data.pipeline import DataConfig
  from ulysses_jax.models.config import LlamaConfig
  from ulysses_jax.run_config import RunConfig, TrainConfig
  np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 128, 512))
  train.train(str(tmp_path / "run"), RunConfig(
      train=TrainConfig(steps=1, mesh_seq=8, progress_bar=False, kernel_check=False),
      model=LlamaConfig(preset="tiny", dtype="bfloat16", attention_backend="xla"),
      data=DataConfig(source="files", paths=(str(tmp_path / "data.npy"),), seq_len=64,
                      batch_size=1),
      checkpoint=CheckpointConfig(async_save=False)))
  capsys.readouterr()
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt_ids": list(range(1, 17))}) + "\n")
  flags = [f"--workdir={tmp_path / 'run'}", f"--prompts={prompts}", "--max_new_tokens=2",
           "--mesh_seq=8", "--platform=cpu", "--cpu_devices=8", "--no_kernel_check"]
  sizes = {}
  for extra, dtype, why in [([], "bfloat16", "the run's LlamaConfig.dtype"),
                            (["--dtype=float32"], "float32", "--dtype")]:
    sizes[dtype] = generate_cli.run(flags + extra)["kv_cache_bytes_per_device"]
    err = capsys.readouterr().err
    assert f"computing in {dtype} ({why}), the KV cache too" in err, err
    assert re.search(rf"KV cache: .* rows per device, {dtype};", err), err
  assert sizes["float32"] == 2 * sizes["bfloat16"]


def test_a_hugging_face_checkpoint_computes_in_its_torch_dtype(tmp_path):
  """config.json's ``dtype`` (newer transformers) or ``torch_dtype``; float32 without one."""
  for config, expected in [({"torch_dtype": "bfloat16"}, ("bfloat16", "torch_dtype")),
                           ({"dtype": "float32", "torch_dtype": "bfloat16"}, ("float32", "dtype")),
                           ({}, ("float32", "names no dtype"))]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    dtype, why = finetune.compute_dtype(str(tmp_path))
    assert dtype == expected[0] and expected[1] in why
  assert finetune.compute_dtype(str(tmp_path), "float16") == ("float16", "--dtype")



def test_a_rolling_buffer_of_a_decode_kernel_block_or_more_takes_a_multiple_of_8_slots():
  """A window of 100 tokens (Hopper's decode kernel takes 64 slots or more, a multiple of 8 a
  device) keeps 104 slots on one device; of 200 over two slot shards, 2 x 104; of 60, 60
  (fewer than a block)."""
  for shards, window, capacity in ((1, 100, 104), (2, 200, 208), (1, 60, 60)):
    layout = gen.plan_cache(make_mesh(1, shards, devices=jax.devices()[:shards]), batch=1,
                            prompt_len=512, max_new_tokens=4, kv_heads=1, head_dim=64,
                            dtype="bfloat16", layer_windows=(None, window))
    assert layout.capacity(window) == capacity


def test_queued_decode_steps_stop_and_stream_as_each_token_is_looked_at():
  """``generate`` queues each decode step before looking at the tokens of the one before: it
  returns what step-by-step decoding gives, a row stops after its eos id (kept) or its stop
  test, ``on_token`` streams exactly the kept ids, and one new token needs no decode step."""
  from flax import nnx
  from ulysses_jax.models.llama import Llama, preset
  model = Llama(preset("tiny-gqa"), mesh=make_mesh(1, 2, devices=jax.devices()[:2]),
                rngs=nnx.Rngs(0))
  prompts = [[5, 9, 3, 7, 1], [2, 4, 6]]
  full = gen.generate(model, prompts, max_new_tokens=6)
  layout = gen.plan_cache(model.mesh, batch=2, prompt_len=5, max_new_tokens=6, kv_heads=2,
                          head_dim=16, dtype="float32", layer_windows=(None, None))
  generator = gen.Generator(model, layout)
  padded = [p + [0] * (layout.prompt_len - len(p)) for p in prompts]
  stepwise = [generator.prefill(padded, [len(p) for p in prompts])]
  stepwise += [generator.decode() for _ in range(5)]
  assert full == np.stack(stepwise, axis=1).tolist()
  streamed = []
  cut = gen.generate(model, prompts, max_new_tokens=6, eos_ids=[full[0][2]],
                     stop=lambda row, ids: row == 1 and len(ids) == 4,
                     on_token=lambda row, token: streamed.append((row, token)))
  assert cut[0] == full[0][:full[0].index(full[0][2]) + 1] and cut[1] == full[1][:4]
  assert sorted(streamed) == sorted((row, t) for row in (0, 1) for t in cut[row])
  assert gen.generate(model, prompts, max_new_tokens=1) == [ids[:1] for ids in full]


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["heads-over-seq", "slots-over-seq"])
def test_writes_fill_the_kernels_layout_with_the_values_of_xlas_transposed(kv_heads):
  """The decode kernel's layout (``v_layout == "CD"``, v like k; ``decode_backend="mosaic"``)
  and XLA's ("DC", v slots last) written by two prefill chunks and two decode tokens on a
  2 x 2 x 2 mesh (data, ring, seq), a full layer and a 64-token window's rolling buffer: the
  same k, and v transposed. KV heads over seq, or (one KV head) the slots over ring and seq."""
  import dataclasses
  from ulysses_jax.generate import cache as cache_lib
  mesh = make_mesh(2, 2, 2)
  plan = gen.plan_cache(mesh, batch=2, prompt_len=512, max_new_tokens=3, kv_heads=kv_heads,
                        head_dim=64, dtype="bfloat16", layer_windows=(None, 64), chunk_len=256)
  rng = np.random.default_rng(kv_heads)
  chunks = [jnp.asarray(rng.standard_normal((2, 256, kv_heads, 64)), jnp.bfloat16)
            for _ in range(2)]
  tokens = [jnp.asarray(rng.standard_normal((1, 2, 1, kv_heads, 64)), jnp.bfloat16)
            for _ in range(2)]
  lengths = jnp.asarray([512, 300])

  def fill(layout, cache):
    filled = []  # per kind, k then v
    for kind, stack_k, stack_v in zip(layout.kinds, cache.k, cache.v):
      for values, stack in ((False, stack_k), (True, stack_v)):
        for n, chunk in enumerate(chunks):
          stack = cache_lib.write_chunk(layout, kind, stack, 0, chunk, n, lengths, values=values)
        for step, token in enumerate(tokens):
          slots = cache_lib.token_slots(layout, kind, step, lengths + step)
          stack = cache_lib.write_token(layout, stack, token, slots, values=values)
        filled.append(stack)
    return filled

  stacks = {}
  for backend in ("mosaic", "xla"):
    layout = dataclasses.replace(plan, decode_backend=backend)
    filled = jax.jit(fill, static_argnums=0)(layout, cache_lib.empty_cache(layout))
    keys = [(layout.v_layout, kind, values) for kind in layout.kinds for values in (False, True)]
    stacks.update({key: np.asarray(stack, np.float32) for key, stack in zip(keys, filled)})
  for kind in plan.kinds:
    np.testing.assert_array_equal(stacks["CD", kind, False], stacks["DC", kind, False])
    np.testing.assert_array_equal(stacks["CD", kind, True], stacks["DC", kind, True].swapaxes(3, 4))
    assert np.count_nonzero(stacks["CD", kind, True]) > 0
