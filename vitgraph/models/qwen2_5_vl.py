"""The Qwen2.5-VL vision tower: RMSNorm, SwiGLU MLP, window attention in every block but
``fullatt_block_indexes``, and a merger whose output rows are put back in item order.

Windows: the merged tokens (2x2 patch groups) of each frame are reordered window-major,
``window_size // patch_size // spatial_merge_size`` merged tokens a side (4: 64 patches for
the released checkpoints), windows cut by the frame's edge where its sides are not
multiples of that. :meth:`Qwen25VisionTower.build_batch` computes the permutation and its
inverse on the host, with two segmentations: frames (full attention) and windows. The
forward gathers by them; it never syncs with the host.

This file names what :class:`TowerBase`'s block loops run differently for Qwen2.5-VL (the
reference one exact against transformers' ``Qwen2_5_VisionTransformerPretrainedModel``). Its
CUDA graphs keep both segmentations padded to capacities that follow from a bucket's
(:func:`window_capacity`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn

from ..engine.contract import BatchLayout
from ..ops.attention import SegmentFlags
from .config_parsing import FamilyConfig, TowerShape, check_block_indexes
from .segments import block_major_positions, bounded_seqlen, check_capacity, segmentation
from .tower_base import TowerBase, attention_module

_CEILINGS = {"depth": 1024, "hidden_size": 65536, "num_heads": 1024, "intermediate_size": 1 << 18,
             "out_hidden_size": 65536, "patch_size": 64, "temporal_patch_size": 16, "spatial_merge_size": 8,
             "in_channels": 16, "window_size": 4096}
_REQUIRED = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "window_size",
             "fullatt_block_indexes")


@dataclass(frozen=True)
class Qwen25VisionConfig(FamilyConfig, TowerShape):
    """Shape of a Qwen2.5-VL vision tower (the ``vision_config`` block). ``hidden_size`` is the
    tower's width; ``out_hidden_size`` the merger's output (the LLM's width)."""

    CEILINGS, REQUIRED, TUPLES = _CEILINGS, _REQUIRED, ("fullatt_block_indexes",)
    FAMILY = "qwen2_5_vl"

    depth: int = 32
    hidden_size: int = 1280
    num_heads: int = 16
    intermediate_size: int = 3420
    out_hidden_size: int = 3584
    window_size: int = 112  # pixels
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0

    def check(self) -> None:
        if self.window_patches < 1:
            raise ValueError(f"vision_config.window_size ({self.window_size}) must span at least one merged token "
                             f"({self.patch_size * self.spatial_merge_size} pixels)")
        check_block_indexes("fullatt_block_indexes", self.fullatt_block_indexes, self.depth)

    @property
    def window_patches(self) -> int:
        """Merged tokens along a window's side."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclass
class Segments(SegmentFlags):
    """One segmentation of a batch, as the attention backends read it (``SegmentedBatch``)."""

    cu_seqlens: torch.Tensor
    segment_ids: torch.Tensor
    max_seqlen: int
    segment_lengths: tuple[int, ...] | None


@dataclass
class WindowBatch(BatchLayout):
    """Metadata of one call, in window order: ``window_index [T/4]`` (window-order merged token ->
    its item-order index), ``reverse_index [T/4]`` its inverse, ``positions [T, 2]`` and two
    segmentations (frames, windows: ``*_ids [T]`` with -1 on padding rows, ``*_cu``)."""

    window_index: torch.Tensor
    reverse_index: torch.Tensor
    positions: torch.Tensor
    frame_ids: torch.Tensor
    frame_cu: torch.Tensor
    window_ids: torch.Tensor
    window_cu: torch.Tensor
    max_frame_seqlen: int
    max_window_seqlen: int
    frame_lengths: tuple[int, ...] | None = None  # exact (unpadded) batches only
    window_lengths: tuple[int, ...] | None = None

    @property
    def frames(self) -> Segments:
        return Segments(self.frame_cu, self.frame_ids, self.max_frame_seqlen, self.frame_lengths)

    @property
    def windows(self) -> Segments:
        return Segments(self.window_cu, self.window_ids, self.max_window_seqlen, self.window_lengths)


@lru_cache(maxsize=1024)
def frame_windows(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """One frame's window order: (merged-token index of each window-order position, patches per
    window), windows row-major over the frame, cut by its edge; empty windows dropped."""
    gh, gw = h // merge, w // merge
    nh, nw = -(-gh // side), -(-gw // side)
    grid = np.full((nh * side, nw * side), -1, dtype=np.int64)
    grid[:gh, :gw] = np.arange(gh * gw).reshape(gh, gw)
    tiles = grid.reshape(nh, side, nw, side).transpose(0, 2, 1, 3).reshape(nh * nw, side * side)
    counts = (tiles >= 0).sum(1)
    order, lengths = tiles[tiles >= 0], counts[counts > 0] * merge * merge
    order.flags.writeable = lengths.flags.writeable = False  # cached: shared by every call
    return order, lengths


def window_capacity(groups: int, frames: int, side: int) -> int:
    """The most windows ``groups`` merged tokens in at most ``frames`` frames can form, with
    windows ``side`` merged tokens a side. A frame of ``a x b`` merged tokens has
    ``ceil(a/side) * ceil(b/side) <= ceil(a*b/side)`` windows (a one-token-high strip is the
    worst case), so all of them have at most ``(groups + frames * (side - 1)) // side``."""
    return min(groups, (groups + frames * (side - 1)) // side)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics; the weight multiplies after the cast back, as the reference does.
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


MLP_ALIGN = 64  # the SwiGLU's width is padded to this: 3420 leaves cuBLAS unaligned rows (6840 bytes)


class SwiGLU(nn.Module):
    """``down(act(gate x) * up x)``, kept as one ``gate_up`` GEMM (each row: gate, then up) of a
    width padded to ``MLP_ALIGN`` with zero rows (and ``down_proj`` with zero columns), which
    adds exact zeros. State dicts, in and out, keep the checkpoint's three projections."""

    def __init__(self, cfg: Qwen25VisionConfig) -> None:
        super().__init__()
        self.width = cfg.intermediate_size
        self.padded = -(-cfg.intermediate_size // MLP_ALIGN) * MLP_ALIGN
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * self.padded, bias=True)
        self.down_proj = nn.Linear(self.padded, cfg.hidden_size, bias=True)
        with torch.no_grad():  # the padding is zero from the start (random weights too), not only once loaded
            for rows in (slice(self.width, self.padded), slice(self.padded + self.width, None)):
                self.gate_up.weight[rows].zero_()
                self.gate_up.bias[rows].zero_()
            self.down_proj.weight[:, self.width:].zero_()
        self.register_load_state_dict_pre_hook(_pad_on_load)
        self.register_state_dict_post_hook(_unpad_on_save)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _pad_on_load(mlp: SwiGLU, state_dict, prefix, *args) -> None:
    names = [prefix + n for n in ("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias",
                                  "down_proj.weight")]
    if not all(isinstance(state_dict.get(n), torch.Tensor) for n in names):
        return  # load_state_dict reports what is missing
    gate_w, gate_b, up_w, up_b, down_w = (state_dict.pop(n) for n in names)
    if gate_w.shape[0] != mlp.width or down_w.shape[-1] != mlp.width:
        state_dict.update(zip(names, (gate_w, gate_b, up_w, up_b, down_w)))
        return  # a shape mismatch: reported under the checkpoint's names
    state_dict[prefix + "gate_up.weight"] = torch.cat([_pad_rows(gate_w, mlp.padded), _pad_rows(up_w, mlp.padded)])
    state_dict[prefix + "gate_up.bias"] = torch.cat([_pad_rows(gate_b, mlp.padded), _pad_rows(up_b, mlp.padded)])
    state_dict[prefix + "down_proj.weight"] = _pad_rows(down_w.t(), mlp.padded).t().contiguous()


def _unpad_on_save(mlp: SwiGLU, state_dict, prefix, local_metadata) -> None:
    weight, bias = state_dict.pop(prefix + "gate_up.weight"), state_dict.pop(prefix + "gate_up.bias")
    w, p = mlp.width, mlp.padded
    state_dict[prefix + "gate_proj.weight"], state_dict[prefix + "up_proj.weight"] = weight[:w], weight[p:p + w]
    state_dict[prefix + "gate_proj.bias"], state_dict[prefix + "up_proj.bias"] = bias[:w], bias[p:p + w]
    state_dict[prefix + "down_proj.weight"] = state_dict[prefix + "down_proj.weight"][:, :w]


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen25VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.attn = attention_module(cfg, cfg.hidden_size)
        self.mlp = SwiGLU(cfg)


class PatchMerger(nn.Module):
    def __init__(self, cfg: Qwen25VisionConfig) -> None:
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(),
                                 nn.Linear(self.merged_dim, cfg.out_hidden_size))

    @property
    def norm(self) -> RMSNorm:
        """The norm before the merge, as the fused block loop names it."""
        return self.ln_q

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.ln_q(x).view(-1, self.merged_dim))  # [T/4, out]


