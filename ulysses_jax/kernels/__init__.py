"""Pallas kernels: flash attention forward and backward (Triton lowering on GPU, interpret
mode elsewhere; Mosaic GPU on Hopper), the split-K decode attention (Mosaic GPU, Hopper) and
the grouped matmul of mixture-of-experts layers."""
