"""Moved to ``ulysses_jax.data.grain_dataset`` (0.2); this name goes in the next release."""

import warnings

from ulysses_jax.data.grain_dataset import GrainDataset  # noqa: F401  (the old name)

warnings.warn("ulysses_jax.grain_data is now ulysses_jax.data.grain_dataset; import "
              "GrainDataset from there (the old name goes in the next release)",
              DeprecationWarning, stacklevel=2)
