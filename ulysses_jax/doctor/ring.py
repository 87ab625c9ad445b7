"""The doctor's ring check (``--mesh_seq``, ``--mesh_ring``): the trainer's first-contact check
(``ulysses_jax.kernel_check``) of every backend a ring can run, on a ring mesh of this
machine's devices, so a multi-node layout is checked before a run trains on it.

For full attention and a sliding window (``KINDS``) each backend runs the ring (or the Ulysses x
ring hybrid) forward and backward on ``kernel_check.RING_CHECK_LEN`` tokens per ring device,
bf16, packed documents, against the float32 XLA reference without the ring. The window is
decided as for a run of ``RUN_TOKENS_PER_RING_DEVICE`` tokens per ring device, where it fits one
ring step: the kernels' windowed ring (checked with a stand-in window, ``kernel_check.cases``).
Unlike the trainer, the doctor falls back to nothing: every backend gets its row.
"""

import jax.numpy as jnp
from jax.sharding import Mesh

from ulysses_jax.doctor import kernels as kernels_lib
from ulysses_jax.kernel_check import AttentionKind, compare, make_case
from ulysses_jax.kernels import target as target_lib
from ulysses_jax.mesh import ring_size

# name in the table -> ring backend (cuDNN cannot run in a ring: attention.backends.NOT_IN_RING)
KERNELS = {"ours mosaic": "pallas_mosaic", "ours triton": "pallas", "xla chunked": "xla"}
KINDS = (AttentionKind(None), AttentionKind(4096))  # full, and Mistral's window
RUN_TOKENS_PER_RING_DEVICE = 131_072


def ring_rows(mesh: Mesh, head_dim: int, on_row=None) -> list[dict]:
  """One row per attention kind and ring backend: the check on ``mesh`` (``passed`` None where
  the backend cannot run on its devices). ``on_row(row)`` is called as each row is done."""
  target = target_lib.of_mesh(mesh)
  heads, kv_heads = (32, 8) if target.on_gpu else (4, 2)
  shapes = dict(dtype=jnp.bfloat16, head_dim=head_dim, num_q_heads=heads, num_kv_heads=kv_heads,
                causal=True, segment_ids_given=True)
  rows = []
  for kind in KINDS:
    case = make_case(kind, shapes, mesh, "auto",
                     seq_len=ring_size(mesh) * RUN_TOKENS_PER_RING_DEVICE)
    prepared = None
    for name, backend in KERNELS.items():
      row = {"kernel": name, "attention": case.label, "mesh": dict(mesh.shape), "H": heads,
             "KV": kv_heads}
      unavailable = kernels_lib.unavailable(backend, target)
      if unavailable:
        row.update(status=unavailable, passed=None)
      else:
        prepared = prepared or compare.prepare(case.problem)
        result = compare.check(backend, case.problem, prepared)
        row.update(passed=result.passed, max_error=result.max_error,
                   tolerance=result.tolerance, seconds=result.seconds,
                   status="ok" if result.passed else result.describe())
      rows.append(row)
      if on_row:
        on_row(row)
  return rows
