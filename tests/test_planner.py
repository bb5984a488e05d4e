"""Host-side planning: the ladder, bucket choice, packing, splitting and every capacity."""

import random

import pytest

from vitgraph.engine.planner import (MAX_PADDING_WASTE, Bucket, budget_ladder, fit_budgets, make_buckets, plan_call,
                                      smallest_fit)

BUCKETS = make_buckets([64, 128, 256, 512], max_items=8, merge_unit=4)


def test_ladder_waste_bound():
    ladder = budget_ladder(256, 16384, align=4)
    assert ladder[0] == 256 and ladder[-1] == 16384 and ladder == sorted(set(ladder))
    assert {1024, 4096} <= set(ladder)
    for tokens in range(260, 16384 + 1, 4):
        bucket = next(b for b in ladder if b >= tokens)
        assert (bucket - tokens) / bucket <= MAX_PADDING_WASTE, (tokens, bucket)


@pytest.mark.parametrize("lo, hi", [(0, 16), (6, 64), (256, 128)])
def test_ladder_rejects_bad_bounds(lo, hi):
    with pytest.raises(ValueError, match="budget"):
        budget_ladder(lo, hi)


@pytest.mark.parametrize("budgets, max_items, match", [
    ([], 8, "budgets"), ([64, 66], 8, "budgets"), ([64, 64], 8, "twice"), ([64], 0, "max_items"),
    ([True], 8, "budgets"),
])
def test_make_buckets_rejects(budgets, max_items, match):
    with pytest.raises(ValueError, match=match):
        make_buckets(budgets, max_items, 4)


@pytest.mark.parametrize("cap", [-1, 0, 64.0, True, "64", 128, 200])
def test_make_buckets_rejects_bad_short_caps(cap):
    with pytest.raises(ValueError, match="short_cap"):
        make_buckets([64, 128], 8, 4, short_cap=lambda b: cap if b == 128 else None)


def test_small_buckets_cap_segments_by_merge_unit():
    buckets = make_buckets([16, 1024], max_items=64, merge_unit=4)
    assert buckets == [Bucket(16, 4), Bucket(1024, 64)]
    assert buckets[1].max_seqlen == 1024


def test_smallest_fit_checks_tokens_and_segments():
    assert smallest_fit(BUCKETS, 64, 1) == Bucket(64, 8)
    assert smallest_fit(BUCKETS, 65, 1) == Bucket(128, 8)
    assert smallest_fit(BUCKETS, 513, 1) is None
    assert smallest_fit(BUCKETS, 40, 9) is None


def test_empty_plan():
    assert plan_call([], BUCKETS).steps == []
    assert plan_call([], []).steps == []


def test_single_item_smallest_bucket():
    (step,) = plan_call([(1, 8, 8)], BUCKETS).steps
    assert step.bucket == Bucket(64, 8) and step.tokens == 64 and step.padded_tokens == 0
    (step,) = plan_call([(1, 6, 12)], BUCKETS).steps
    assert step.bucket == Bucket(128, 8) and step.padded_tokens == 128 - 72


def test_total_over_largest_is_split_in_order():
    grids = [(1, 16, 16), (1, 16, 16), (1, 8, 8)]  # 256 + 256 + 64 > 512
    plan = plan_call(grids, BUCKETS)
    assert [s.grids for s in plan.steps] == [[(1, 16, 16), (1, 16, 16)], [(1, 8, 8)]]
    assert [s.bucket.tokens for s in plan.steps] == [512, 64]
    assert [s.token_offset for s in plan.steps] == [0, 512]


def test_segment_capacity_splits_a_long_video():
    plan = plan_call([(20, 2, 2)], BUCKETS)  # 20 frames of 4 tokens; 8 segments per replay
    assert [s.grids for s in plan.steps] == [[(8, 2, 2)], [(8, 2, 2)], [(4, 2, 2)]]
    assert all(s.segments <= s.bucket.max_segments for s in plan.steps)
    assert plan.total_tokens == 80