def expected_shapes(cfg: Qwen25VisionConfig) -> dict[str, tuple[int, ...]]:
    """State-dict names and shapes for ``cfg``, without building the tower."""
    e, m, merged = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit
    shapes = {"patch_embed.proj.weight": (e, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                          cfg.patch_size)}
    block = {"norm1.weight": (e,), "norm2.weight": (e,), "attn.qkv.weight": (3 * e, e), "attn.qkv.bias": (3 * e,),
             "attn.proj.weight": (e, e), "attn.proj.bias": (e,), "mlp.gate_proj.weight": (m, e),
             "mlp.gate_proj.bias": (m,), "mlp.up_proj.weight": (m, e), "mlp.up_proj.bias": (m,),
             "mlp.down_proj.weight": (e, m), "mlp.down_proj.bias": (e,)}
    for i in range(cfg.depth):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    shapes.update({"merger.ln_q.weight": (e,), "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
                   "merger.mlp.2.weight": (cfg.out_hidden_size, merged), "merger.mlp.2.bias": (cfg.out_hidden_size,)})
    return shapes


class Qwen25VisionTower(TowerBase):
    """Qwen2.5-VL ViT plus patch merger: RMSNorm, a SwiGLU MLP, windows. Knows nothing of CUDA graphs."""

    NORM, MLP, GATED = "rms", ("gate_up", "down_proj"), True

    def __init__(self, cfg: Qwen25VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel,
                                          bias=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self._init_tower(cfg)

    # -- the engine's contract ------------------------------------------------------


    @property
    def output_width(self) -> int:
        return self.config.out_hidden_size


    def build_batch(self, grids: Sequence[tuple[int, int, int]], *, num_tokens: int | None = None,
                    num_segments: int | None = None, max_seqlen: int | None = None,
                    num_windows: int | None = None) -> WindowBatch:
        """Host metadata for ``grids`` in window order, padded to ``num_tokens`` rows, ``num_segments``
        frame slots and ``num_windows`` window slots (default: :func:`window_capacity`, the most
        windows such a layout can hold). A padded layout's window ``max_seqlen`` is the window's
        area (at most ``max_seqlen``), the same for every call. Padding merged tokens map to
        themselves, after every real one, so they never join a real window; the window count is
        checked against its capacity here, before every replay. Returns CPU tensors."""
        cfg, unit = self.config, self.config.merge_unit
        order, frames, frame_lengths, window_lengths = self._frames(grids)
        real = sum(frame_lengths)
        tokens = real if num_tokens is None else num_tokens
        frame_slots = len(frame_lengths) if num_segments is None else num_segments
        padded = num_tokens is not None or num_segments is not None
        if num_windows is not None:
            window_slots = num_windows
        elif padded:
            window_slots = window_capacity(tokens // unit, frame_slots, cfg.window_patches)
        else:
            window_slots = len(window_lengths)
        check_capacity(tokens, real, {"frames": (frame_slots, len(frame_lengths)),
                                      "windows": (window_slots, len(window_lengths))})
        frame_seqlen = bounded_seqlen(max_seqlen, frame_lengths, "frame")
        window_index, reverse_index, positions = self._permutation(order, frames, tokens, real)
        by_frame = segmentation(frame_lengths, tokens, frame_slots)
        by_window = segmentation(window_lengths, tokens, window_slots)
        exact = tokens == real and frame_slots == len(frame_lengths) and window_slots == len(window_lengths)
        # A graph bakes max_seqlen in: a padded layout's is the bound, not this call's longest window.
        window_seqlen = (min(cfg.window_patches ** 2 * unit, frame_seqlen) if padded
                         else max(max(window_lengths, default=0), 1))
        return WindowBatch(window_index, reverse_index, positions, by_frame.ids, by_frame.cu, by_window.ids,
                           by_window.cu, frame_seqlen, window_seqlen,
                           tuple(frame_lengths) if exact else None, tuple(window_lengths) if exact else None)

    def _frames(self, grids: Sequence[tuple[int, int, int]]):
        """Each frame's window order (merged-token indexes into the batch), its tokens' positions in
        item order, and the frames' and windows' lengths in tokens."""
        cfg, merge, unit = self.config, self.config.spatial_merge_size, self.config.merge_unit
        order, frames, frame_lengths, window_lengths = [], [], [], []
        base = 0
        for t, h, w in grids:
            idx, wins = frame_windows(h, w, merge, cfg.window_patches)
            per_frame = h * w // unit
            for f in range(t):
                order.append(idx + base + f * per_frame)
                window_lengths.extend(wins.tolist())
                frame_lengths.append(h * w)
                frames.append(block_major_positions(h, w, merge))
            base += t * per_frame
        return order, frames, frame_lengths, window_lengths

    def _permutation(self, order: list, frames: list, tokens: int, real: int):
        """``window_index``, its inverse ``reverse_index`` and ``positions`` in window order; padding
        merged tokens map to themselves, after every real one."""
        unit = self.config.merge_unit
        groups = tokens // unit
        window_index = np.arange(groups, dtype=np.int64)
        if order:
            window_index[:real // unit] = np.concatenate(order)
        reverse_index = np.empty_like(window_index)
        reverse_index[window_index] = np.arange(groups)
        positions = np.zeros((tokens, 2), dtype=np.int32)
        if frames:
            item_order = np.concatenate(frames)  # [real, 2], item order
            positions[:real] = item_order.reshape(-1, unit, 2)[window_index[:real // unit]].reshape(-1, 2)
        return (torch.from_numpy(window_index.astype(np.int32)), torch.from_numpy(reverse_index.astype(np.int32)),
                torch.from_numpy(positions))


    def block_kind(self, index: int) -> bool:
        """Full attention (over frames) or windowed: two segmentations, two attention layouts."""
        return index in self.config.fullatt_block_indexes

    attention_kind = block_kind

    # -- what the block loops (TowerBase) read: windows ----------------------------------------

    def embed(self, pixels: torch.Tensor, batch: WindowBatch) -> torch.Tensor:
        """The patch embedding, rows gathered into window order: ``[T, E]``."""
        rows, unit = pixels.shape[0], self.merge_unit
        x = super().embed(pixels, batch)  # [T, E]
        return x.view(rows // unit, unit, -1)[batch.window_index.long()].view(rows, -1)

    def attention_segments(self, batch: WindowBatch, index: int) -> Segments:
        return batch.frames if index in self.config.fullatt_block_indexes else batch.windows

    def finish(self, merged: torch.Tensor, taps, batch: WindowBatch) -> torch.Tensor:
        """The merger's rows back in item order."""
        return merged[batch.reverse_index.long()]
