"""The planner's collective bytes against XLA's GPU compiler, on one node of compile-only
H100s (``benchmarks.scaling_compiled`` does 64 to 1,024 GPUs): for each mesh kind of the
scaling study, one attention layer's forward and backward moves what ``plan.comm`` says."""

import pytest

from ulysses_jax import aot, plan
from ulysses_jax.models.config import preset

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.slow,  # three compiles, 7 to 12 s each on 2 cores (jax 0.10.2)
    pytest.mark.skipif(not aot.cuda_plugin_installed(),
                       reason="needs JAX's CUDA plugin: run `make test-gpu-compile`"),
]


# (seq, ring, attention) on 8 GPUs: pure ring, the all-gather-KV baseline, and a hybrid (the
# study's puts seq = 8 in a node, which on 8 GPUs is pure Ulysses, whose all-to-all bytes
# test_gpu_compile.py's test_ulysses_attention_on_one_node checks). Not a ring of 2: its
# one-step loops vanish and XLA shares the forward's K/V hop with the backward's.
@pytest.mark.parametrize("seq,ring,attention", [(1, 8, "ulysses"), (8, 1, "allgather_kv"),
                                                (2, 4, "ulysses")])
def test_compiled_collective_bytes_equal_the_planners_formula(seq, ring, attention):
  from benchmarks import scaling_compiled
  model = plan.Model.from_config(preset("llama3.1-8b"))
  compiled, _ = scaling_compiled.compiled_collectives(8, seq, ring, attention, model)
  predicted = plan.comm.layer_traffic(
      model, plan.Layout(1, seq, ring, attention=attention), None,
      seq_len=8 * scaling_compiled.TOKENS_PER_GPU, batch=1, dtype="bfloat16", forward_passes=1)
  expected = {scaling_compiled.HLO_KIND[name]: n for name, n in predicted.items() if n}
  assert expected and {op: n for op, n in compiled.items() if n} == expected
