"""Kernels on plain tensors: attention backends, GEMMs with fused epilogues, Triton norms,
rotary and activations. Imports neither ``vitgraph.models`` nor ``vitgraph.engine``."""
