"""The trainer started from a Hugging Face checkpoint (``TrainConfig.init_from``), exporting at
the end (``TrainConfig.export_at_end``) and resuming from its own checkpoints; from gin and
from Python."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import GEMMA3, random_hf_model, torch_logits  # noqa: E402

from ulysses_jax import cli, train  # noqa: E402
from ulysses_jax.hf import init_from as finetune  # noqa: E402
from ulysses_jax.cli import evaluate as evaluate_cli  # noqa: E402
from ulysses_jax.cli import gin_config  # noqa: E402
from ulysses_jax.cli import train as train_cli  # noqa: E402
from ulysses_jax.checkpoint import CheckpointConfig  # noqa: E402
from ulysses_jax.data.pipeline import DataConfig  # noqa: E402
from ulysses_jax.mesh import make_mesh  # noqa: E402
from ulysses_jax.models.config import LlamaConfig  # noqa: E402
from ulysses_jax.run_config import RunConfig, TrainConfig  # noqa: E402

pytestmark = pytest.mark.slow


def test_fine_tune_from_hf_exports_and_resumes(tmp_path):
  random_hf_model("LlamaForCausalLM", vocab_size=256).save_pretrained(tmp_path / "hf")
  with open(tmp_path / "data.jsonl", "w", encoding="utf-8") as f:
    for i in range(40):
      f.write(json.dumps({"prompt": f"Q{i}: ", "completion": "answer " * (i % 7 + 3)}) + "\n")
  workdir, out = tmp_path / "run", tmp_path / "exported"
  params = [f"TrainConfig.init_from='{tmp_path / 'hf'}'",
            f"DataConfig.paths='{tmp_path / 'data.jsonl'}'", f"TrainConfig.export_at_end='{out}'",
            "DataConfig.seq_len=64", "TrainConfig.progress_bar=False",
            "TrainConfig.eval_every=0", "TrainConfig.position_eval=True"]
  run = lambda steps: train.train(str(workdir), gin_config.read(
      ["configs/finetune_tiny_cpu.gin"], [*params, f"STEPS={steps}"]))
  summary = run(6)
  assert summary["start_step"] == 0 and summary["step"] == 6
  assert summary["exported"] == str(out)
  # The per-position evaluation is logged at the eval step (the last).
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    last = json.loads(f.readlines()[-1])
  assert {"eval_loss_pos_0_1", "eval_loss_pos_32_64"} <= set(last), last
  # The export holds the trained weights: transformers' logits equal ours.
  config = finetune.model_config(str(workdir), {})
  model = finetune.load_model(str(workdir), config, make_mesh(data=1, seq=8))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
  ours = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens, jnp.int32)))
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  np.testing.assert_array_less(np.abs(torch_logits(exported, tokens) - ours), 1e-4)
  start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  assert np.abs(torch_logits(start, tokens) - ours).max() > 1e-2  # it did train
  # Running again resumes from the run's own checkpoint, not from init_from.
  summary = run(8)
  assert summary["start_step"] == 6 and summary["restored_step"] == 6


def _base_model_and_its_loss(tmp_path, model):
  """Saves ``model`` to tmp_path/hf and a repeated 64-token document to tmp_path/doc.npy;
  returns evaluate's flags for that document, its result on the model, and the gin params of a
  fine-tune from it on the document that exports to tmp_path/out."""
  model.save_pretrained(tmp_path / "hf")
  np.save(tmp_path / "doc.npy", np.tile(np.arange(64, dtype=np.int32), 40))
  evaluate_flags = [f"--data={tmp_path / 'doc.npy'}", "--seq_len=64", "--mesh_seq=4"]
  params = [f"TrainConfig.init_from='{tmp_path / 'hf'}'", "DataConfig.seq_len=64",
            f"DataConfig.paths='{tmp_path / 'doc.npy'}'", "TrainConfig.progress_bar=False",
            f"TrainConfig.export_at_end='{tmp_path / 'out'}'", "TrainConfig.eval_every=0",
            "OptimizerConfig.learning_rate=1e-2"]
  return evaluate_flags, evaluate_cli.run([f"--hf={tmp_path / 'hf'}", *evaluate_flags]), params


def test_evaluate_fine_tune_export_evaluate_then_resume_without_the_base(tmp_path, capsys):
  """A user's path with an int32 token file, through the command lines; then the base model
  is deleted and the run resumes from its own checkpoint."""
  evaluate_flags, before, params = _base_model_and_its_loss(
      tmp_path, random_hf_model("LlamaForCausalLM", vocab_size=256))
  flags = [f"--workdir={tmp_path / 'run'}", "--gin_file=configs/finetune_tiny_cpu.gin",
           *(f"--gin_param={p}" for p in (*params, "CheckpointConfig.save_every=3"))]
  assert train_cli.main([*flags, "--gin_param=STEPS=6"]) == cli.EXIT_OK
  after = evaluate_cli.run([f"--hf={tmp_path / 'out'}", *evaluate_flags])
  assert after["tokens"] == before["tokens"] and after["loss"] < before["loss"] - 0.5
  shutil.rmtree(tmp_path / "hf")
  capsys.readouterr()
  assert train_cli.main([*flags, "--gin_param=STEPS=8"]) == cli.EXIT_OK, capsys.readouterr().err
  out = capsys.readouterr().out
  assert "Trained steps 7..8 in" in out and "(resumed from step 6)" in out, out


# Families beyond Llama: sliding windows, YaRN, Gemma 3 (local and global layers).
FAMILIES = {
    "mistral_window": ("MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=5)),
    "qwen3_yarn": ("Qwen3ForCausalLM", dict(num_key_value_heads=2, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
        rope_theta=10_000.0))),
    "gemma3": ("Gemma3ForCausalLM", GEMMA3),
    # A dense first layer, then experts; the load-balancing loss in the objective.
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, mlp_only_layers=[0], output_router_logits=True,
        router_aux_loss_coef=0.01)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_fine_tunes_exports_and_evaluates(family, tmp_path):
  """``init_from`` a transformers model of each family: the trainer lowers the loss on a
  repeated document (data 2 x seq 4, 64-token rows: windows of 5 cross device boundaries),
  and its export, loaded by transformers, has the trained model's logits."""
  cls_name, overrides = FAMILIES[family]
  evaluate_flags, before, params = _base_model_and_its_loss(
      tmp_path, random_hf_model(cls_name, vocab_size=256, **overrides))
  train.train(str(tmp_path / "run"), gin_config.read(
      ["configs/finetune_tiny_cpu.gin"], [*params, "OptimizerConfig.warmup_steps=1", "STEPS=5"]))
  after = evaluate_cli.run([f"--hf={tmp_path / 'out'}", *evaluate_flags])
  assert after["tokens"] == before["tokens"] and after["loss"] < before["loss"] - 0.5
  config = finetune.model_config(str(tmp_path / "run"), {})
  assert config == finetune.model_config(str(tmp_path / "hf"), {}).replace(
      **{k: getattr(config, k) for k in ("dtype", "param_dtype", "remat_policy", "loss_chunk",
                                         "attention_backend")})
  model = finetune.load_model(str(tmp_path / "run"), config, make_mesh(data=1, seq=8))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
  ours = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens, jnp.int32)))
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  np.testing.assert_array_less(np.abs(torch_logits(exported, tokens) - ours), 1e-4)
  if config.moe is not None:  # the routing metrics of its MoE layers
    with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
      record = json.loads(f.readlines()[-1])
    assert record["router_aux_loss"] >= 1.0
    assert record["expert_share_min/layer_01"] <= 0.25 <= record["expert_share_max/layer_02"]


