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
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .config_parsing import FamilyConfig, TowerShape, check_positive_number
from ..engine.contract import BatchLayout
from ..ops import kernels
from ..ops.activations import ACTIVATIONS
from ..ops.attention import DEFAULT_ATTENTION, attend
from ..ops.tuning import KernelTuning
from .qwen2_vl_fused import FusedForward
from .segments import segment
from .tower_base import TowerBase


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


@lru_cache(maxsize=1024)
def _block_major_positions(h: int, w: int, merge: int) -> np.ndarray:
    """(h, w) of each token of one frame, ordered block-major over merge x merge blocks: ``[h*w, 2]``."""
    hpos, wpos = np.meshgrid(np.arange(h, dtype=np.int32), np.arange(w, dtype=np.int32), indexing="ij")
    block = (h // merge, merge, w // merge, merge)
    hpos = hpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    wpos = wpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    out = np.stack([hpos, wpos], axis=1)
    out.flags.writeable = False
    return out


def interleave_order(num_heads: int, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The order in which the tower keeps qkv's output features: within each head of q and k,
    dim ``d`` of the checkpoint moves to ``2d`` and dim ``d + head_dim/2`` to ``2d + 1``, so the
    two dims one rotation mixes sit side by side; v keeps its order. ``order[new] = old``.

    Attention only takes dot products of q and k over the head dim, so permuting both the
    same way leaves it unchanged; side by side, a pair can rotate inside a GEMM's epilogue
    (:mod:`vitgraph.ops.gemm_rope`)."""
    half = head_dim // 2
    # Built on the CPU: on the meta device (the checkpoint loader's) these ops run through
    # torch._refs, which imports torch._dynamo (seconds).
    within = torch.arange(head_dim)
    within = within // 2 + (within % 2) * half
    qk = (torch.arange(2 * num_heads)[:, None] * head_dim + within).flatten()
    return torch.cat([qk, torch.arange(2 * num_heads * head_dim, 3 * num_heads * head_dim)]).to(device)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q and k (``[T, H, D]``, pairs side by side: :func:`interleave_order`) in fp32 and
    cast back, as the reference does; ``cos``/``sin``: ``[T, D/2]``, one angle per pair."""
    dtype = q.dtype
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)

    def rotate(x):
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2).to(dtype)

    return rotate(q), rotate(k)


def block_forward(x, cos, sin, batch, block: "VisionBlock") -> torch.Tensor:
    """The plain block: ``x + proj(attn(LN1 x))``, then ``x + fc2(act(fc1(LN2 x)))``."""
    attn, mlp = block.attn, block.mlp
    h = F.layer_norm(x, x.shape[-1:], block.norm1.weight, block.norm1.bias, eps=block.norm1.eps)
    q, k, v = F.linear(h, attn.qkv.weight, attn.qkv.bias).view(x.shape[0], 3, attn.num_heads, -1).unbind(1)
    q, k = apply_rotary(q, k, cos, sin)
    out = attend(attn.backend, q, k, v.contiguous(), batch, tuning=attn.attention_tuning)  # [T, H, D]
    x = x + F.linear(out.reshape(x.shape[0], -1), attn.proj.weight, attn.proj.bias)
    h = F.layer_norm(x, x.shape[-1:], block.norm2.weight, block.norm2.bias, eps=block.norm2.eps)
    return x + F.linear(ACTIVATIONS[block.act_name](F.linear(h, mlp.fc1.weight, mlp.fc1.bias)),
                        mlp.fc2.weight, mlp.fc2.bias)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # A stride == kernel Conv3d over one patch per row is a plain GEMM: [T, C*t*p*p] @ W^T.
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1))


class VisionAttention(nn.Module):
    """Parameters of the attention half of a block; the math lives in :func:`block_forward` and :meth:`Qwen2VisionTower.forward_fused`."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim, bias=True)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=True)
        self.backend = "sdpa"
        self.attention_tuning = DEFAULT_ATTENTION
        keep_qkv_interleaved(self, cfg.num_heads, cfg.head_dim)


def keep_qkv_interleaved(attn: nn.Module, num_heads: int, head_dim: int) -> None:
    """Keep ``attn.qkv``'s rows with q's and k's head dims interleaved (:func:`interleave_order`),
    the layout the rotary kernels read; state dicts, in and out, keep the checkpoint's order."""
    attn._head_layout = (num_heads, head_dim)
    attn.register_load_state_dict_pre_hook(_interleave_qkv_on_load)
    attn.register_state_dict_post_hook(_restore_qkv_on_save)


def _interleave_qkv_on_load(attn: nn.Module, state_dict, prefix, *args) -> None:
    for name in ("qkv.weight", "qkv.bias"):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value.shape[:1] == (attn.qkv.out_features,):
            state_dict[prefix + name] = value[interleave_order(*attn._head_layout, device=value.device)]


