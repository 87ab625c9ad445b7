"""A Grain dataset of documents feeds the trainer (``ulysses_jax.data.grain_dataset``): rows as
``packing.PackedRows`` packs the same documents, and an exact resume from the saved state."""

import json
import shutil

import numpy as np
import pytest

from ulysses_jax.data.corpus import Corpus
from ulysses_jax.data.grain_dataset import GrainDataset
from ulysses_jax.mesh import make_mesh
from ulysses_jax.data.packing import PackedRows

grain = pytest.importorskip("grain")


@pytest.fixture(scope="module")
def documents():
  """40 documents of 1..90 ids; odd ones with a prompt (the first third not targets)."""
  rng = np.random.default_rng(0)
  docs = []
  for i in range(40):
    tokens = rng.integers(0, 256, int(rng.integers(1, 90)))
    targets = np.arange(len(tokens)) >= (len(tokens) // 3 if i % 2 else 0)
    docs.append({"tokens": tokens, "targets": targets})
  return docs


def _grain(docs):
  return grain.MapDataset.source(docs).shuffle(seed=3).repeat().to_iter_dataset()


def test_rows_pack_the_documents_in_grain_order(documents):
  mesh = make_mesh(data=2, seq=4)
  ds = GrainDataset(_grain(documents), mesh=mesh, batch_size=2, seq_len=32, vocab_size=256)
  order = grain.MapDataset.source(documents).shuffle(seed=3)
  first_epoch = [order[i] for i in range(len(documents))]
  lengths = np.array([len(d["tokens"]) for d in first_epoch])
  corpus = Corpus([np.concatenate([d["tokens"] for d in first_epoch])],
                  np.zeros(len(lengths), np.int64), np.cumsum(lengths) - lengths, lengths,
                  [np.concatenate([d["targets"] for d in first_epoch])])
  reference = PackedRows(corpus, 32, 0, shuffle=False)
  for b in range(10):
    batch = next(ds)
    for r in range(2):
      want = reference(2 * b + r)
      for k in want:
        np.testing.assert_array_equal(np.asarray(batch[k])[r], want[k], err_msg=f"{b} {r} {k}")


def test_resume_from_the_saved_state_is_exact(documents):
  mesh = make_mesh(data=1, seq=8)
  ds = GrainDataset(_grain(documents), mesh=mesh, batch_size=3, seq_len=48)
  for _ in range(7):  # well into the second epoch
    next(ds)
  state = json.loads(json.dumps(ds.get_state()))
  expected = [next(ds) for _ in range(4)]
  resumed = GrainDataset(_grain(documents), mesh=mesh, batch_size=3, seq_len=48)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  with pytest.raises(ValueError, match="different data stream"):
    GrainDataset(_grain(documents), mesh=mesh, batch_size=3, seq_len=16).set_state(state)


def test_bad_documents_and_ends_are_clear_errors():
  mesh = make_mesh(data=1, seq=8)
  short = grain.MapDataset.source([np.arange(5)]).to_iter_dataset()
  with pytest.raises(ValueError, match=r"ran out; make it endless with \.repeat\(\)"):
    next(GrainDataset(short, mesh=mesh, batch_size=1, seq_len=8))
  strings = grain.MapDataset.source([["a", "b"]]).repeat().to_iter_dataset()
  with pytest.raises(ValueError, match="must be a 1-D array of token ids"):
    next(GrainDataset(strings, mesh=mesh, batch_size=1, seq_len=8))
  big = grain.MapDataset.source([np.full(20, 300)]).repeat().to_iter_dataset()
  with pytest.raises(ValueError, match="token id 300, beyond the model's vocab_size=256"):
    next(GrainDataset(big, mesh=mesh, batch_size=1, seq_len=8, vocab_size=256))


@pytest.mark.slow
def test_the_trainer_saves_the_grain_position_and_resumes_exactly(documents, tmp_path,
                                                                   monkeypatch):
  """4 steps straight; then the same workdir with its last checkpoint removed resumes from step
  2 (the Grain state inside) to the same losses; the metrics also go to an offline W&B run,
  which the resumed run continues."""
  pytest.importorskip("wandb")
  from tests import wandb_log
  from ulysses_jax import train
  from ulysses_jax.cli import gin_config
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  config = gin_config.read(["configs/tiny_cpu.gin"], [
      "LlamaConfig.preset = 'tiny'", "LlamaConfig.loss_chunk = 32", "DataConfig.seq_len = 64",
      "DataConfig.batch_size = 2", "TrainConfig.mesh_data = 1", "TrainConfig.mesh_seq = 8",
      "TrainConfig.progress_bar = False", "STEPS = 4", "TrainConfig.log_every = 1",
      "CheckpointConfig.save_every = 2", "OptimizerConfig.warmup_steps = 1",
      "TrainConfig.kernel_check = False", "TrainConfig.wandb_project = 'grain-test'",
      "TrainConfig.peak_flops = 1e12",  # no peak measurement: MFU is not tested here
      f"TrainConfig.compilation_cache = '{tmp_path / 'cache'}'"])  # compiled once, run twice
  mesh, workdir = make_mesh(data=1, seq=8), tmp_path / "run"

  def run():
    ds = GrainDataset(_grain(documents), mesh=mesh, batch_size=2, seq_len=64, vocab_size=256)
    train.train(str(workdir), config, datasets=(ds, None))
    with open(workdir / "metrics.jsonl") as f:
      return [json.loads(line)["loss"] for line in f]

  straight = run()
  assert len(straight) == 4 and straight[0] != straight[3]
  shutil.rmtree(workdir / "checkpoints" / "4")
  assert run() == straight  # steps 3 and 4 again, from the position saved at step 2
  logged = wandb_log.history(workdir, at_least=6)
  assert [r["loss"] for r in logged] == straight + straight[2:]  # one W&B run, continued
  assert len({p.name.rsplit("-", 1)[1] for p in (workdir / "wandb").glob("offline-run-*")}) == 1
