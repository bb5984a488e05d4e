"""Attention segments on the host, shared by every family's ``build_batch``: the capacity
checks of a fixed layout and one segmentation's ids and offsets (numpy, CPU tensors out).

A layout holds ``tokens`` rows, of which the first ``real`` are the items' tokens, and a
number of slots per segmentation. Padding rows get segment id -1 and lie past the last
offset; unused slots repeat the last offset (empty segments, never zeros)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Segmentation:
    """One segmentation of a layout: ``ids [tokens]`` int32 (-1 on padding rows) and
    ``cu [slots + 1]`` int32 offsets."""

    ids: torch.Tensor
    cu: torch.Tensor


def check_capacity(tokens: int, real: int, slots: dict[str, tuple[int, int]]) -> None:
    """Refuse a layout of ``tokens`` rows that cannot hold ``real`` ones, or whose slots cannot
    hold a segmentation's segments: ``slots`` maps each segmentation's plural name to
    ``(slots, segments)``, in the order the message names them."""
    if tokens < real or any(have < need for have, need in slots.values()):
        held = "".join(f" / {have} {name}" for name, (have, _) in slots.items())
        wanted = "".join(f" / {need} {name}" for name, (_, need) in slots.items())
        raise ValueError(f"layout of {tokens} tokens{held} cannot hold {real} tokens{wanted}")


def bounded_seqlen(max_seqlen: int | None, lengths: Sequence[int], what: str = "segment") -> int:
    """The ``max_seqlen`` a batch carries: the bound asked for (refused below the longest
    ``what``), else the longest; at least 1."""
    longest = max(lengths, default=0)
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen {max_seqlen} is shorter than the longest {what} ({longest})")
    return max(max_seqlen or longest, 1)


def segmentation(lengths: Sequence[int], tokens: int, slots: int) -> Segmentation:
    """Segments of ``lengths`` rows each, one after another from row 0, in a layout of ``tokens``
    rows and ``slots`` segment slots."""
    counts = np.asarray(lengths, dtype=np.int64)  # an int array even when empty: np.repeat refuses floats
    real = int(counts.sum())
    check_capacity(tokens, real, {"segments": (slots, len(counts))})
    ids = np.full(tokens, -1, dtype=np.int32)
    ids[:real] = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    cu = np.full(slots + 1, real, dtype=np.int32)
    cu[0] = 0
    cu[1:len(counts) + 1] = np.cumsum(counts)
    return Segmentation(torch.from_numpy(ids), torch.from_numpy(cu))


@dataclass(frozen=True)
class SegmentLayout:
    """One segmentation of a batch with its capacity checked: ``ids``, ``cu``, the
    ``max_seqlen`` to bake in, and ``lengths`` on an exact (unpadded) layout, else None."""

    ids: torch.Tensor
    cu: torch.Tensor
    max_seqlen: int
    lengths: tuple[int, ...] | None


def segment(lengths: Sequence[int], *, num_tokens: int | None = None, num_segments: int | None = None,
            max_seqlen: int | None = None) -> SegmentLayout:
    """A batch of one segmentation (each frame its own segment) in a layout of ``num_tokens``
    rows and ``num_segments`` slots (default: exactly the segments')."""
    lengths = [int(n) for n in lengths]
    real = sum(lengths)
    tokens = real if num_tokens is None else num_tokens
    slots = len(lengths) if num_segments is None else num_segments
    check_capacity(tokens, real, {"segments": (slots, len(lengths))})
    seqlen = bounded_seqlen(max_seqlen, lengths)
    parts = segmentation(lengths, tokens, slots)
    exact = tokens == real and slots == len(lengths)
    return SegmentLayout(parts.ids, parts.cu, seqlen, tuple(lengths) if exact else None)


@lru_cache(maxsize=1024)
def block_major_positions(h: int, w: int, merge: int) -> np.ndarray:
    """(h, w) of each token of one frame, ordered block-major over merge x merge blocks: ``[h*w, 2]``
    (the order every family's patch rows come in)."""
    hpos, wpos = np.meshgrid(np.arange(h, dtype=np.int32), np.arange(w, dtype=np.int32), indexing="ij")
    block = (h // merge, merge, w // merge, merge)
    hpos = hpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    wpos = wpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    out = np.stack([hpos, wpos], axis=1)
    out.flags.writeable = False
    return out
