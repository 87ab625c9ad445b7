"""Model definitions built on ``UlyssesAttention``."""

from ulysses_jax.models.llama import PRESETS, Llama, LlamaConfig, init_llama, preset

__all__ = ["PRESETS", "Llama", "LlamaConfig", "init_llama", "preset"]
