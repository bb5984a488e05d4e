"""The Qwen3-VL vision tower: patch 16 with a biased Conv3d, learned position embeddings
resampled bilinearly to each grid, LayerNorm blocks with a GELU-tanh MLP, the main merger
and one deepstack merger per ``deepstack_visual_indexes`` entry.

The output is one tensor ``[N/4, out_hidden_size * (1 + len(deepstack_visual_indexes))]``:
the main embeddings, then each deepstack feature in layer order, side by side (the
``image_embeds`` layout vLLM and SGLang take). The interpolation's four taps per patch are
built on the host (:meth:`Qwen3VisionTower.build_batch`); the weights travel as the int32 bits
of their fp32 values, so every tensor of the batch is int32 as the engine stages it.

This file names what :class:`TowerBase`'s block loops run differently for Qwen3-VL (the
reference one exact against transformers' ``Qwen3VLVisionModel``). In CUDA graphs the taps are
static buffers like every other tensor of the batch, and the deepstack features leave in the
one output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..engine.contract import BatchLayout
from ..ops import kernels
from ..ops.attention import SegmentFlags
from ..ops.gemm import GEMM_SETTINGS, SPLIT_K_SETTINGS
from .config_parsing import FamilyConfig, TowerShape, check_block_indexes
from ..images.preprocess import QWEN3_VL_PROCESSOR
from .segments import block_major_positions, segment
from .tower_base import TowerBase, attention_module

_CEILINGS = {"depth": 1024, "hidden_size": 65536, "num_heads": 1024, "intermediate_size": 1 << 18,
             "out_hidden_size": 65536, "num_position_embeddings": 1 << 20, "patch_size": 64,
             "temporal_patch_size": 16, "spatial_merge_size": 8, "in_channels": 16}
_REQUIRED = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "num_position_embeddings",
             "deepstack_visual_indexes")


# Qwen3-VL's (and Qwen3.5's, Qwen3.6's) published video_preprocessor_config.json: size
# {shortest_edge: 4096, longest_edge: 25165824}, patch 16, temporal 2, merge 2, mean/std 0.5;
# its video processor reads the size as a whole clip's pixels.
QWEN3_VL_VIDEO_PROCESSOR = replace(QWEN3_VL_PROCESSOR, min_pixels=4096, max_pixels=25165824, clip_pixels=True,
                                   max_video_tokens=768)


@dataclass(frozen=True)
class Qwen3VisionConfig(FamilyConfig, TowerShape):
    """Shape of a Qwen3-VL vision tower (``vision_config``; ``qwen3_vl`` and ``qwen3_vl_moe``)."""

    CEILINGS, REQUIRED, TUPLES = _CEILINGS, _REQUIRED, ("deepstack_visual_indexes",)
    FAMILY, PROCESSOR, VIDEO_PROCESSOR = "qwen3_vl", QWEN3_VL_PROCESSOR, QWEN3_VL_VIDEO_PROCESSOR

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    out_hidden_size: int = 4096
    num_position_embeddings: int = 2304  # a 48 x 48 learned grid
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0

    def check(self) -> None:
        if self.grid_side ** 2 != self.num_position_embeddings:
            raise ValueError(f"vision_config.num_position_embeddings must be a square, got "
                             f"{self.num_position_embeddings}")
        check_block_indexes("deepstack_visual_indexes", self.deepstack_visual_indexes, self.depth)

    @property
    def grid_side(self) -> int:
        return int(round(self.num_position_embeddings ** 0.5))


@dataclass(frozen=True)
class Qwen35VisionConfig(Qwen3VisionConfig):
    """The Qwen3-VL tower without deepstack mergers (``qwen3_5``, ``qwen3_5_moe`` for Qwen3.5 and
    Qwen3.6, ``qwen4_exp``): one merger, output ``[N / 4, out_hidden_size]``. Checkpoints carry
    ``deepstack_visual_indexes: []`` or no such field."""

    FAMILY = "qwen3_5"

    REQUIRED = tuple(name for name in _REQUIRED if name != "deepstack_visual_indexes")

    deepstack_visual_indexes: tuple[int, ...] = ()

    def check(self) -> None:
        super().check()
        if self.deepstack_visual_indexes:  # transformers' tower has no deepstack mergers to read them
            raise ValueError(f"vision_config.deepstack_visual_indexes must be empty for Qwen3.5/3.6/4-Exp "
                             f"towers, got {list(self.deepstack_visual_indexes)}")

    def transformers_fields(self) -> dict:
        fields = super().transformers_fields()
        del fields["deepstack_visual_indexes"]  # transformers' Qwen3.5 config has no such field
        return fields


@dataclass
class DeepstackBatch(SegmentFlags, BatchLayout):
    """Metadata of one call: ``positions [T, 2]``, ``segment_ids [T]`` (-1 on padding rows),
    ``cu_seqlens [S + 1]``, and the position-table taps ``pos_index [T, 4]`` with their fp32
    weights as int32 bits ``pos_weight_bits [T, 4]`` (padding rows: index 0, weight 0)."""

    positions: torch.Tensor
    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    pos_index: torch.Tensor
    pos_weight_bits: torch.Tensor
    max_seqlen: int
    segment_lengths: tuple[int, ...] | None = None


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear, align_corners=True taps into a ``side``-long table for positions on an axis
    of ``size``: fp32, the same arithmetic as transformers' helper."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


@lru_cache(maxsize=1024)
def frame_taps(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The four (index, weight) taps of each patch of an ``h x w`` frame, in block-major order."""
    pos = block_major_positions(h, w, merge)
    h_taps, h_weights = _axis_taps(torch.from_numpy(pos[:, 0].astype(np.int64)), h, side)
    w_taps, w_weights = _axis_taps(torch.from_numpy(pos[:, 1].astype(np.int64)), w, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4).to(torch.int32).numpy()
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4).numpy()
    index.flags.writeable = weight.flags.writeable = False  # cached: shared by every call
    return index, weight


