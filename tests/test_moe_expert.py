"""Expert parallelism (``LlamaConfig.expert_placement="expert"``) through a whole Hugging
Face model, and the planner's choice between the two expert placements. The layer's own
comparisons with the dense reference are in ``test_moe.py``."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ulysses_jax import make_mesh
from ulysses_jax.models.config import preset
from ulysses_jax.plan import moe as plan_moe
from ulysses_jax.plan.model import Model


# Slow (12 s on a shared 2-core machine: the whole model compiles, transformers runs twice).
@pytest.mark.slow
def test_qwen3_moe_with_expert_placement_has_transformers_logits_and_exports(tmp_path):
  """A random Qwen3-MoE (a dense first layer, 4 experts: one per device of seq = 4) loaded
  with the experts split over seq: transformers' logits, and its export loads back into
  transformers with them."""
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from test_hf import TINY, jax_logits, random_hf_model, torch_logits
  from test_hf_moe import FAMILIES, TOL
  from ulysses_jax.hf import load_llama, save_llama

  cls_name, overrides = FAMILIES["qwen3_moe"]
  reference = random_hf_model(cls_name, **overrides)
  reference.save_pretrained(tmp_path / "hf")
  tokens = np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 32))
  expected = torch_logits(reference, tokens)
  model = load_llama(tmp_path / "hf", make_mesh(2, 4), expert_placement="expert", mlp_chunk=3)
  assert model.layers.moe.gate_proj[...].sharding.spec == P(None, "seq", "data", None)
  np.testing.assert_array_less(np.abs(jax_logits(model, tokens) - expected), TOL)
  save_llama(model, tmp_path / "ours")
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
  np.testing.assert_array_less(np.abs(torch_logits(exported, tokens) - expected), TOL)
