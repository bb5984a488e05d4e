"""What a tower's kernels are tuned by: one frozen value per op family, held by the tower."""

from __future__ import annotations

from dataclasses import dataclass, field

from .attention import AttentionTuning
from .gemm import GemmTuning
from .kernels import NormTuning


@dataclass(frozen=True)
class KernelTuning:
    """The defaults are the plain paths (cuBLAS, FlashAttention 4's own tiles, no early launch),
    for a tower no encoder configured."""

    gemm: GemmTuning = field(default_factory=GemmTuning)
    norms: NormTuning = field(default_factory=NormTuning)
    attention: AttentionTuning = field(default_factory=AttentionTuning)
