"""The trainer started from a Hugging Face checkpoint (``TrainConfig.init_from``), exporting at
the end (``TrainConfig.export_at_end``) and resuming from its own checkpoints."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import random_hf_model, torch_logits  # noqa: E402

from ulysses_jax import finetune, gin_config, train  # noqa: E402
from ulysses_jax.mesh import make_mesh  # noqa: E402

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
