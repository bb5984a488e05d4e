"""Host-side planning: buckets, the budget ladder, and packing a call into replays.

Pure Python: nothing here touches a GPU.

A bucket is one captured graph. Its capacities are checked for every replay:

* ``tokens``: patch rows (the static pixel buffer's height);
* ``max_segments``: attention segments, i.e. frames (the length of ``cu_seqlens`` minus one);
* ``max_seqlen``: the longest segment the attention kernel is launched for. It is
  baked in at capture. By default it equals ``tokens``, the only bound that holds for
  every packing; the kernels skip the empty query tiles past each segment's end, so a
  loose value costs launch slots, not math. A *short-frame* bucket caps it lower: it
  takes only steps whose frames all fit, and its attention may pick a kernel made for
  short segments (FlashAttention 4's 128-row tiles, see :func:`vitgraph.ops.attention.fa4_tile`).

A bucket with ``max_segments == 1`` is *dense*: it holds one frame, which attends
through dense cuDNN attention with its padding keys masked (see
:func:`vitgraph.ops.attention.dense_masked`). Buckets sort by ``(tokens, max_segments,
max_seqlen)`` and a step takes the least one that holds it: single-frame steps prefer
the dense bucket when their budget has one, unless a threshold measured at capture sends
small frames of that budget to a packed bucket (:mod:`vitgraph.engine.routing`), and
steps of short frames prefer their budget's short-frame bucket. A packed bucket that
replayed its input slower than the next larger one did, when timed at capture, hands
its steps to that one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

Grid = tuple[int, int, int]

MAX_PADDING_WASTE = 0.125  # the automatic ladder keeps (bucket - tokens) / bucket under this


@dataclass(frozen=True, order=True)
class Bucket:
    tokens: int
    max_segments: int
    max_seqlen: int = 0  # the longest frame it takes; 0 (the default) means ``tokens``

    def __post_init__(self) -> None:
        if not 0 < self.max_seqlen <= self.tokens:
            object.__setattr__(self, "max_seqlen", self.tokens)

    @property
    def name(self) -> str:
        short = f"s{self.max_seqlen}" if self.max_seqlen < self.tokens else ""
        return f"{self.tokens}x{self.max_segments}{short}"

    def holds(self, tokens: int, segments: int, longest: int) -> bool:
        return tokens <= self.tokens and segments <= self.max_segments and longest <= self.max_seqlen


@dataclass
class Step:
    """One forward of a plan: a replay of ``bucket``, or an eager run when ``bucket`` is None."""

    grids: list[Grid]  # whole items, or runs of consecutive frames of one item
    bucket: Bucket | None
    tokens: int
    segments: int
    token_offset: int  # first pixel row of this step in the call's input
    reason: str | None = None  # why eager

    @property
    def padded_tokens(self) -> int:
        return 0 if self.bucket is None else self.bucket.tokens - self.tokens


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.steps)


def budget_ladder(min_budget: int, max_budget: int, align: int = 4) -> list[int]:
    """Budgets from ``min_budget`` to ``max_budget``, each step small enough that
    any token count above ``min_budget`` (a multiple of ``align``) wastes at most 12.5% of its bucket.

    Steps are rounded down to a power of two (at most 256) so that larger budgets
    stay friendly to GEMM tiling.
    """
    if min_budget <= 0 or min_budget % align:
        raise ValueError(f"min_budget must be a positive multiple of {align}, got {min_budget}")
    if max_budget < min_budget:
        raise ValueError(f"max_budget ({max_budget}) must be >= min_budget ({min_budget})")
    budgets = [min_budget]
    while budgets[-1] < max_budget:
        b = budgets[-1]
        # n = b + align is the worst case; need (next - n) / next <= 1/8  <=>  next <= 8/7 * n.
        limit = (8 * (b + align)) // 7
        step = limit - b
        granule = 1 << (step.bit_length() - 1)
        granule = max(align, min(granule, 256))
        next_budget = b + max(align, (step // granule) * granule)
        power = 1 << b.bit_length()  # the next power of two above b
        if power <= next_budget:
            # Powers of two are common patch counts (224 px -> 256, 448 px -> 1024): snap to them.
            next_budget = power
        budgets.append(min(next_budget, max_budget))
    return budgets


def fit_budgets(token_counts: Sequence[int], max_buckets: int, max_budget: int, align: int = 4) -> list[int]:
    """At most ``max_buckets`` budgets, the largest ``max_budget``, that pad a sample of your
    traffic least: each step of ``token_counts[i]`` patch tokens pads up to the smallest budget
    that holds it. Give one count per step the graphs will run: per ``encode`` call (its total),
    or per item where calls hold one item, leaving out what runs eagerly anyway (a single frame
    above the encoder's ``exact_eager_above``). Counts above ``max_budget`` are left out: such
    steps run eagerly or are split. Exact: dynamic programming over the distinct counts, each a
    candidate budget. Pass the result as the encoder's ``budgets``."""
    for name, value in (("max_buckets", max_buckets), ("max_budget", max_budget), ("align", align)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if max_budget % align:
        raise ValueError(f"max_budget must be a multiple of {align}, got {max_budget}")
    if isinstance(token_counts, (str, bytes)) or not isinstance(token_counts, Sequence) or not token_counts:
        raise ValueError("token_counts must be a non-empty list of ints")
    for n in token_counts:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0 or n % align:
            raise ValueError(f"token_counts must be positive multiples of {align}, got {n!r}")
    counts = Counter(n for n in token_counts if n <= max_budget)
    counts.setdefault(max_budget, 0)  # the largest budget is always kept: it bounds every packing
    sizes = np.array(sorted(counts), dtype=np.float64)
    weights = np.array([counts[int(u)] for u in sizes], dtype=np.float64)
    m = len(sizes)
    pc = np.concatenate([[0.0], np.cumsum(weights)])  # steps among sizes[:i]
    ps = np.concatenate([[0.0], np.cumsum(weights * sizes)])  # their tokens
    # best[j]: least padding of the steps up to sizes[j] with the budgets so far, the last at
    # sizes[j]; a group sizes[i..j] under budget sizes[j] pads sizes[j] * (pc[j+1] - pc[i]) -
    # (ps[j+1] - ps[i]).
    best = sizes * pc[1:] - ps[1:]  # one budget
    starts = [np.zeros(m, dtype=np.int64)]  # per budget count: where the last group starts (-1: none added)
    for _ in range(1, min(max_buckets, m)):
        reach = best[:-1] + ps[1:-1]  # best[i - 1] + ps[i] for i = 1..m-1
        new, start = best.copy(), np.full(m, -1, dtype=np.int64)  # the budget more may go unused
        for j in range(1, m):
            totals = reach[:j] - sizes[j] * pc[1:j + 1]  # over i = 1..j
            i = int(np.argmin(totals))
            total = totals[i] + sizes[j] * pc[j + 1] - ps[j + 1]
            if total < new[j]:
                new[j], start[j] = total, i + 1
        best = new
        starts.append(start)
    budgets, j = [], m - 1
    for start in reversed(starts):
        if start[j] >= 0:
            budgets.append(int(sizes[j]))
            j = int(start[j]) - 1
            if j < 0:
                break
    return sorted(budgets)


def make_buckets(budgets: Sequence[int], max_items: int, merge_unit: int, dense: bool = False,
                 dense_up_to: int | None = None, short_cap: Callable[[int], int | None] | None = None
                 ) -> list[Bucket]:
    """One packed bucket per budget (a segment holds at least ``merge_unit`` tokens, which
    bounds how many segments a small bucket can ever see), plus a one-segment dense bucket
    per budget up to ``dense_up_to`` tokens when ``dense``, plus a short-frame packed bucket
    for frames of at most ``short_cap(budget)`` tokens per budget where that is not None."""
    if not budgets:
        raise ValueError("budgets must not be empty")
    if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items <= 0:
        raise ValueError(f"max_items must be a positive int, got {max_items!r}")
    seen = set()
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % merge_unit:
            raise ValueError(f"budgets must be positive ints divisible by {merge_unit}, got {b!r}")
        if b in seen:
            raise ValueError(f"budgets lists {b} twice")
        seen.add(b)
    buckets = {Bucket(b, min(max_items, b // merge_unit)) for b in budgets}
    for b in budgets if short_cap is not None else ():
        cap = short_cap(b)
        if cap is None:
            continue
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 < cap < b:
            raise ValueError(f"short_cap({b}) must be None or a frame cap below the budget, got {cap!r}")
        buckets.add(Bucket(b, min(max_items, b // merge_unit), cap))
    if dense:
        buckets |= {Bucket(b, 1) for b in budgets if dense_up_to is None or b <= dense_up_to}
    return sorted(buckets)


def smallest_fit(buckets: Sequence[Bucket], tokens: int, segments: int, longest: int = 0) -> Bucket | None:
    """The least ``(tokens, max_segments, max_seqlen)`` bucket that holds the step (whose
    longest frame has ``longest`` tokens), or None."""
    return min((b for b in buckets if b.holds(tokens, segments, longest)), default=None)


# Above exact_eager_above a step padded this much runs eager: eager costs a little more (benchmarks/HISTORY.md).
EAGER_MIN_PADDING = 0.04


def plan_call(grids: Sequence[Grid], buckets: Sequence[Bucket], exact_eager_above: int | None = None,
              packed_single_below: Mapping[int, int] | None = None, eager_padding: float | None = None,
              faster_next: Mapping[Bucket, Bucket] | None = None) -> Plan:
    """Pack frames greedily, in order, into replays no larger than the largest bucket.

    Frames are the unit of packing: each is its own attention segment and its own
    set of merger groups, so a long video may span replays and its rows still come
    back in order. A single frame larger than every bucket runs eagerly; consecutive
    eager items share one eager step. A step holding one frame of more than
    ``exact_eager_above`` tokens also runs eagerly, at its exact shape: there the GPU,
    not launch overhead, sets the pace, and padding would be pure extra work. A step of
    several frames and more than ``exact_eager_above`` tokens runs eagerly when its bucket
    would pad it by at least ``eager_padding`` of the bucket's rows (None: never): an eager
    run launches every kernel from the host and costs a little more than a replay of the
    same rows, so only enough padding pays for it. The concatenated step outputs are the
    call's output in item order.

    ``packed_single_below`` (``{budget: n}``, see :mod:`vitgraph.engine.routing`): a step
    holding one frame of fewer than ``n`` tokens, whose smallest fit is the dense bucket of
    that budget, replays in a packed bucket instead (the short-frame one where it fits).

    ``faster_next`` (``{bucket: larger}``, see :mod:`vitgraph.engine.routing`): a step whose
    bucket is a key replays in the larger bucket, measured faster, which holds it too.
    """
    plan = Plan()
    if not buckets:
        tokens = sum(t * h * w for t, h, w in grids)
        if grids:
            plan.steps.append(Step(list(grids), None, tokens, sum(t for t, _, _ in grids), 0, "no_graphs"))
        return plan
    cap_tokens = max(b.tokens for b in buckets)
    cap_segments = max(b.max_segments for b in buckets)
    route = _Routing(buckets, exact_eager_above, packed_single_below or {}, eager_padding, faster_next or {})
    chunk, offset = _Chunk(), 0

    def flush() -> None:
        nonlocal chunk, offset
        if chunk.grids:
            plan.steps.append(route.step(chunk, offset))
            offset += chunk.tokens
        chunk = _Chunk()

    for t, h, w in grids:
        frame = h * w
        if frame > cap_tokens:  # larger than every bucket: eager, beside the oversize items before it
            flush()
            _add_oversize(plan, (t, h, w), offset)
            offset += t * frame
            continue
        left = t
        while left:
            room = min((cap_tokens - chunk.tokens) // frame, cap_segments - chunk.segments)
            if room == 0:
                flush()
                continue
            take = min(left, room)
            chunk.add(take, h, w)
            left -= take
    flush()
    return plan


def _add_oversize(plan: Plan, grid: Grid, offset: int) -> None:
    """An item with a frame larger than every bucket: an eager step, shared with the oversize
    items just before it."""
    t, h, w = grid
    last = plan.steps[-1] if plan.steps else None
    if last is not None and last.bucket is None and last.reason == "oversize":
        last.grids.append(grid)
        last.tokens += t * h * w
        last.segments += t
    else:
        plan.steps.append(Step([grid], None, t * h * w, t, offset, "oversize"))


@dataclass
class _Chunk:
    """Frames gathered for one step."""

    grids: list = field(default_factory=list)
    tokens: int = 0
    segments: int = 0
    longest: int = 0

    def add(self, t: int, h: int, w: int) -> None:
        self.grids.append((t, h, w))
        self.tokens += t * h * w
        self.segments += t
        self.longest = max(self.longest, h * w)


@dataclass
class _Routing:
    """Where :func:`plan_call` sends a chunk: the rules its docstring gives, in order."""

    buckets: Sequence[Bucket]
    exact_eager_above: int | None
    packed_single_below: Mapping[int, int]
    eager_padding: float | None
    faster_next: Mapping[Bucket, Bucket]

    def step(self, chunk: _Chunk, offset: int) -> Step:
        # None where capture dropped the buckets that would hold it: the step then runs eagerly.
        bucket = smallest_fit(self.buckets, chunk.tokens, chunk.segments, chunk.longest)
        if (bucket is not None and bucket.max_segments == 1
                and chunk.tokens < self.packed_single_below.get(bucket.tokens, 0)):
            bucket = smallest_fit(self.buckets, chunk.tokens, 2, chunk.longest) or bucket
        larger = self.faster_next.get(bucket)
        if larger is not None and larger in self.buckets and larger.holds(chunk.tokens, chunk.segments, chunk.longest):
            bucket = larger
        padded_enough = (bucket is not None and self.eager_padding is not None
                         and bucket.tokens - chunk.tokens >= self.eager_padding * bucket.tokens)
        reason = None
        if self.exact_eager_above is not None and chunk.tokens > self.exact_eager_above and (
                chunk.segments == 1 or padded_enough):
            bucket, reason = None, "exact_eager"
        return Step(chunk.grids, bucket, chunk.tokens, chunk.segments, offset, reason)


def padded_batch(model, bucket: Bucket, grids=()):
    """Host metadata of ``grids`` in ``bucket``'s padded layout (the tower's ``build_batch``);
    no grids: the empty layout that warm-up and capture run on."""
    return model.build_batch(grids, num_tokens=bucket.tokens, num_segments=bucket.max_segments,
                             max_seqlen=bucket.max_seqlen)