def test_video_frames_spill_across_replays():
    plan = plan_call([(1, 16, 16), (3, 8, 16)], BUCKETS)  # 256 + 3 x 128
    assert [s.grids for s in plan.steps] == [[(1, 16, 16), (2, 8, 16)], [(1, 8, 16)]]


def test_oversize_frame_goes_eager_and_neighbours_still_replay():
    plan = plan_call([(1, 8, 8), (1, 32, 32), (2, 32, 32), (1, 4, 4)], BUCKETS)
    kinds = [(s.bucket.tokens if s.bucket else s.reason) for s in plan.steps]
    assert kinds == [64, "oversize", 64]
    assert plan.steps[1].grids == [(1, 32, 32), (2, 32, 32)] and plan.steps[1].token_offset == 64


def test_no_buckets_means_one_eager_step():
    (step,) = plan_call([(1, 4, 4), (2, 2, 2)], []).steps
    assert step.bucket is None and step.reason == "no_graphs" and step.tokens == 24


def test_random_plans_respect_every_capacity():
    rng = random.Random(0)
    for _ in range(500):
        grids = [(rng.choice([1, 1, 2, 5]), 2 * rng.randint(1, 12), 2 * rng.randint(1, 12))
                 for _ in range(rng.randint(1, 12))]
        plan = plan_call(grids, BUCKETS)
        assert plan.total_tokens == sum(t * h * w for t, h, w in grids)
        offset = 0
        for s in plan.steps:
            assert s.token_offset == offset
            assert s.tokens == sum(t * h * w for t, h, w in s.grids)
            offset += s.tokens
            if s.bucket is not None:
                assert s.tokens <= s.bucket.tokens and s.segments <= s.bucket.max_segments
                assert max(h * w for _, h, w in s.grids) <= s.bucket.max_seqlen
                assert smallest_fit(BUCKETS, s.tokens, s.segments) == s.bucket
        # Frames come back in order: flatten each plan back to the per-frame sequence.
        frames = [(h, w) for t, h, w in grids for _ in range(t)]
        assert [(h, w) for s in plan.steps for t, h, w in s.grids for _ in range(t)] == frames


def test_single_frame_steps_prefer_dense_buckets():
    buckets = make_buckets([64, 128, 256, 512], max_items=8, merge_unit=4, dense=True)
    assert [b.name for b in buckets] == ["64x1", "64x8", "128x1", "128x8", "256x1", "256x8", "512x1", "512x8"]
    one = plan_call([(1, 16, 20)], buckets)  # 320 tokens, one frame
    assert [s.bucket.name for s in one.steps] == ["512x1"]
    two = plan_call([(1, 8, 8), (1, 8, 8)], buckets)  # two frames never go to a dense bucket
    assert [s.bucket.name for s in two.steps] == ["128x8"]
    video = plan_call([(3, 8, 8)], buckets)
    assert [s.bucket.name for s in video.steps] == ["256x8"]
    # Order of the given list does not matter.
    assert smallest_fit(list(reversed(buckets)), 100, 1).name == "128x1"
    assert smallest_fit(list(reversed(buckets)), 100, 2).name == "128x8"
    assert smallest_fit(buckets, 600, 1) is None
    # No dense bucket above dense_up_to.
    assert [b.name for b in make_buckets([64, 128], 8, 4, dense=True, dense_up_to=64)] == ["64x1", "64x8", "128x8"]


