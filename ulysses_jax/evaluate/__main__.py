"""``python -m ulysses_jax.evaluate``: a checkpoint's loss by position, pass-key and RULER
accuracy (``ulysses_jax.cli.evaluate``)."""

import sys

from ulysses_jax.cli.evaluate import main

sys.exit(main())
