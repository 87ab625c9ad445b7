"""``python -m ulysses_jax.preprocess``: see what the model trains on, tokenize once
(``ulysses_jax.cli.preprocess``)."""

import sys

from ulysses_jax.cli.preprocess import main

sys.exit(main())
