"""``python -m ulysses_jax.export``: a checkpoint -> a Hugging Face directory
(``ulysses_jax.cli.export``)."""

import sys

from ulysses_jax.cli.export import main

sys.exit(main())
