"""The Qwen2-VL vision tower: patch embed, 2-D rotary, pre-norm blocks, patch merger.

The work is split in two so that the forward can be captured in a CUDA graph:

* :meth:`Qwen2VisionTower.build_batch` (host, numpy, no GPU work) turns a list of
  ``(t, h, w)`` grids into a :class:`VisionBatch`: token positions, segment ids,
  ``cu_seqlens`` and ``max_seqlen``, optionally padded to a fixed layout.
* :meth:`Qwen2VisionTower.forward` runs from pixel rows plus a ``VisionBatch``.
  It never syncs with the host and has no data-dependent shapes or branches;
  rotary cos/sin are computed inside it (fp32) from the positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn

from .config_parsing import FamilyConfig, TowerShape, check_positive_number
from ..engine.contract import BatchLayout
from .segments import block_major_positions, segment
from .tower_base import TowerBase, attention_module


_CEILINGS = {"depth": 1024, "embed_dim": 65536, "num_heads": 1024, "hidden_size": 65536, "patch_size": 64,
             "temporal_patch_size": 16, "spatial_merge_size": 8, "in_channels": 16}
MAX_MLP_DIM = 1 << 18


@dataclass(frozen=True)
class VisionConfig(FamilyConfig, TowerShape):
    """Shape of a Qwen2-VL vision tower (the ``vision_config`` block): ``embed_dim`` is the
    tower's width, ``hidden_size`` the merger's output (the LLM's width)."""

    CEILINGS, REQUIRED = _CEILINGS, ("depth", "embed_dim", "num_heads", "hidden_size")
    FAMILY = "qwen2_vl"

    depth: int = 32
    embed_dim: int = 1280
    num_heads: int = 16
    mlp_ratio: float = 4.0
    hidden_size: int = 1536  # merger output width = the LLM's width
    hidden_act: str = "quick_gelu"
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0

    def check(self) -> None:
        check_positive_number("mlp_ratio", self.mlp_ratio)
        if not 0 < self.mlp_dim <= MAX_MLP_DIM:
            raise ValueError(f"vision_config: embed_dim * mlp_ratio (the MLP width) must be in [1, {MAX_MLP_DIM}], "
                             f"got {self.embed_dim} * {self.mlp_ratio}")

    @property
    def mlp_dim(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)

    def transformers_fields(self) -> dict:
        mlp_ratio = int(self.mlp_ratio) if float(self.mlp_ratio).is_integer() else self.mlp_ratio
        return dict(depth=self.depth, embed_dim=self.embed_dim, num_heads=self.num_heads, mlp_ratio=mlp_ratio,
                    hidden_size=self.hidden_size, hidden_act=self.hidden_act, patch_size=self.patch_size,
                    temporal_patch_size=self.temporal_patch_size, spatial_merge_size=self.spatial_merge_size,
                    in_channels=self.in_channels)

Grid = tuple[int, int, int]


@dataclass
class VisionBatch(BatchLayout):
    """Everything the forward needs besides the pixels.

    Shapes: ``positions [T, 2]`` (h, w of each token), ``segment_ids [T]`` (-1 on
    padding rows), ``cu_seqlens [S + 1]`` int32. ``max_seqlen``, ``segment_lengths``
    and what follows from them (``dense``, ``padded``) are Python values, baked into a
    captured graph.
    """

    positions: torch.Tensor
    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    # The exact segment lengths of an unpadded (eager) batch; None on a fixed layout, whose
    # rows past cu_seqlens[-1] and empty segment slots are padding.
    segment_lengths: tuple[int, ...] | None = None

    @property
    def padded(self) -> bool:
        return self.segment_lengths is None

    @property
    def dense(self) -> bool:
        """Exactly one segment slot."""
        return self.cu_seqlens.shape[0] == 2


class VisionBlock(nn.Module):
    """Pre-norm block: ``x + proj(attn(LN1 x))``, then ``x + fc2(act(fc1(LN2 x)))`` (the math is
    :class:`TowerBase`'s)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.attn = attention_module(cfg, cfg.embed_dim)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(cfg.embed_dim, cfg.mlp_dim), nn.Linear(cfg.mlp_dim, cfg.embed_dim)


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = cfg.embed_dim * cfg.merge_unit
        self.ln_q = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(), nn.Linear(self.merged_dim, cfg.hidden_size))

    @property
    def norm(self) -> nn.LayerNorm:
        """The norm before the merge, as the block loops name it."""
        return self.ln_q

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each merge_unit consecutive rows are one 2x2 block: [T, E] -> [T/4, 4E] -> [T/4, hidden].
        return self.project(self.ln_q(x).view(-1, self.merged_dim))


def expected_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """The tower's state-dict names and shapes for ``cfg``, without building it: a checkpoint
    is checked against these before any module exists."""
    e, m, merged = cfg.embed_dim, cfg.mlp_dim, cfg.embed_dim * cfg.merge_unit
    shapes = {"patch_embed.proj.weight": (e, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                          cfg.patch_size)}
    block = {"norm1.weight": (e,), "norm1.bias": (e,), "norm2.weight": (e,), "norm2.bias": (e,),
             "attn.qkv.weight": (3 * e, e), "attn.qkv.bias": (3 * e,), "attn.proj.weight": (e, e),
             "attn.proj.bias": (e,), "mlp.fc1.weight": (m, e), "mlp.fc1.bias": (m,), "mlp.fc2.weight": (e, m),
             "mlp.fc2.bias": (e,)}
    for i in range(cfg.depth):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    shapes.update({"merger.ln_q.weight": (e,), "merger.ln_q.bias": (e,), "merger.mlp.0.weight": (merged, merged),
                   "merger.mlp.0.bias": (merged,), "merger.mlp.2.weight": (cfg.hidden_size, merged),
                   "merger.mlp.2.bias": (cfg.hidden_size,)})
    return shapes


class Qwen2VisionTower(TowerBase):
    """Qwen2-VL ViT plus patch merger: LayerNorm blocks with a QuickGELU MLP (fc1, fc2), frames
    attending alone. Everything else is :class:`TowerBase`'s."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, kernel_size=kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self._init_tower(cfg)

    @property
    def output_width(self) -> int:
        return self.config.hidden_size

    def build_batch(
        self,
        grids: Sequence[Grid],
        *,
        num_tokens: int | None = None,
        num_segments: int | None = None,
        max_seqlen: int | None = None,
    ) -> VisionBatch:
        """Host-side metadata for ``grids``, padded to ``num_tokens`` rows and ``num_segments`` segments.

        Padding rows get position (0, 0) and segment id -1 and lie past ``cu_seqlens[-1]``;
        unused segment slots repeat the last offset (empty segments, never zeros).
        Returns CPU tensors; move them with :meth:`VisionBatch.to`.
        """
        merge = self.config.spatial_merge_size
        frames = [block_major_positions(h, w, merge) for t, h, w in grids for _ in range(t)]
        segments = segment([len(f) for f in frames], num_tokens=num_tokens, num_segments=num_segments,
                           max_seqlen=max_seqlen)
        positions = np.zeros((segments.ids.shape[0], 2), dtype=np.int32)
        if frames:
            positions[:int(segments.cu[-1])] = np.concatenate(frames)
        return VisionBatch(torch.from_numpy(positions), segments.ids, segments.cu, segments.max_seqlen,
                           segments.lengths)
