"""Routing timed at capture: where a single frame replays fastest (its budget's one-frame
dense bucket, or the packed one), and which packed buckets the next larger one beats.

Both graphs of a budget run the same GEMMs over the same padded rows; they differ in
attention. The dense bucket attends over every row of the bucket (padding keys masked),
at a speed set by how its query tiles fill the GPU's waves. The packed bucket's ragged
attention computes only the frame's rows, but runs slower per row (benchmarks/HISTORY.md). Which wins
depends on the bucket size and on how much of it the frame fills, so it is measured once, at
capture:

* ``d``: the dense graph (its time does not depend on the frame's size);
* ``p(t)`` and ``p(low)``: the packed graph holding one frame of the budget's size ``t``,
  and of the smallest size that lands in this budget (just above the previous budget).

The packed graph's time grows with the frame's attention, about as ``n**2``; between the
two measured sizes it is interpolated in ``n**2``. The result, per budget: single frames
of fewer tokens than the threshold replay in the packed bucket. Each time is one replay, to
keep capture short; the packed bucket must win by a margin (``SINGLE_FRAME_MARGIN``), so that
timing noise never moves a frame that fills its dense bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .planner import Bucket, Grid

@dataclass(frozen=True)
class RoutingTuning:
    """What routing times at capture."""

    single_frames: bool = True  # time dense against packed graphs; send single frames to the faster
    faster_buckets: bool = True  # time small packed buckets against the next larger; send steps to the faster
    # Packed buckets of up to this many tokens may hand their steps to the next larger one: below
    # it a library's per-shape GEMM choice can make a bucket slower than the next.
    faster_next_max_tokens: int = 1024


# By how much a faster graph must win, and what is timed at all (benchmarks/HISTORY.md, change 9 and 39).
MIN_TOKENS = 1024  # below it attention is a few percent of a replay: not worth the capture time
SINGLE_FRAME_MARGIN = 0.01  # the packed bucket must be predicted this much faster than the dense one
FASTER_NEXT_MARGIN = 0.02  # the larger bucket must be this much faster, on the smaller one's input
FASTER_NEXT_REPS = 3  # interleaved replays of each, the least kept


def single_frame_thresholds(buckets: Sequence[Bucket], time: Callable[[Bucket, list[Grid]], float],
                            frame_grid: Callable[[int], Grid], unit: int) -> dict[int, int]:
    """``{budget: n}``: a single frame of fewer than ``n`` tokens replays faster in the packed
    bucket of that budget than in its dense one. Budgets without both graphs, or where the
    dense one always wins, are left out. ``time(bucket, grids)``: GPU ms of one replay of the
    captured ``bucket`` holding ``grids``; ``frame_grid(n)`` is a one-frame grid of ``n`` tokens
    (``n`` a multiple of ``unit``)."""
    pairs: dict[int, dict[bool, Bucket]] = {}  # budget -> {dense?: bucket}
    for b in buckets:
        if b.max_seqlen == b.tokens:  # dense against the packed bucket that takes any frame
            pairs.setdefault(b.tokens, {})[b.max_segments == 1] = b
    thresholds = {}
    previous = 0
    for tokens in sorted(pairs):
        low, previous = -(-(previous + 1) // unit) * unit, tokens
        pair = pairs[tokens]
        if tokens < MIN_TOKENS or len(pair) != 2:
            continue
        dense, packed = pair[True], pair[False]
        d = time(dense, [frame_grid(tokens)]) * (1 - SINGLE_FRAME_MARGIN)
        p_full = time(packed, [frame_grid(tokens)])
        if p_full <= d:
            thresholds[tokens] = tokens + 1  # packed wins even for a frame that fills the bucket
            continue
        p_low = time(packed, [frame_grid(low)]) if low < tokens else p_full
        if p_low >= d:
            continue  # dense wins for every frame of this budget
        share = (d - p_low) / (p_full - p_low)
        thresholds[tokens] = int(math.sqrt(low ** 2 + share * (tokens ** 2 - low ** 2)))
    return thresholds


def faster_next_buckets(buckets: Sequence[Bucket], time: Callable[[Bucket, list[Grid]], float],
                        frame_grid: Callable[[int], Grid],
                        tuning: RoutingTuning = RoutingTuning()) -> dict[Bucket, Bucket]:
    """``{bucket: larger}``: packed buckets of up to ``tuning.faster_next_max_tokens`` tokens
    whose filling input (one frame, ``frame_grid(bucket.tokens)``) replays at least
    ``FASTER_NEXT_MARGIN`` faster in the next larger packed bucket, which holds every
    step the smaller one does. Each pair is timed on the same input, its replays interleaved
    so that both see the same clock."""
    packed = sorted(b for b in buckets if b.max_seqlen == b.tokens and b.max_segments > 1)
    faster = {}
    for small, large in zip(packed, packed[1:]):
        if small.tokens > tuning.faster_next_max_tokens:
            break
        if large.max_segments < small.max_segments:
            continue
        grids = [frame_grid(small.tokens)]
        times = {small: [], large: []}
        for _ in range(FASTER_NEXT_REPS):
            for bucket in (small, large):
                times[bucket].append(time(bucket, grids))
        if min(times[large]) < min(times[small]) * (1 - FASTER_NEXT_MARGIN):
            faster[small] = large
    return faster
