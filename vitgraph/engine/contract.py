"""What the engine asks of a vision tower: everything it calls, and nothing of any family.

A tower's call is split in two so that its forward can be captured in a CUDA graph:
``build_batch`` (host, no GPU work) lays a call's metadata out for a bucket, and the forward
reads only that metadata and the pixel rows. The engine stages every tensor of the batch into
its static buffers before each replay and bakes every other field into the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

Grid = tuple[int, int, int]


@dataclass
class BatchLayout:
    """Host metadata of one call, laid out for a bucket. A tower subclasses it with its own
    fields: every tensor field is int32 (positions, segment ids, as many segmentations' offsets
    as the tower attends over, gather indices), staged into the graphs' static buffers in field
    order; every other field (a ``max_seqlen``, ...) is a Python value a graph bakes in."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def to(self, device: torch.device, non_blocking: bool = False):
        moved = {name: t.to(device, non_blocking=non_blocking) for name, t in self.tensors().items()}
        return replace(self, **moved)


@dataclass(frozen=True)
class TowerDims:
    """The widths the runtime sizes its kernels' tuning and its inputs by."""

    embed_dim: int  # the blocks' width
    num_heads: int
    head_dim: int
    mlp_width: int  # the blocks' MLP hidden width
    patch_width: int  # values per pixel row (the tower's ``input_width``)
    spatial_merge_size: int  # a grid's h and w are multiples of it


@runtime_checkable
class VisionTower(Protocol):
    """What the runtime (the graph bank, the encoder, its options and the kernel precompile)
    calls of a tower, and nothing else.

    ``forward`` returns ``[T / merge_unit, output_width]``. A tower with several outputs
    (Qwen3-VL's deepstack features) returns them side by side along the width, the layout
    serving engines take as ``image_embeds``: the graphs keep one static output, and an
    item's rows stay contiguous.
    """

    name: str  # what repr and stats call it ("qwen2_vl", ...)
    shape: TowerDims
    # The image (video) preprocessing encode_images and uint8 rows use (vitgraph.images.preprocess.
    # ProcessorConfig); None: float rows only (the video one: the image one).
    processor: Any
    video_processor: Any
    input_width: int  # values per pixel row
    output_width: int  # values per output row, every output side by side
    output_parts: int  # outputs side by side in each row (1, or 1 + deepstack features)
    merge_unit: int  # pixel rows per output row
    gemm_backends: tuple[str, ...]  # the GEMM backends its fused forward has (vitgraph.ops.gemm)
    tuning_reads: frozenset[str]  # the kernel settings its forwards read: "gemm", "norms.one_row_max_rows", ...
    fused: bool  # whether the fused forward (vitgraph's kernels) runs

    def configure(self, attention: str, fused: bool, tuning: Any, precision: str = "bf16") -> None:
        """Set the attention backend, the fused forward (on or off), the kernels' tuning
        (``vitgraph.ops.tuning.KernelTuning``) and the blocks' GEMM precision ("bf16": the
        weights' dtype; "fp8"); refuses what cannot run here."""

    def build_batch(self, grids: Sequence[Grid], *, num_tokens: int | None = None,
                    num_segments: int | None = None, max_seqlen: int | None = None) -> BatchLayout:
        """Metadata of ``grids``, padded to ``num_tokens`` rows and ``num_segments`` frame slots
        with frames of at most ``max_seqlen`` tokens (a bucket's capacities); none: exact."""

    def __call__(self, pixels: torch.Tensor, batch: BatchLayout) -> torch.Tensor:
        """``[T, input_width]`` -> ``[T / merge_unit, output_width]``; no host sync, no data-dependent shapes."""

    def warm_up(self, pixels: torch.Tensor, batch: BatchLayout) -> object:
        """Run every kernel ``__call__`` runs for this layout (one block of each kind), for less
        work (before a capture)."""


@runtime_checkable
class Precompiled(Protocol):
    """The hooks of a tower whose forward compiles kernels on first use (FlashAttention 4's,
    quack's, Triton's): the precompile runs each once, in worker processes, before capture."""

    def jit_kernels(self, batch: BatchLayout) -> list[tuple[str, tuple]]:
        """``(op, key)`` of each kernel compiled on first use that the forward runs for ``batch``."""

    def run_jit_kernel(self, op: str, batch: BatchLayout) -> None:
        """Run the one kernel of ``op`` that ``batch``'s forward runs (compiling it)."""

    def run_triton_kernels(self, batch: BatchLayout) -> None:
        """Run vitgraph's Triton kernels at ``batch``'s shapes (compiling them)."""

    def one_block_recipe(self) -> dict:
        """How a worker process builds a random-weight one-block tower of this shape (JSON):
        ``{"builder": "module:function", "kwargs": {...}}``; the function takes ``device`` and
        ``dtype`` besides ``kwargs`` (see :func:`vitgraph.models.one_block_tower`)."""
