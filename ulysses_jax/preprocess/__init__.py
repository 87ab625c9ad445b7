"""``python -m ulysses_jax.preprocess`` (``ulysses_jax.cli.preprocess``); the functions are in
``ulysses_jax.data.preprocess``."""