def test_train_from_python_with_init_from_builds_the_checkpoints_model(tmp_path):
  """``train.train(workdir, RunConfig(...))`` with ``init_from`` and the model left at its
  default (Llama-3.1-8B's shapes, which would not fit here) trains the checkpoint's model, as
  the command line does."""
  random_hf_model("LlamaForCausalLM", vocab_size=256).save_pretrained(tmp_path / "hf")
  with open(tmp_path / "data.jsonl", "w", encoding="utf-8") as f:
    for i in range(40):
      f.write(json.dumps({"text": f"document {i}: " + "words " * (i % 7 + 3)}) + "\n")
  config = RunConfig(
      train=TrainConfig(init_from=str(tmp_path / "hf"), steps=2, mesh_data=2, mesh_seq=4,
                        progress_bar=False, kernel_check=False),
      data=DataConfig(source="files", paths=(str(tmp_path / "data.jsonl"),), seq_len=64,
                      batch_size=2),
      checkpoint=CheckpointConfig(async_save=False))
  assert config.model == LlamaConfig()
  summary = train.train(str(tmp_path / "run"), config)
  assert summary["step"] == 2
  saved = finetune.SavedParams(str(tmp_path / "run"))
  assert saved.config == finetune.model_config(str(tmp_path / "hf"))
  assert saved.shape(("embedding",)) == (256, 64)