def _restore_qkv_on_save(attn: nn.Module, state_dict, prefix, local_metadata) -> None:
    for name in ("qkv.weight", "qkv.bias"):
        value = state_dict.get(prefix + name)
        if value is not None:
            inverse = torch.argsort(interleave_order(*attn._head_layout))
            state_dict[prefix + name] = value[inverse.to(value.device)]


class VisionMlp(nn.Module):
    """Parameters of the MLP half of a block; the math lives in :func:`block_forward` and :meth:`Qwen2VisionTower.forward_fused`."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.embed_dim, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.embed_dim)


class VisionBlock(nn.Module):
    """Pre-norm block: ``x + proj(attn(LN1 x))``, then ``x + fc2(act(fc1(LN2 x)))``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMlp(cfg)
        self.act_name = cfg.hidden_act

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        return block_forward(x, cos, sin, batch, self)


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = cfg.embed_dim * cfg.merge_unit
        self.ln_q = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(), nn.Linear(self.merged_dim, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each merge_unit consecutive rows are one 2x2 block: [T, E] -> [T/4, 4E] -> [T/4, hidden].
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


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


class Qwen2VisionTower(FusedForward, TowerBase, nn.Module):
    """Qwen2-VL ViT plus patch merger. Knows nothing of CUDA graphs; keeps the engine's
    contract (:class:`vitgraph.engine.contract.VisionTower`)."""

    gemm_backends = ("cublas", "quack")  # quack's epilogues are written for this tower's MLP and rotary
    tuning_reads = frozenset({"gemm", "norms", "attention"})

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self._init_rotary()
        self.fused = False
        self.tuning = KernelTuning()  # the kernels' (vitgraph.ops.tuning): the plain paths until set

    # -- the engine's contract ------------------------------------------------------

    @property
    def output_width(self) -> int:
        return self.config.hidden_size

    @staticmethod
    def segments(grid: Grid) -> list[int]:
        """Each temporal slice is its own attention segment: frames do not see each other."""
        t, h, w = grid
        return [h * w] * t

    def set_attention_backend(self, backend: str) -> None:
        for block in self.blocks:
            block.attn.backend = backend

    def set_tuning(self, tuning: KernelTuning) -> None:
        """The kernels' tuning: GEMM backend and tiles, LayerNorm layouts, FlashAttention 4's tiles."""
        self.tuning = tuning
        for block in self.blocks:
            block.attn.attention_tuning = tuning.attention
        if tuning.gemm.backend == "quack":
            self.rope_columns()  # built now, never inside a capture

    def fuse(self, enabled: bool = True) -> None:
        """Run the elementwise work through vitgraph's Triton kernels (:mod:`vitgraph.ops.kernels`):
        each residual add joined to the next LayerNorm, rotary in place, QuickGELU in place,
        and dense cuDNN attention for one-segment padded layouts. Needs triton and a CUDA
        device (or Triton's interpreter); any dtype, though the dense and flash attention
        paths are fp16/bf16 only and other backends keep their own path."""
        if enabled and not kernels.usable(self.patch_embed.proj.weight.device):
            raise ValueError("fuse=True needs the triton package and a CUDA device (or TRITON_INTERPRET=1)")
        self.fused = enabled

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
        frames = [_block_major_positions(h, w, merge) for t, h, w in grids for _ in range(t)]
        segments = segment([len(f) for f in frames], num_tokens=num_tokens, num_segments=num_segments,
                           max_seqlen=max_seqlen)
        positions = np.zeros((segments.ids.shape[0], 2), dtype=np.int32)
        if frames:
            positions[:int(segments.cu[-1])] = np.concatenate(frames)
        return VisionBatch(torch.from_numpy(positions), segments.ids, segments.cu, segments.max_seqlen,
                           segments.lengths)

    def forward(self, pixels: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        """``[T, input_width]`` pixel rows -> ``[T / merge_unit, output_width]``."""
        return self.forward_fused(pixels, batch) if self.fused else self.forward_reference(pixels, batch)

    def warm_up(self, pixels: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        """The forward through the first block only, then the merger: the same kernels at the
        same shapes as :meth:`forward` (every block runs the same ones), so what has to happen
        once before a CUDA graph capture (JIT compiles and loads, library plans and
        workspaces) happens here, for 1/depth of the work. Not the model's output."""
        first = self.blocks[:1]
        if self.fused:
            return self.forward_fused(pixels, batch, blocks=first)
        return self.forward_reference(pixels, batch, blocks=first)

    def forward_reference(self, pixels: torch.Tensor, batch: VisionBatch,
                          blocks: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """Plain PyTorch ops, one per step of the reference model (any device and dtype).
        ``blocks``: a prefix of the tower's blocks to run instead of all (see :meth:`warm_up`)."""
        cos, sin = self.rotary(batch.positions)  # first: see forward_fused
        x = self.patch_embed(pixels)  # [T, E]
        for block in self.blocks if blocks is None else blocks:
            x = block(x, cos, sin, batch)
        return self.merger(x)  # [T / merge_unit, hidden]
