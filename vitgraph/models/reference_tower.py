"""What the Qwen2.5-VL and Qwen3-VL towers share: the 2-D rotary (fp32, q's and k's head dims
kept interleaved as Qwen2-VL's are), the contract's widths, fusion, and the attention half of
a block in both forwards."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import kernels
from ..ops.attention import AttentionTuning, attend
from ..ops.tuning import KernelTuning
from .qwen2_vl import apply_rotary
from .tower_base import TowerBase


def rotary_attention(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, backend: str,
                     segments, tuning: AttentionTuning) -> torch.Tensor:
    """A block's attention from its qkv rows ``[T, 3E]`` (q's and k's head dims interleaved): q
    and k rotated in fp32 and cast back, as the reference does, then attention within each
    segment: ``[T, E]``."""
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)  # [T, H, D] each
    q, k = apply_rotary(q, k, cos, sin)
    return attend(backend, q, k, v.contiguous(), segments, tuning=tuning).reshape(qkv.shape[0], -1)


def fused_attention(h: torch.Tensor, attn: nn.Module, heads: int, cos: torch.Tensor, sin: torch.Tensor,
                    backend: str, segments, tuning: AttentionTuning) -> torch.Tensor:
    """The same in the fused forward: qkv's GEMM, the rotary kernel in place (zeroing padding
    rows and v's non-finite values where FlashAttention 4 reads them past a segment's end),
    attention on views of qkv."""
    qkv = F.linear(h, attn.qkv.weight, attn.qkv.bias)
    zero = segments.padded and backend == "fa4"
    q, k, v = kernels.rotary_(qkv, cos, sin, heads, segments.segment_ids if zero else None, zero_padding=zero)
    return attend(backend, q, k, v, segments, padding_zeroed=zero, tuning=tuning,
                  values_finite=zero).reshape(h.shape[0], -1)


class ReferenceTower(TowerBase, nn.Module):
    """A base for the towers without Qwen2-VL's GEMM epilogues (``config``: a ``TowerShape``):
    a reference forward and a fused one (vitgraph's Triton kernels for the elementwise work)."""

    def _init_rotary(self) -> None:
        super()._init_rotary()
        self.fused = False
        self.tuning = KernelTuning()

    def set_tuning(self, tuning: KernelTuning) -> None:
        """The kernels' tuning (:mod:`vitgraph.ops.tuning`); these towers have no quack GEMM path."""
        if tuning.gemm.backend != "cublas":
            raise ValueError(f"gemm={tuning.gemm.backend!r}: the {type(self).__name__} has no quack GEMM path; "
                             f"use 'cublas'")
        self.tuning = tuning

    def fuse(self, enabled: bool = True) -> None:
        """Run the elementwise work through vitgraph's Triton kernels. Needs triton and a CUDA
        device (or Triton's interpreter)."""
        if enabled and not kernels.usable(self.patch_embed.proj.weight.device):
            raise ValueError("fuse=True needs the triton package and a CUDA device (or TRITON_INTERPRET=1)")
        self.fused = enabled

    def forward(self, pixels: torch.Tensor, batch) -> torch.Tensor:
        """``[T, input_width]`` pixel rows -> ``[T / merge_unit, output_width]``."""
        return self.forward_fused(pixels, batch) if self.fused else self.forward_reference(pixels, batch)

    def block_kind(self, index: int) -> object:
        """What sets block ``index``'s work apart from another block's (its attention's
        segmentation, a deepstack tap); blocks of one kind run the same kernels at the same shapes."""
        return None

    def warm_up_blocks(self) -> list[int]:
        """The first block of each kind, in order (see :meth:`block_kind`)."""
        first: dict[object, int] = {}
        for i in range(len(self.blocks)):
            first.setdefault(self.block_kind(i), i)
        return sorted(first.values())

    def warm_up(self, pixels: torch.Tensor, batch) -> torch.Tensor:
        """The forward through one block of each kind (:meth:`warm_up_blocks`), then the merger
        (not the model's output): every kernel, shape and library plan a forward reaches, for a
        few blocks' work. Released towers' block 0 is no sample (a window block in Qwen2.5-VL,
        no deepstack tap in Qwen3-VL)."""
        run = self.forward_fused if self.fused else self.forward_reference
        return run(pixels, batch, blocks=self.warm_up_blocks())
