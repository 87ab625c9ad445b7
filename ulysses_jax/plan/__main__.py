"""``python -m ulysses_jax.plan``: the layout planner's command line (``plan.cli``)."""

from ulysses_jax.plan import cli

cli.main()
