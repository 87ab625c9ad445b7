"""``python -m ulysses_jax.export`` (``ulysses_jax.cli.export``); the functions are in
``ulysses_jax.hf.export``."""