def test_short_frame_buckets_take_only_steps_whose_frames_fit():
    buckets = make_buckets([64, 128, 256, 512], max_items=8, merge_unit=4, dense=True, dense_up_to=64,
                           short_cap=lambda b: 64 if b > 64 else None)
    assert [b.name for b in buckets] == ["64x1", "64x8", "128x8s64", "128x8", "256x8s64", "256x8", "512x8s64",
                                         "512x8"]
    assert Bucket(128, 8, 64).max_seqlen == 64 and Bucket(128, 8).max_seqlen == 128
    assert Bucket(128, 8, 999) == Bucket(128, 8)  # a cap at or above the tokens is no cap
    # Every frame within the cap: the short bucket; one frame above it: the general one.
    assert plan_call([(5, 8, 8)], buckets).steps[0].bucket.name == "512x8s64"
    assert plan_call([(4, 8, 8), (1, 8, 10)], buckets).steps[0].bucket.name == "512x8"
    assert plan_call([(2, 6, 8)], buckets).steps[0].bucket.name == "128x8s64"
    # A single frame keeps its dense bucket; without one, the short bucket takes it if it fits.
    assert plan_call([(1, 8, 8)], buckets).steps[0].bucket.name == "64x1"
    assert plan_call([(1, 8, 12)], buckets).steps[0].bucket.name == "128x8"  # 96 tokens > 64
    assert smallest_fit(buckets, 100, 2, longest=64).name == "128x8s64"
    assert smallest_fit(buckets, 100, 2, longest=65).name == "128x8"
    assert smallest_fit(buckets, 100, 2).name == "128x8s64"  # longest defaults to 0: no frame
    # Routed single frames go to the short bucket where they fit.
    routed = make_buckets([64, 128], 8, 4, dense=True, short_cap=lambda b: 100 if b > 100 else None)
    assert plan_call([(1, 6, 16)], routed).steps[0].bucket.name == "128x1"  # 96 tokens
    assert plan_call([(1, 6, 16)], routed, packed_single_below={128: 100}).steps[0].bucket.name == "128x8s100"
    assert plan_call([(1, 8, 14)], routed, packed_single_below={128: 120}).steps[0].bucket.name == "128x8"
    # Random traffic: every step's frames fit its bucket's cap, and it is the least bucket that holds it.
    rng = random.Random(3)
    for _ in range(200):
        grids = [(rng.randint(1, 3), 2 * rng.randint(1, 8), 2 * rng.randint(1, 8)) for _ in range(rng.randint(1, 6))]
        for s in plan_call(grids, buckets).steps:
            longest = max(h * w for _, h, w in s.grids)
            assert longest <= s.bucket.max_seqlen
            assert s.bucket == smallest_fit(buckets, s.tokens, s.segments, longest)


def test_measured_thresholds_send_small_single_frames_to_the_packed_bucket():
    buckets = make_buckets([64, 128, 256, 512], max_items=8, merge_unit=4, dense=True)
    below = {512: 300, 128: 129}  # 512: frames under 300 tokens; 128: every frame
    assert plan_call([(1, 16, 18)], buckets, packed_single_below=below).steps[0].bucket.name == "512x8"  # 288
    assert plan_call([(1, 16, 20)], buckets, packed_single_below=below).steps[0].bucket.name == "512x1"  # 320
    assert plan_call([(1, 8, 16)], buckets, packed_single_below=below).steps[0].bucket.name == "128x8"  # fills it
    assert plan_call([(1, 8, 28)], buckets, packed_single_below=below).steps[0].bucket.name == "256x1"  # no entry
    # Only single frames are rerouted; several frames go to packed buckets anyway.
    assert plan_call([(2, 8, 8)], buckets, packed_single_below=below).steps[0].bucket.name == "128x8"
    # Without packed buckets of that size the dense one stays.
    dense_only = [Bucket(512, 1), Bucket(64, 8)]
    assert plan_call([(1, 16, 18)], dense_only, packed_single_below=below).steps[0].bucket.name == "512x1"


