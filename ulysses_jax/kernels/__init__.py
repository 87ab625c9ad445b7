"""Pallas kernels: flash attention forward and backward (Triton lowering on GPU, interpret
mode elsewhere)."""
