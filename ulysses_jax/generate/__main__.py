"""``python -m ulysses_jax.generate``: text from (very long) prompts
(``ulysses_jax.cli.generate``)."""

import sys

from ulysses_jax.cli.generate import main

sys.exit(main())
