"""``python -m ulysses_jax.plan``: the layout planner's command line (``ulysses_jax.cli.plan``)."""

import sys

from ulysses_jax.cli.plan import main

sys.exit(main())
