"""``python -m ulysses_jax.aot``: compile a config's train step for GPUs
(``ulysses_jax.cli.aot``)."""

import sys

from ulysses_jax.cli.aot import main

sys.exit(main())
