"""``python -m ulysses_jax.train``: the trainer's command line (``ulysses_jax.cli.train``)."""

import sys

from ulysses_jax.cli.train import main

sys.exit(main())