class Block(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        e = cfg.hidden_size
        self.norm1, self.norm2 = nn.LayerNorm(e, eps=1e-6), nn.LayerNorm(e, eps=1e-6)
        self.attn = attention_module(cfg, e)
        self.mlp = nn.Module()
        self.mlp.linear_fc1, self.mlp.linear_fc2 = nn.Linear(e, cfg.intermediate_size), nn.Linear(cfg.intermediate_size, e)


class Merger(nn.Module):
    """LayerNorm before the 2x2 merge (main), or after it (``postshuffle``: deepstack), then the MLP."""

    def __init__(self, cfg: Qwen3VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim, self.postshuffle = cfg.hidden_size * cfg.merge_unit, postshuffle
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # [T/4, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged_dim)) if self.postshuffle else self.norm(x).view(-1, self.merged_dim)
        return self.project(x)


def expected_shapes(cfg: Qwen3VisionConfig) -> dict[str, tuple[int, ...]]:
    """State-dict names and shapes for ``cfg``, without building the tower."""
    e, m, merged, out = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit, cfg.out_hidden_size
    shapes = {"patch_embed.proj.weight": (e, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
              "patch_embed.proj.bias": (e,), "pos_embed.weight": (cfg.num_position_embeddings, e)}
    block = {"norm1.weight": (e,), "norm1.bias": (e,), "norm2.weight": (e,), "norm2.bias": (e,),
             "attn.qkv.weight": (3 * e, e), "attn.qkv.bias": (3 * e,), "attn.proj.weight": (e, e),
             "attn.proj.bias": (e,), "mlp.linear_fc1.weight": (m, e), "mlp.linear_fc1.bias": (m,),
             "mlp.linear_fc2.weight": (e, m), "mlp.linear_fc2.bias": (e,)}
    for i in range(cfg.depth):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})

    def merger(prefix: str, norm: int) -> dict:
        return {f"{prefix}.norm.weight": (norm,), f"{prefix}.norm.bias": (norm,),
                f"{prefix}.linear_fc1.weight": (merged, merged), f"{prefix}.linear_fc1.bias": (merged,),
                f"{prefix}.linear_fc2.weight": (out, merged), f"{prefix}.linear_fc2.bias": (out,)}

    shapes.update(merger("merger", e))
    for j in range(len(cfg.deepstack_visual_indexes)):
        shapes.update(merger(f"deepstack_merger_list.{j}", merged))
    return shapes


class Qwen3VisionTower(TowerBase):
    """Qwen3-VL ViT, main merger and deepstack mergers: a biased patch embedding plus learned
    positions, LayerNorm blocks with a GELU-tanh MLP (linear_fc1, linear_fc2), deepstack taps."""

    MLP = ("linear_fc1", "linear_fc2")
    # No split K: it made Qwen3-VL-8B slower (benchmarks/HISTORY.md).
    tuning_reads = frozenset({"norms", "attention"}) | (GEMM_SETTINGS - SPLIT_K_SETTINGS)

    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Merger(cfg, postshuffle=True)
                                                   for _ in cfg.deepstack_visual_indexes)
        self._init_tower(cfg)

    @property
    def output_parts(self) -> int:
        """Outputs side by side in each row: the main embeddings, then each deepstack feature."""
        return 1 + len(self.config.deepstack_visual_indexes)

    @property
    def output_width(self) -> int:
        return self.config.out_hidden_size * self.output_parts


    def build_batch(self, grids: Sequence[tuple[int, int, int]], *, num_tokens: int | None = None,
                    num_segments: int | None = None, max_seqlen: int | None = None) -> DeepstackBatch:
        """Host metadata for ``grids``, padded to ``num_tokens`` rows and ``num_segments`` frames."""
        cfg, merge = self.config, self.config.spatial_merge_size
        positions, taps, weights, lengths = [], [], [], []
        for t, h, w in grids:
            index, weight = frame_taps(h, w, merge, cfg.grid_side)
            for _ in range(t):
                positions.append(block_major_positions(h, w, merge))
                taps.append(index)
                weights.append(weight)
                lengths.append(h * w)
        segments = segment(lengths, num_tokens=num_tokens, num_segments=num_segments, max_seqlen=max_seqlen)
        tokens, real = segments.ids.shape[0], sum(lengths)
        pos = np.zeros((tokens, 2), dtype=np.int32)
        pos_index = np.zeros((tokens, 4), dtype=np.int32)
        pos_weight = np.zeros((tokens, 4), dtype=np.float32)
        if lengths:
            pos[:real], pos_index[:real], pos_weight[:real] = (np.concatenate(a) for a in (positions, taps, weights))
        return DeepstackBatch(torch.from_numpy(pos), segments.ids, segments.cu, torch.from_numpy(pos_index),
                              torch.from_numpy(pos_weight.view(np.int32)), segments.max_seqlen, segments.lengths)


    def block_kind(self, index: int) -> bool:
        """With or without a deepstack merger after it."""
        return index in self.config.deepstack_visual_indexes

    # -- what the block loops (TowerBase) read: learned positions, deepstack taps ------------

    def embed(self, pixels: torch.Tensor, batch: DeepstackBatch) -> torch.Tensor:
        """The patch embedding plus the interpolated position embeddings (fp32 taps): ``[T, E]``."""
        x = super().embed(pixels, batch)
        weights = batch.pos_weight_bits.view(torch.float32)
        pos = (self.pos_embed.weight[batch.pos_index.long()] * weights[..., None]).sum(1)  # [T, E], fp32 taps
        return x + pos.to(x.dtype)

    def tap(self, index: int, x: torch.Tensor, fused: bool, offset: torch.Tensor | None = None
            ) -> torch.Tensor | None:
        """Block ``index``'s deepstack feature, if it has a merger."""
        indexes = self.config.deepstack_visual_indexes
        if index not in indexes:
            return None
        merger = self.deepstack_merger_list[indexes.index(index)]
        return _merge_fused(merger, x, self.tuning.norms, offset) if fused else merger(x)

    def finish(self, merged: torch.Tensor, taps, batch: DeepstackBatch) -> torch.Tensor:
        """The main embeddings, then each deepstack feature, side by side."""
        return torch.cat([merged] + taps, dim=1)


def _merge_fused(merger: Merger, x: torch.Tensor, tuning: kernels.NormTuning,
                 offset: torch.Tensor | None = None) -> torch.Tensor:
    """A deepstack merger (LayerNorm after the 2x2 merge) with the LayerNorm kernel; ``offset``: the
    biases the fused stream keeps out of ``x`` (fp32 ``[E]``), added to each merged token's rows."""
    norm, unit = merger.norm, merger.merged_dim // x.shape[1]
    offset = None if offset is None else offset.repeat(unit)
    h = kernels.add_layernorm(x.view(-1, merger.merged_dim), None, norm.weight, norm.bias, norm.eps, offset=offset,
                              tuning=tuning)
    return merger.project(h)
