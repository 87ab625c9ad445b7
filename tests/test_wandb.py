"""Weights & Biases beside metrics.jsonl and TensorBoard (``TrainConfig.wandb_project``), in
offline mode: the same numbers, against our step (a resumed trainer continuing the same W&B
run: ``tests/test_grain.py``)."""

import pytest

from tests import wandb_log
from ulysses_jax import metrics
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.run_config import TrainConfig

pytest.importorskip("wandb")


def test_metrics_go_to_an_offline_wandb_run(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  writer = metrics.MetricsWriter(str(tmp_path), wandb_project="ulysses-test",
                                 run_config={"data": {"seq_len": 64}})
  writer.write({"step": 1, "loss": 5.5, "tokens_seen/books": 64, "attention_backend": "xla"})
  writer.write({"step": 2, "loss": float("nan"), "tokens_seen/books": 128})
  writer.close()
  rows = wandb_log.history(tmp_path, at_least=2)
  assert [(r["step"], r.get("loss"), r["tokens_seen/books"]) for r in rows] == [
      (1, 5.5, 64), (2, None, 128)]  # numbers only; a NaN loss is left out, as in TensorBoard
  assert (tmp_path / "wandb_run_id").read_text().strip() in str(list(tmp_path.glob("wandb/*")))


def test_a_missing_wandb_is_a_config_error(monkeypatch):
  monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
  with pytest.raises(ConfigError, match=r"needs wandb: pip install 'ulysses_jax\[wandb\]'"):
    TrainConfig(wandb_project="p")
