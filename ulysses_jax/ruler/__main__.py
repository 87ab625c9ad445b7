"""``python -m ulysses_jax.ruler``: RULER-style examples as training data
(``ulysses_jax.cli.ruler``)."""

import sys

from ulysses_jax.cli.ruler import main

sys.exit(main())
