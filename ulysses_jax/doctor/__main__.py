"""``python -m ulysses_jax.doctor``: check this machine's GPUs (``ulysses_jax.cli.doctor``)."""

import sys

from ulysses_jax.cli.doctor import main

sys.exit(main())
