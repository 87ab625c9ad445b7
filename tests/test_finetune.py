"""Starting from a checkpoint (``finetune``) and exporting one (``export``), against
``transformers`` with random weights (CPU torch)."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import random_hf_model, torch_logits  # noqa: E402

from ulysses_jax import step_builder  # noqa: E402
from ulysses_jax.hf import export  # noqa: E402
from ulysses_jax.hf import init_from as finetune  # noqa: E402
from ulysses_jax.checkpoint import CheckpointConfig, Checkpointer  # noqa: E402
from ulysses_jax.cli import evaluate as evaluate_cli  # noqa: E402
from ulysses_jax.cli import export as export_cli  # noqa: E402
from ulysses_jax.cli import gin_config  # noqa: E402
from ulysses_jax.config_checks import ConfigError  # noqa: E402
from ulysses_jax.data.batches import make_global_batch  # noqa: E402
from ulysses_jax.data.pipeline import DataConfig  # noqa: E402
from ulysses_jax.data.packing import IGNORE_LABEL  # noqa: E402
from ulysses_jax.hf.weights import save_llama  # noqa: E402
from ulysses_jax.mesh import make_mesh  # noqa: E402
from ulysses_jax.models.config import LlamaConfig  # noqa: E402
from ulysses_jax.optimizer import OptimizerConfig, make_optimizer  # noqa: E402
from ulysses_jax.rope import RopeScaling  # noqa: E402
from ulysses_jax.run_config import RunConfig, TrainConfig  # noqa: E402
from ulysses_jax.train_step import init_train_state, make_train_step  # noqa: E402

SEQ_LEN = 16
CPU = dict(dtype="float32", param_dtype="float32", remat_policy="none",
           attention_backend="xla", loss_chunk=4)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf")
  random_hf_model("LlamaForCausalLM", num_key_value_heads=2).save_pretrained(path)
  return path


def _batch(seed=0, rows=2, vocab=128):
  tokens = np.random.default_rng(seed).integers(0, vocab, (rows, SEQ_LEN + 1))
  labels = np.concatenate([tokens[:, 1:SEQ_LEN], np.full((rows, 1), IGNORE_LABEL)], axis=1)
  return tokens[:, :SEQ_LEN], labels


def _our_loss(model, tokens, labels):
  sums = nnx.jit(lambda m, t, y: m.loss(t, y))(model, jnp.asarray(tokens, jnp.int32),
                                               jnp.asarray(labels, jnp.int32))
  return float(sums.mean())


def _hf_loss(model, tokens):
  with torch.no_grad():
    return float(model(torch.tensor(tokens), labels=torch.tensor(tokens)).loss)


def test_init_from_hf_gives_the_transformers_loss(hf_dir, tmp_path):
  mesh = make_mesh(data=2, seq=4)
  config = finetune.model_config(str(hf_dir), CPU)
  assert (config.hidden_dim, config.num_kv_heads, config.loss_chunk) == (64, 2, 4)
  model = finetune.load_model(str(hf_dir), config, mesh)
  tokens, labels = _batch(rows=2)
  reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
  expected = _hf_loss(reference, tokens)
  assert abs(_our_loss(model, tokens, labels) - expected) <= 1e-5 * expected

  # RoPE bound in gin applies (context extension) and is written back on export.
  scaling = RopeScaling(kind="linear", factor=4.0)
  extended = finetune.model_config(str(hf_dir), {**CPU, "rope_theta": 20_000.0,
                                                 "rope_scaling": scaling})
  assert (extended.rope_theta, extended.rope_scaling) == (20_000.0, scaling)
  model = finetune.load_model(str(hf_dir), extended, mesh)
  ours = _our_loss(model, tokens, labels)
  assert abs(ours - expected) > 1e-3  # other RoPE, other function
  save_llama(model, tmp_path / "extended")
  written = json.loads((tmp_path / "extended" / "config.json").read_text())
  assert written["rope_theta"] == 20_000.0
  assert written["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "extended").eval()
  assert abs(_hf_loss(exported, tokens) - ours) <= 1e-5 * ours


def test_init_from_gives_the_model_its_shapes_from_python_as_from_gin(hf_dir, tmp_path):
  """``step_builder.resolve``: a ``RunConfig`` with ``init_from`` and the model left at its
  default (Llama-3.1-8B's shapes) builds the checkpoint's model; what the model sets applies
  on top, contradictions are errors; a model resolved once stays as it is."""
  start = RunConfig(train=TrainConfig(init_from=str(hf_dir), mesh_data=2, mesh_seq=4),
                    data=DataConfig(seq_len=SEQ_LEN, batch_size=2))
  resolved = step_builder.resolve(start)
  assert resolved.model == finetune.model_config(str(hf_dir))
  built = step_builder.build_train_step(start, step_builder.run_mesh(start.train))
  assert built.config.model == resolved.model
  assert built.state.params["embedding"].shape == (128, 64)  # the checkpoint's, not 32000 x 4096
  set_here = step_builder.resolve(dataclasses.replace(start, model=LlamaConfig(**CPU)))
  assert set_here.model == finetune.model_config(str(hf_dir), CPU)
  assert step_builder.resolve(set_here) == set_here
  with pytest.raises(ConfigError, match=r"LlamaConfig.num_layers=4 but the checkpoint has "
                     r"num_layers=2"):
    step_builder.resolve(dataclasses.replace(start, model=LlamaConfig(num_layers=4)))
  # The command line builds the same model from gin files binding the same fields (the
  # fine-tune's includes configs/runs/cpu.gin: float32, xla, no remat).
  from_gin = gin_config.read(["configs/finetune_tiny_cpu.gin"], [
      f"TrainConfig.init_from='{hf_dir}'", "LlamaConfig.loss_chunk=4"])
  assert from_gin.model == set_here.model


def _copy_dir(src, dst, config_changes=None, drop_config=False):
  dst.mkdir()
  for f in src.iterdir():
    if f.name != "config.json":
      (dst / f.name).write_bytes(f.read_bytes())
  if not drop_config:
    hf = {**json.loads((src / "config.json").read_text()), **(config_changes or {})}
    (dst / "config.json").write_text(json.dumps(hf))
  return str(dst)


def test_bad_init_from_stops_before_any_weights_are_read(hf_dir, tmp_path):
  with pytest.raises(ConfigError, match=r"checkpoint '.*nowhere' does not exist"):
    finetune.model_config(str(tmp_path / "nowhere"))
  no_config = _copy_dir(hf_dir, tmp_path / "no_config", drop_config=True)
  with pytest.raises(ConfigError, match=r"neither a Hugging Face checkpoint directory \(it "
                     r"has no config.json\) nor a ulysses_jax workdir"):
    finetune.model_config(no_config)
  gpt2 = _copy_dir(hf_dir, tmp_path / "gpt2", {"model_type": "gpt2"})
  with pytest.raises(ConfigError, match=r"config.json: unsupported model_type 'gpt2'; "
                     r"supported: \['gemma3_text', 'gpt_oss', 'llama', 'ministral', 'mistral', "
                     r"'mixtral', 'qwen2', 'qwen3', 'qwen3_moe'\]"):
    finetune.model_config(gpt2)
  with pytest.raises(ConfigError, match=r"LlamaConfig.hidden_dim=128 but the checkpoint has "
                     r"hidden_dim=64; LlamaConfig.num_layers=4 but the checkpoint has "
                     r"num_layers=2\. Remove these bindings"):
    finetune.model_config(str(hf_dir), {"hidden_dim": 128, "num_layers": 4, "dtype": "float32"})
  with pytest.raises(ConfigError, match=r"LlamaConfig.preset='cpu-demo' gives vocab_size=256 "
                     r"but the checkpoint has vocab_size=128"):
    finetune.model_config(str(hf_dir), {"preset": "cpu-demo"})
  # Bindings that agree with the checkpoint are fine.
  assert finetune.model_config(str(hf_dir), {"hidden_dim": 64}).hidden_dim == 64


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, hf_dir):
  """A run of ours: 3 steps from the Hugging Face weights on a (data=1, seq=4) mesh, with
  linear RoPE scaling bound in gin and a tokenizer.json named by its data config."""
  root = tmp_path_factory.mktemp("run")
  (root / "tok").mkdir()
  (root / "tok" / "tokenizer.json").write_text('{"fake": "tokenizer"}')
  (root / "tok" / "tokenizer_config.json").write_text("{}")
  mesh = make_mesh(data=1, seq=4, devices=jax.devices()[:4])
  config = finetune.model_config(str(hf_dir), {
      **CPU, "rope_scaling": RopeScaling(kind="linear", factor=2.0)})
  optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=0,
                                             total_steps=10))
  graphdef, state = init_train_state(finetune.load_model(str(hf_dir), config, mesh), optimizer)
  step_fn = make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=SEQ_LEN)
  tokens, labels = _batch(seed=1)
  batch = make_global_batch({"tokens": tokens, "labels": labels,
                             "positions": np.tile(np.arange(SEQ_LEN), (2, 1)),
                             "segment_ids": np.zeros((2, SEQ_LEN))}, mesh)
  run_config = {"model": config.to_dict(), "data": dataclasses.asdict(
      DataConfig(source="files", tokenizer=str(root / "tok" / "tokenizer.json")))}
  with Checkpointer(str(root / "checkpoints"), CheckpointConfig(async_save=False)) as ckpt:
    for step in (1, 2, 3):
      state, metrics = step_fn(state, batch)
      if step > 1:
        ckpt.save(step, state, {"next_row": step}, run_config=run_config, force=True)
  assert float(metrics["loss"]) < 6
  return root, nnx.merge(graphdef, state.params)


def test_init_from_workdir_reads_its_weights_into_any_mesh(workdir):
  root, trained = workdir
  config = finetune.model_config(str(root), {"loss_chunk": 8})
  assert config == trained.config.replace(loss_chunk=8)
  for path in (root, root / "checkpoints", root / "checkpoints" / "3"):
    model = finetune.load_model(str(path), config, make_mesh(data=2, seq=4))
    ours = jax.tree.leaves(nnx.state(model, nnx.Param))
    theirs = jax.tree.leaves(nnx.state(trained, nnx.Param))
    assert model.embedding[...].sharding.spec == jax.sharding.PartitionSpec(None,
                                                                            ("data", "seq"))
    for a, b in zip(ours, theirs, strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_resumed_fine_tune_reads_its_model_from_its_workdir_not_init_from(workdir, tmp_path):
  root, trained = workdir
  gone = f"TrainConfig.init_from='{tmp_path / 'deleted_base'}'"
  with pytest.raises(ConfigError, match=r"checkpoint '.*deleted_base' does not exist"):
    gin_config.read(["configs/finetune_tiny_cpu.gin"], [gone], str(tmp_path / "fresh"))
  config = gin_config.read(["configs/finetune_tiny_cpu.gin"], [gone], str(root))
  # The checkpoint's model (its RoPE scaling too), with the gin file's bindings on top.
  assert config.model == trained.config.replace(loss_chunk=128)


def test_export_loads_in_transformers_with_our_logits(workdir, tmp_path):
  root, trained = workdir
  tokens, _ = _batch(seed=2)
  expected = np.asarray(nnx.jit(lambda m, t: m(t))(trained, jnp.asarray(tokens, jnp.int32)))
  out = export_cli.run([f"--workdir={root}", f"--out={tmp_path / 'hf'}"])
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  np.testing.assert_array_less(np.abs(torch_logits(exported, tokens) - expected), 1e-4)
  written = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert written["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
  assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
  assert (tmp_path / "hf" / "tokenizer_config.json").exists()

  # Sharded, in bfloat16, from an older step.
  export.export_checkpoint(str(root), str(tmp_path / "bf16"), step=2, dtype="bfloat16",
                           max_shard_bytes=20_000)
  index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
  assert exported.dtype == torch.bfloat16
  assert exported.model.embed_tokens.weight.shape == (128, 64)


def test_export_of_a_missing_step_lists_the_steps(workdir, tmp_path):
  root, _ = workdir
  with pytest.raises(ConfigError, match=r"has no checkpoint of step 7; it has steps \[2, 3\]"):
    export.export_checkpoint(str(root), str(tmp_path / "out"), step=7)
  assert not (tmp_path / "out").exists()


def test_evaluate_a_workdir_equals_its_export(workdir, tmp_path):
  root, _ = workdir
  np.save(tmp_path / "doc.npy", np.random.default_rng(3).integers(0, 128, 40).astype(np.int32))
  common = [f"--data={tmp_path / 'doc.npy'}", f"--seq_len={SEQ_LEN}", "--mesh_data=1"]
  ours = evaluate_cli.run([f"--workdir={root}", "--step=2", "--mesh_seq=4", *common])
  export.export_checkpoint(str(root), str(tmp_path / "hf"), step=2)
  theirs = evaluate_cli.run([f"--hf={tmp_path / 'hf'}", "--mesh_seq=1", *common])
  assert ours["tokens"] == theirs["tokens"] == 39
  for a, b in zip(ours["buckets"], theirs["buckets"], strict=True):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
  with pytest.raises(ConfigError, match=r"no checkpoint of step 9; it has steps \[2, 3\]"):
    evaluate_cli.run([f"--workdir={root}", "--step=9", *common])


@pytest.mark.parametrize("module, flags, message", [
    ("export", ["--workdir={root}", "--step=7", "--out={tmp}/out"],
     r"error: .*has no checkpoint of step 7; it has steps \[2, 3\]"),
    ("evaluate", ["--hf={tmp}", "--data={tmp}/x.npy", "--seq_len=8"],
     r"error: '.*' is neither a Hugging Face checkpoint directory \(it has no config.json\) "
     r"nor a ulysses_jax workdir or checkpoint \(.* holds no checkpoint\); give the "
     r"directory holding config.json .*"),
])
def test_command_line_errors_are_one_line(workdir, tmp_path, module, flags, message):
  root, _ = workdir
  result = subprocess.run(
      [sys.executable, "-m", f"ulysses_jax.{module}",
       *(f.format(root=root, tmp=tmp_path) for f in flags)],
      capture_output=True, text=True, check=False, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 2  # bad input (ulysses_jax.cli)
  lines = [line for line in result.stderr.splitlines() if not line.startswith("WARNING:absl")]
  assert len(lines) == 1 and re.match(message, lines[0]), result.stderr
