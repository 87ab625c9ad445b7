"""Layout planner: which mesh, remat, offload, precision and MLP tile to train a model at a
sequence length on some GPUs.

    ulysses-plan --model=llama3.1-8b --seq_len=4194304 --devices=8 --gpu_mem=80 \\
        --host_mem_per_gpu=256

``plan.model``: shapes; ``plan.memory``: memory; ``plan.comm``: the collectives and their links
(``plan.hardware``: the cluster); ``plan.step``: the step time; ``plan.search``: the search
over layouts and knobs; ``plan.report``: a row as JSON and why its mesh;
``ulysses_jax.cli.plan``: the command line (``python -m ulysses_jax.plan``; ``--verify``
compiles the recommendation with ``ulysses_jax.aot``).
"""

from ulysses_jax.plan import moe  # noqa: F401
from ulysses_jax.plan.hardware import Hardware  # noqa: F401
from ulysses_jax.plan.memory import predict_memory  # noqa: F401
from ulysses_jax.plan.model import Layout, Model, ring_steps  # noqa: F401
from ulysses_jax.plan.step import predict_step  # noqa: F401
from ulysses_jax.plan.search import (HEAD_CHUNKS, MLP_CHUNKS, PRECISIONS,  # noqa: F401
                                     REMAT_GROUPS, REMATS, Knobs, Precision, fewest_devices,
                                     fits, layouts, longest_seq_len, plan, precisions)
