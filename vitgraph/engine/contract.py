"""What the engine asks of a vision tower: everything it calls, and nothing of any family.

A tower's call is split in two so that its forward can be captured in a CUDA graph:
``build_batch`` (host, no GPU work) lays a call's metadata out for a bucket, and the forward
reads only that metadata and the pixel rows. The engine stages every tensor of the batch into
its static buffers before each replay and bakes every other field into the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Protocol, Sequence, runtime_checkable

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


@runtime_checkable
class VisionTower(Protocol):
    """The six members the engine uses.

    ``forward`` returns ``[T / merge_unit, output_width]``. A tower with several outputs
    (Qwen3-VL's deepstack features) returns them side by side along the width, the layout
    serving engines take as ``image_embeds``: the graphs keep one static output, and an
    item's rows stay contiguous.
    """

    input_width: int  # values per pixel row
    output_width: int  # values per output row, every output side by side
    merge_unit: int  # pixel rows per output row

    def build_batch(self, grids: Sequence[Grid], *, num_tokens: int | None = None,
                    num_segments: int | None = None, max_seqlen: int | None = None) -> BatchLayout:
        """Metadata of ``grids``, padded to ``num_tokens`` rows and ``num_segments`` frame slots
        with frames of at most ``max_seqlen`` tokens (a bucket's capacities); none: exact."""

    def __call__(self, pixels: torch.Tensor, batch: BatchLayout) -> torch.Tensor:
        """``[T, input_width]`` -> ``[T / merge_unit, output_width]``; no host sync, no data-dependent shapes."""

    def warm_up(self, pixels: torch.Tensor, batch: BatchLayout) -> object:
        """Run every kernel ``__call__`` runs for this layout, for less work (before a capture)."""
