"""What the Qwen2.5-VL and Qwen3-VL towers share: the 2-D rotary (fp32, q's and k's head dims
kept interleaved as Qwen2-VL's are), the contract's widths, fusion, the attention half of a
block, and one block loop per forward; each family names its norm, segmentation, MLP, split K
and taps (:class:`ReferenceTower`)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import kernels
from ..ops.attention import AttentionTuning, attend
from ..ops.backend_names import attention_backend
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
    zero = segments.padded and attention_backend(backend).reads_past_segments
    q, k, v = kernels.rotary_(qkv, cos, sin, heads, segments.segment_ids if zero else None, zero_padding=zero)
    return attend(backend, q, k, v, segments, padding_zeroed=zero, tuning=tuning,
                  values_finite=zero).reshape(h.shape[0], -1)


class ReferenceTower(TowerBase, nn.Module):
    """A base for the towers without Qwen2-VL's GEMM epilogues (``config``: a ``TowerShape``):
    one reference block loop and one fused one (vitgraph's Triton kernels for the elementwise
    work). A family names what its blocks do differently in the methods under "what a family
    names"; blocks keep their attention's parameters, backend and tuning in ``block.attn``."""

    def _init_rotary(self) -> None:
        super()._init_rotary()
        self.fused = False
        self.tuning = KernelTuning()

    def set_attention_backend(self, backend: str) -> None:
        for block in self.blocks:
            block.attn.backend = backend

    def set_tuning(self, tuning: KernelTuning) -> None:
        """The kernels' tuning (:mod:`vitgraph.ops.tuning`); these towers have no quack GEMM path."""
        if tuning.gemm.backend != "cublas":
            raise ValueError(f"gemm={tuning.gemm.backend!r}: the {type(self).__name__} has no quack GEMM path; "
                             f"use 'cublas'")
        self.tuning = tuning
        for block in self.blocks:
            block.attn.attention_tuning = tuning.attention

    def fuse(self, enabled: bool = True) -> None:
        """Run the elementwise work through vitgraph's Triton kernels. Needs triton and a CUDA
        device (or Triton's interpreter)."""
        if enabled and not kernels.usable(self.patch_embed.proj.weight.device):
            raise ValueError("fuse=True needs the triton package and a CUDA device (or TRITON_INTERPRET=1)")
        self.fused = enabled

    def forward(self, pixels: torch.Tensor, batch) -> torch.Tensor:
        """``[T, input_width]`` pixel rows -> ``[T / merge_unit, output_width]``."""
        return self.forward_fused(pixels, batch) if self.fused else self.forward_reference(pixels, batch)

    def forward_reference(self, pixels: torch.Tensor, batch, blocks=None) -> torch.Tensor:
        """Plain PyTorch ops, one per step of the reference model. ``blocks``: the indexes of the
        blocks to run instead of all (their taps run too; see :meth:`warm_up`)."""
        cos, sin = self.rotary(batch.positions)
        x = self.embed(pixels, batch)
        taps = []
        for i in range(len(self.blocks)) if blocks is None else blocks:
            x = self.blocks[i](x, cos, sin, self.attention_segments(batch, i))
            taps += self._tapped(i, x, fused=False)
        return self.finish(self.merger(x), taps, batch)

    def forward_fused(self, pixels: torch.Tensor, batch, blocks=None) -> torch.Tensor:
        """The same math with vitgraph's kernels: each residual add joined to the norm after it
        (the last to the merger's), the rotary in place; a tap reads its block's output once the
        next add+norm has written it into the stream. ``blocks``: as :meth:`forward_reference`'s."""
        order = range(len(self.blocks)) if blocks is None else blocks
        blocks = [self.blocks[i] for i in order]
        cos, sin = self.rotary(batch.positions)
        x = self.embed(pixels, batch)
        heads, attention, taps = self.config.num_heads, self.tuning.attention, []
        h = self.add_norm(x, None, blocks[0].norm1)
        for k, (i, block) in enumerate(zip(order, blocks)):  # each intermediate dropped as soon as it is dead
            attn = block.attn
            out = fused_attention(h, attn, heads, cos, sin, attn.backend, self.attention_segments(batch, i),
                                  attention)
            del h
            y, y_bias = self.proj_fused(out, attn)
            del out
            h = self.add_norm(x, y, block.norm2, y_bias)
            del y
            f = self.mlp_in(h, block)
            del h
            f = self.mlp_act(f, block)  # the input dropped once the activation returns
            z, z_bias = self.mlp_out(f, block)
            del f
            norm = blocks[k + 1].norm1 if k + 1 < len(blocks) else self.merger.norm
            h = self.add_norm(x, z, norm, z_bias)  # x: block i's output now
            del z
            taps += self._tapped(i, x, fused=True)
        merger = self.merger
        return self.finish(merger.project(h.view(-1, merger.merged_dim)), taps, batch)

    def _tapped(self, index: int, x: torch.Tensor, fused: bool) -> list[torch.Tensor]:
        feature = self.tap(index, x, fused)
        return [] if feature is None else [feature]

    # -- what a family names -------------------------------------------------------------

    def embed(self, pixels: torch.Tensor, batch) -> torch.Tensor:
        """The blocks' input ``[T, E]`` from pixel rows, in the order the blocks read it."""
        raise NotImplementedError

    def attention_segments(self, batch, index: int):
        """The segmentation block ``index`` attends within."""
        return batch

    def add_norm(self, x: torch.Tensor, y: torch.Tensor | None, norm: nn.Module,
                 y_bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x += y`` (plus ``y_bias``; ``y`` may be split-K partials) in place, then ``norm`` of x,
        in one kernel."""
        raise NotImplementedError

    def proj_fused(self, out: torch.Tensor, attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention's output projection: ``(y, y_bias)`` for :meth:`add_norm`."""
        # No split K here: it made Qwen3-VL-8B slower (benchmarks/HISTORY.md).
        return F.linear(out, attn.proj.weight, attn.proj.bias), None

    def mlp_in(self, h: torch.Tensor, block: nn.Module) -> torch.Tensor:
        """The MLP's first GEMM."""
        raise NotImplementedError

    def mlp_act(self, f: torch.Tensor, block: nn.Module) -> torch.Tensor:
        """The MLP's activation of :meth:`mlp_in`'s output."""
        raise NotImplementedError

    def mlp_out(self, f: torch.Tensor, block: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP's last GEMM: ``(z, z_bias)`` for :meth:`add_norm`."""
        raise NotImplementedError

    def tap(self, index: int, x: torch.Tensor, fused: bool) -> torch.Tensor | None:
        """A feature read from block ``index``'s output ``x`` (``[T, E]``), or None."""
        return None

    def finish(self, merged: torch.Tensor, taps: list[torch.Tensor], batch) -> torch.Tensor:
        """The output from the merger's ``[T / merge_unit, out]`` and the taps, in block order."""
        raise NotImplementedError

    # -- warm-up ----------------------------------------------------------------------

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