def test_routing_thresholds_follow_the_measured_times():
    from vitgraph.engine.routing import SINGLE_FRAME_MARGIN, single_frame_thresholds

    class FakeBank:  # replay time: dense flat; packed = 1 + (frame tokens / 1000)^2 ms
        def __init__(self, dense_ms):
            self.buckets = make_buckets([1024, 2048, 4096], max_items=16, merge_unit=4, dense=True)
            self.dense_ms, self.calls = dense_ms, []

        def time_replay(self, bucket, grids, reps=2):
            (t, h, w), = grids
            self.calls.append((bucket.name, h * w))
            return self.dense_ms[bucket.tokens] if bucket.max_segments == 1 else 1 + (h * w / 1000) ** 2

    margin = 1 - SINGLE_FRAME_MARGIN  # packed must beat dense x (1 - margin)
    bank = FakeBank({1024: 1.5 / margin, 2048: 5.0 / margin, 4096: 100.0})
    got = single_frame_thresholds(bank.buckets, bank.time_replay, lambda n: (1, 2, n // 2), unit=4)
    # 1024 (frames of 4..1024 tokens land there: no smaller budget): packed wins below
    # sqrt(0.5) * 1000 = 707 tokens; the interpolation in n^2 is exact for this fake.
    assert 705 <= got[1024] <= 708
    assert got[2048] == 2000  # packed 1 + n^2 = 5 at n = 2000: interpolation in n^2 is exact here
    assert got[4096] == 4097  # packed wins even at a full bucket
    assert ("4096x16", 2052) not in bank.calls  # no low-fill timing needed there
    quick = FakeBank({1024: 0.5, 2048: 0.5, 4096: 0.5})
    assert single_frame_thresholds(quick.buckets, quick.time_replay, lambda n: (1, 2, n // 2), 4) == {}
    # A tie within the margin stays dense: packed at full fill 1.1% faster is not enough to
    # move frames that fill the bucket, only smaller ones.
    even = FakeBank({1024: 2.05, 2048: 100.0, 4096: 100.0})
    tie = single_frame_thresholds(even.buckets, even.time_replay, lambda n: (1, 2, n // 2), 4)
    assert tie[1024] < 1024


def test_steps_of_a_bucket_the_next_one_beats_replay_there():
    buckets = make_buckets([64, 128, 256, 512], max_items=8, merge_unit=4, dense=True)
    faster = {Bucket(128, 8): Bucket(256, 8)}
    assert plan_call([(2, 8, 8)], buckets, faster_next=faster).steps[0].bucket.name == "256x8"  # 128 tokens
    assert plan_call([(2, 8, 8)], buckets).steps[0].bucket.name == "128x8"  # without the map
    assert plan_call([(1, 8, 16)], buckets, faster_next=faster).steps[0].bucket.name == "128x1"  # dense: no entry
    # After the single-frame routing: the packed bucket it picks is looked up too.
    assert plan_call([(1, 8, 16)], buckets, packed_single_below={128: 129},
                     faster_next=faster).steps[0].bucket.name == "256x8"
    # A larger bucket that is not captured, or that cannot hold the step, is never taken.
    assert plan_call([(2, 8, 8)], [b for b in buckets if b.tokens != 256],
                     faster_next=faster).steps[0].bucket.name == "128x8"
    few_slots = {Bucket(128, 8): Bucket(256, 2)}
    assert plan_call([(3, 4, 8)], buckets + [Bucket(256, 2)],
                     faster_next=few_slots).steps[0].bucket.name == "128x8"  # 3 frames > 2 slots


def test_faster_next_buckets_follow_the_measured_times():
    from vitgraph.engine.routing import FASTER_NEXT_MARGIN, FASTER_NEXT_REPS, RoutingTuning, faster_next_buckets

    class FakeBank:  # replay time per bucket, whatever the input; records what was timed
        def __init__(self, ms):
            self.buckets = make_buckets(list(ms), max_items=16, merge_unit=4, dense=True)
            self.ms, self.calls = ms, []

        def time_replay(self, bucket, grids, reps=2):
            (t, h, w), = grids
            self.calls.append((bucket.name, t * h * w))
            return self.ms[bucket.tokens]

    tuning = RoutingTuning(faster_next_max_tokens=2048)
    margin = 1 - FASTER_NEXT_MARGIN
    bank = FakeBank({256: 1.0, 320: 1.2, 352: 1.1, 384: 1.2 * margin * 1.001, 416: 1.2 * margin, 4096: 9.0,
                     4608: 1.0})
    got = faster_next_buckets(bank.buckets, bank.time_replay, lambda n: (1, 2, n // 2), tuning)
    # 320 -> 352 (8% faster); 352 -> 384 no (slower); 384 -> 416 by exactly the margin, not enough;
    # 416 -> 4096 no (slower); 4096 -> 4608 is above faster_next_max_tokens: not timed at all.
    assert got == {Bucket(320, 16): Bucket(352, 16)}
    assert all(name.endswith("x16") for name, _ in bank.calls)  # packed buckets only
    assert ("352x16", 320) in bank.calls and ("320x16", 320) in bank.calls  # the pair on the smaller's input
    assert ("4096x16", 416) in bank.calls and not any(n == 4096 or name.startswith("4608") for name, n in bank.calls)
    assert len([c for c in bank.calls if c == ("320x16", 320)]) == FASTER_NEXT_REPS
    small = FakeBank({256: 1.0, 512: 2.0})
    assert faster_next_buckets(small.buckets, small.time_replay, lambda n: (1, 2, n // 2)) == {}
    slow_first = {256: 2.0, 512: 1.0}
    slow = FakeBank(slow_first)
    assert faster_next_buckets(slow.buckets, slow.time_replay, lambda n: (1, 2, n // 2)) == {Bucket(256, 16): Bucket(512, 16)}
    off = RoutingTuning(faster_next_max_tokens=0)  # what ab_setting.py routing.faster_next_max_tokens=0 builds
    assert faster_next_buckets(slow.buckets, slow.time_replay, lambda n: (1, 2, n // 2), off) == {}


def test_large_single_frames_run_eagerly_at_their_exact_shape():
    plan = plan_call([(1, 16, 20), (1, 8, 8)], BUCKETS, exact_eager_above=256)  # 320 then 64 tokens
    assert [s.bucket.tokens for s in plan.steps] == [512]  # packed together: two frames
    plan = plan_call([(1, 16, 20)], BUCKETS, exact_eager_above=256)
    assert [(s.bucket, s.reason) for s in plan.steps] == [(None, "exact_eager")]
    plan = plan_call([(2, 16, 16)], BUCKETS, exact_eager_above=256)  # several frames: a replay
    assert [s.bucket.tokens for s in plan.steps] == [512]
    plan = plan_call([(1, 16, 16)], BUCKETS, exact_eager_above=256)  # the threshold is exclusive
    assert plan.steps[0].bucket.tokens == 256


def test_a_step_no_remaining_bucket_holds_runs_eagerly():
    """Capture may drop a budget's packed bucket and keep its dense one: a step of two frames
    that only that packed bucket would hold then gets no bucket (an eager step), not an error."""
    buckets = [Bucket(256, 8), Bucket(512, 1)]
    two = [(1, 8, 12), (1, 12, 24)]  # 96 + 288 = 384 tokens
    for options in ({}, dict(exact_eager_above=256, eager_padding=0.04)):
        (step,) = plan_call(two, buckets, **options).steps
        assert (step.bucket, step.reason, step.tokens, step.segments) == (None, None, 384, 2)


def test_large_packed_steps_run_eagerly_only_when_padded_enough():
    four = [(1, 10, 10), (1, 10, 10), (1, 10, 12), (1, 10, 10)]  # 420 tokens: 92 of 512 padding (18%)
    eager = plan_call(four, BUCKETS, exact_eager_above=256, eager_padding=0.1)
    assert [(s.bucket, s.reason, s.tokens, s.segments) for s in eager.steps] == [(None, "exact_eager", 420, 4)]
    assert plan_call(four, BUCKETS, exact_eager_above=256, eager_padding=0.2).steps[0].bucket.tokens == 512
    assert plan_call(four, BUCKETS, exact_eager_above=256).steps[0].bucket.tokens == 512  # None: never
    assert plan_call(four, BUCKETS, exact_eager_above=512, eager_padding=0.1).steps[0].bucket.tokens == 512
    # The share is inclusive: 64 of 512 rows is 12.5%.
    full = [(1, 16, 16), (1, 8, 24)]  # 448 tokens
    assert plan_call(full, BUCKETS, exact_eager_above=256, eager_padding=0.125).steps[0].bucket is None
    assert plan_call(full, BUCKETS, exact_eager_above=256, eager_padding=0.126).steps[0].bucket.tokens == 512


def test_default_h200_ladder_plans_the_serving_mix():
    """The fa4 defaults on an H200 (132 SMs, 16 heads): 41 packed buckets plus the short-frame
    ones the tile rule asks for; every step of the serving benchmark's traffic, batched as its
    loop batches it, lands in the least bucket that holds it, within every capacity."""
    from vitgraph.ops.attention import attention_tuning, fa4_short_cap
    from vitgraph.bench.serving import request_grids

    buckets = make_buckets(budget_ladder(256, 16384), 16, 4, short_cap=lambda b: fa4_short_cap(b, 16, 4, attention_tuning(9, 132, 80)))
    assert len(buckets) == 64 and sum(b.max_seqlen < b.tokens for b in buckets) == 23
    grids = request_grids(300, 0, 12845056)
    used = set()
    eager_packed = replayed_large = 0
    for start in range(0, len(grids), 7):  # calls of 7 requests
        for s in plan_call(grids[start:start + 7], buckets, exact_eager_above=8192, eager_padding=0.04).steps:
            if s.bucket is None:
                assert s.reason in ("exact_eager", "oversize")
                if s.reason == "exact_eager" and s.segments > 1:
                    fit = smallest_fit(buckets, s.tokens, s.segments, max(h * w for _, h, w in s.grids))
                    assert s.tokens > 8192 and fit.tokens - s.tokens >= 0.04 * fit.tokens
                    eager_packed += 1
                continue
            if s.tokens > 8192 and s.segments > 1:
                assert s.bucket.tokens - s.tokens < 0.04 * s.bucket.tokens
                replayed_large += 1
            longest = max(h * w for _, h, w in s.grids)
            assert s.bucket.holds(s.tokens, s.segments, longest)
            assert s.bucket == smallest_fit(buckets, s.tokens, s.segments, longest)
            used.add(s.bucket.max_seqlen < s.bucket.tokens)
    assert used == {True, False}  # both kinds of bucket take traffic
    assert eager_packed > 0 and replayed_large > 0


def _padding(counts, budgets):
    return sum(min(b for b in budgets if b >= n) - n for n in counts if n <= max(budgets))


def test_fit_budgets_is_the_least_padding_of_any_choice():
    import itertools

    rng = random.Random(0)
    for _ in range(200):
        max_budget = 4 * rng.randint(5, 30)
        counts = [4 * rng.randint(1, max_budget // 4 + 3) for _ in range(rng.randint(1, 15))]  # some above
        k = rng.randint(1, 5)
        fitted = fit_budgets(counts, k, max_budget)
        assert len(fitted) <= k and fitted == sorted(set(fitted)) and fitted[-1] == max_budget
        candidates = sorted({n for n in counts if n < max_budget})
        least = min(_padding(counts, [*c, max_budget]) for r in range(k) for c in itertools.combinations(candidates, r))
        assert _padding(counts, fitted) == least


def test_fitted_budgets_pad_the_serving_mix_less_than_the_default_ladder():
    from vitgraph.bench.serving import request_grids

    def padding_share(budgets, grids):
        buckets = make_buckets(budgets, 16, 4)
        steps = [s for g in grids for s in plan_call([g], buckets, exact_eager_above=8192).steps if s.bucket]
        return sum(s.padded_tokens for s in steps) / sum(s.tokens for s in steps)

    seen, unseen = request_grids(1000, 1, 12845056), request_grids(1000, 0, 12845056)
    graphed = [t * h * w for t, h, w in seen if t > 1 or h * w <= 8192]  # one frame above 8192: eager
    fitted = fit_budgets(graphed, 12, 16384)
    default = budget_ladder(256, 16384)
    assert len(fitted) <= 12 < len(default)
    assert padding_share(fitted, unseen) < 0.5 * padding_share(default, unseen)


@pytest.mark.parametrize("kwargs, field", [
    (dict(token_counts=[]), "token_counts"), (dict(token_counts="256"), "token_counts"),
    (dict(token_counts=[256, 130]), "token_counts"), (dict(token_counts=[256, True]), "token_counts"),
    (dict(max_buckets=0), "max_buckets"), (dict(max_budget=1030), "max_budget"), (dict(max_budget=2.0), "max_budget"),
])
def test_fit_budgets_refuses_bad_input(kwargs, field):
    args = {"token_counts": [256, 1024], "max_buckets": 4, "max_budget": 4096, **kwargs}
    with pytest.raises(ValueError, match=field):
        fit_budgets(**args)
