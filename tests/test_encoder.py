"""The encoder on CPU: padded static-buffer semantics, validation, empty input, stats, backends."""

import dataclasses
import random

import numpy as np
import pytest
import torch
from helpers import diff_report, random_pixels, rel_err

from vitgraph import GraphedVisionEncoder
from vitgraph.ops.attention import available_backends, resolve_backend
from vitgraph.engine.planner import make_buckets, plan_call
from vitgraph.models import PRESETS

TINY = PRESETS["tiny"]
from vitgraph.runtime.options import EngineOptions, dense_limit, short_cap_rule
from vitgraph.ops.attention import attention_tuning
from vitgraph.ops.gemm import resolve_gemm
from vitgraph.models import tower_dims
from vitgraph.runtime.tuning import Tuning, apply_overrides, derive_tuning


@pytest.fixture(scope="module")
def encoder(checkpoint):
    return GraphedVisionEncoder.from_pretrained(checkpoint, device="cpu")


def _random_grids(rng, n):
    return [(rng.choice([1, 1, 1, 2, 3]), 2 * rng.randint(1, 6), 2 * rng.randint(1, 6)) for _ in range(n)]


@pytest.mark.slow
def test_padded_step_path_equals_unpadded_eager(encoder):
    """Run each planned step the way a replay does (padded to its bucket, NaN in the padding)
    and check that the stitched rows equal one unpadded eager forward."""
    tower = encoder.tower
    buckets = make_buckets([32, 64, 128, 256], max_items=6, merge_unit=4)
    rng = random.Random(1)
    for trial in range(25):
        grids = _random_grids(rng, rng.randint(1, 6))
        pixels = random_pixels(grids, seed=trial)
        ref = tower(pixels, tower.build_batch(grids))
        rows = []
        for step in plan_call(grids, buckets).steps:
            chunk = pixels[step.token_offset:step.token_offset + step.tokens]
            if step.bucket is None:
                rows.append(tower(chunk, tower.build_batch(step.grids)))
                continue
            b = step.bucket
            padded = torch.full((b.tokens, chunk.shape[1]), float("nan"))
            padded[:step.tokens] = chunk
            batch = tower.build_batch(step.grids, num_tokens=b.tokens, num_segments=b.max_segments,
                                      max_seqlen=b.max_seqlen)
            out = tower(padded, batch)
            rows.append(out[:step.tokens // 4])
        got = torch.cat(rows)
        assert torch.isfinite(got).all()
        assert rel_err(got, ref) <= 1e-5, (grids, diff_report(got, ref))


def test_backends_agree_on_padded_and_unpadded_metadata(encoder):
    """Every backend available here agrees with the masked-SDPA reference, and the dense
    single-sequence hook agrees with the masked path."""
    tower = encoder.tower
    grids = [(1, 4, 6), (2, 2, 4)]
    pixels = random_pixels(grids, seed=5)
    unpadded = tower.build_batch(grids)
    padded = tower.build_batch(grids, num_tokens=64, num_segments=8, max_seqlen=64)
    px_padded = torch.cat([pixels, torch.randn(64 - pixels.shape[0], pixels.shape[1])])
    ref = tower(pixels, unpadded)
    for backend in available_backends("cpu"):
        tower.set_attention_backend(backend)
        try:
            assert rel_err(tower(pixels, unpadded), ref) <= 1e-6
            assert rel_err(tower(px_padded, padded)[:ref.shape[0]], ref) <= 1e-5
        finally:
            tower.set_attention_backend(encoder.attention)
    one = [(1, 4, 6)]
    dense = tower.build_batch(one)
    assert dense.dense
    masked = tower.build_batch(one, num_tokens=24, num_segments=2)
    assert not masked.dense
    px = random_pixels(one, seed=6)
    assert rel_err(tower(px, dense), tower(px, masked)) <= 1e-6


def test_backend_resolution():
    assert resolve_backend("auto", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="attention"):
        resolve_backend("magic", "cpu")
    with pytest.raises(ValueError, match="not available"):
        resolve_backend("varlen", "cpu")


def test_gemm_resolution():
    assert resolve_gemm("auto", "cpu", torch.bfloat16, fused=True) == "cublas"
    assert resolve_gemm("cublas", "cpu", torch.float32, fused=False) == "cublas"
    with pytest.raises(ValueError, match="gemm must be"):
        resolve_gemm("magic", "cpu", torch.bfloat16, fused=True)
    with pytest.raises(ValueError, match="needs quack-kernels"):
        resolve_gemm("quack", "cpu", torch.bfloat16, fused=True)


def test_gemm_auto_falls_back_when_quack_fails_to_load(monkeypatch, caplog):
    import vitgraph.ops.gemm

    def broken():
        raise ImportError("cutlass.cute is missing")

    monkeypatch.setattr(vitgraph.ops.gemm, "quack_available", lambda device: True)
    monkeypatch.setattr(vitgraph.ops.gemm, "_quack", broken)
    with caplog.at_level("WARNING", logger="vitgraph"):
        assert resolve_gemm("auto", "cpu", torch.bfloat16, fused=True) == "cublas"
    assert "failed to load" in caplog.text
    with pytest.raises(ValueError, match="failed to load"):
        resolve_gemm("quack", "cpu", torch.bfloat16, fused=True)
    assert resolve_gemm("auto", "cpu", torch.float32, fused=True) == "cublas"  # fp32 never tries it
    with pytest.raises(ValueError, match="bf16"):
        resolve_gemm("quack", "cpu", torch.float16, fused=True)  # measured and tested in bf16 only


def test_empty_input(encoder):
    out = encoder.encode(torch.empty(0, 1176), [])
    assert out.shape == (0, 48) and out.dtype == torch.float32
    out = encoder.encode(torch.empty(0, 1176), torch.empty(0, 3, dtype=torch.long))
    assert out.shape == (0, 48)


def test_out_buffer(encoder):
    grid = [(1, 4, 4)]
    pixels = random_pixels(grid)
    out = torch.full((4, 48), float("nan"))
    result = encoder.encode(pixels, grid, out=out)
    assert result is out and torch.equal(out, encoder.encode(pixels, grid))


BAD_INPUTS = [
    # (pixels, grid_thw, error type, words the message must contain)
    ("list", [(1, 2, 2)], TypeError, "pixels must be a torch.Tensor"),
    (torch.zeros(4, 1176, dtype=torch.int32), [(1, 2, 2)], TypeError, "pixels must be floating point"),
    (torch.zeros(4, 3, 392), [(1, 2, 2)], ValueError, "pixels must be 2-D"),
    (torch.zeros(4, 1000), [(1, 2, 2)], ValueError, "1176 values per row"),
    (torch.zeros(4, 1176), torch.zeros(1, 3), TypeError, "grid_thw must be an integer tensor"),
    (torch.zeros(4, 1176), torch.ones(1, 2, dtype=torch.long), ValueError, "grid_thw must have shape [k, 3]"),
    (torch.zeros(4, 1176), torch.ones(3, dtype=torch.long), ValueError, "grid_thw must have shape [k, 3]"),
    (torch.zeros(4, 1176), [(1, 2)], ValueError, "grid_thw[0] must be a (t, h, w) triple"),
    (torch.zeros(4, 1176), [(1.0, 2, 2)], TypeError, "grid_thw[0] must hold ints"),
    (torch.zeros(4, 1176), [[1, 2, 2.0]], TypeError, "grid_thw[0] must hold ints"),
    (torch.zeros(4, 1176), [(True, 2, 2)], TypeError, "grid_thw[0] must hold ints"),
    (torch.zeros(4, 1176), "1,2,2", TypeError, "grid_thw must be"),
    (torch.zeros(4, 1176), np.ones((1, 3)), TypeError, "grid_thw must be an integer tensor or array"),
    (torch.zeros(4, 1176), np.array([[1, 2, 2]], dtype=object), TypeError, "grid_thw must be an integer tensor or array"),
    (torch.zeros(4, 1176), np.ones((1, 2), dtype=np.int64), ValueError, "grid_thw must have shape [k, 3]"),
    (torch.zeros(0, 1176), [(0, 2, 2)], ValueError, "grid_thw[0] must be positive"),
    (torch.zeros(8, 1176), [(1, 2, 2), (1, -2, -2)], ValueError, "grid_thw[1] must be positive"),
    (torch.zeros(6, 1176), [(1, 2, 3)], ValueError, "divisible by the merge size 2"),
    (torch.zeros(5, 1176), [(1, 2, 2)], ValueError, "pixels has 5 rows but grid_thw sums to 4"),
    (torch.empty(4, 1176, device="meta"), [(1, 2, 2)], ValueError, "meta device"),
    (torch.zeros(4, 1176), torch.tensor([[1, 2, 2]], device="meta"), ValueError, "grid_thw is a tensor on the meta"),
    (torch.zeros(4, 1176), torch.tensor([[1, 2, 2]]).to_sparse(), TypeError, "grid_thw must be a dense tensor"),
]


def test_every_grid_spelling_gives_the_same_int_triples():
    from vitgraph.runtime.validation import normalize_grid

    want = [(1, 2, 2), (2, 4, 6)]
    spellings = (want, [list(g) for g in want], [np.array(g) for g in want], [torch.tensor(g) for g in want],
                 [tuple(np.int64(v) for v in g) for g in want], torch.tensor(want),
                 torch.tensor(want, dtype=torch.int32), np.array(want), np.array(want, dtype=np.uint16))
    for grid in spellings:
        got = normalize_grid(grid, 2)
        assert got == want and all(type(v) is int for g in got for v in g), grid


@pytest.mark.parametrize("pixels, grid, error, words", BAD_INPUTS)
def test_bad_input_is_refused_and_encoder_stays_usable(encoder, pixels, grid, error, words):
    with pytest.raises(error) as info:
        encoder.encode(pixels, grid)
    assert words in str(info.value)
    good = random_pixels([(1, 2, 2)])
    assert torch.isfinite(encoder.encode(good, [(1, 2, 2)])).all()


@pytest.mark.parametrize("out, error, words", [
    (torch.zeros(3, 48), ValueError, "out must have shape [4, 48]"),
    (torch.zeros(4, 48, dtype=torch.float64), TypeError, "out must have dtype torch.float32"),
    ("buffer", TypeError, "out must be a torch.Tensor"),
])
def test_bad_out(encoder, out, error, words):
    with pytest.raises(error) as info:
        encoder.encode(random_pixels([(1, 4, 4)]), [(1, 4, 4)], out=out)
    assert words in str(info.value)


@pytest.mark.parametrize("options, words", [
    (dict(mode="fast"), "mode must be one of"),
    (dict(mode="graph"), "mode='graph' needs a CUDA device"),
    (dict(max_items=0), "max_items"),
    (dict(min_budget=-4), "min_budget"),
    (dict(budgets=[]), "budgets"),
    (dict(budgets=[30]), "budgets"),
    (dict(budgets=[256.0]), "budgets"),
    (dict(budgets=[True]), "budgets"),
    (dict(pool_limit_bytes=0), "pool_limit_bytes"),
    (dict(capture=1), "capture must be True or False"),
    (dict(tuning={"buckets.dense": "yes"}), "buckets.dense"),
    (dict(tuning={"routing.single_frames": 1}), "routing.single_frames"),
    (dict(tuning={"routing.faster_buckets": "no"}), "routing.faster_buckets"),
    (dict(tuning={"buckets.short_frames": None}), "buckets.short_frames"),
    (dict(exact_eager_above=-1), "exact_eager_above"),
    (dict(tuning={"buckets.dense_max_tokens": 0}), "buckets.dense_max_tokens"),
    (dict(tuning={"buckets.dense_max_tokens": True}), "buckets.dense_max_tokens"),
    (dict(tuning={"buckets.dense_max_tokens": 64.0}), "buckets.dense_max_tokens"),
    (dict(tuning={"attention.sm_count": 0}), "attention.sm_count"),  # the wave model divides by it
    (dict(tuning={"gemm.sm_count": -1}), "gemm.sm_count"),
    # Options that became tuning settings are named with their new place; unknown ones are named.
    (dict(dense_buckets=False), "dense_buckets is a tuning setting: pass tuning={'buckets.dense': ...}"),
    (dict(route_to_faster_buckets=False), "tuning={'routing.faster_buckets': ...}"),
    (dict(dense_max_tokens=1024), "tuning={'buckets.dense_max_tokens': ...}"),
    (dict(max_itmes=4), "unknown option 'max_itmes'"),
    (dict(fuse="yes"), "fuse"),
    (dict(fuse=0), "fuse"),
    (dict(attention="flash"), "not available"),
    (dict(gemm="cutlass"), "gemm must be"),
    (dict(gemm="quack"), "gemm='quack' needs"),
    (dict(device="cuda:0" if not torch.cuda.is_available() else "cuda:99"), "device"),
    (dict(device="tpu"), "device"),
    (dict(dtype=torch.int8), "dtype"),
    (dict(dtype="fp8"), "dtype"),
])
def test_bad_options(options, words):
    with pytest.raises((ValueError, TypeError)) as info:
        GraphedVisionEncoder.from_config(TINY, **{"device": "cpu", **options})
    assert words in str(info.value)


def test_fuse_on_cpu_needs_the_triton_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="fuse=True needs"):
        GraphedVisionEncoder.from_config(TINY, device="cpu", fuse=True)


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset"):
        GraphedVisionEncoder.from_config("qwen9")


def test_stats_on_cpu():
    enc = GraphedVisionEncoder.from_config("tiny", device="cpu")
    enc.encode(random_pixels([(1, 4, 4)], width=1176), [(1, 4, 4)])
    enc.encode(torch.empty(0, 1176), [])
    stats = enc.stats()
    assert stats["mode"] == "eager" and stats["calls"] == 2 and stats["buckets"] == {}
    assert stats["eager_fallbacks"] == {"eager_mode": 1}
    assert stats["attention"] == "sdpa" and stats["gemm"] == "torch" and stats["pool_bytes"] == 0
    with pytest.raises(ValueError, match="capture"):
        enc.capture()


def test_plan_is_host_only(encoder):
    plan = encoder.plan([(1, 4, 4), (2, 2, 2)])
    assert len(plan.steps) == 1 and plan.steps[0].bucket is None


def test_options_are_checked_before_loading(tmp_path):
    with pytest.raises(ValueError, match="mode must be one of"):
        GraphedVisionEncoder.from_pretrained(tmp_path / "not-there", device="cpu", mode="turbo")


def test_random_weights_are_seeded_and_leave_the_global_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    a = GraphedVisionEncoder.from_config("tiny", device="cpu", seed=1)
    assert torch.equal(torch.rand(3), expected)
    b = GraphedVisionEncoder.from_config("tiny", device="cpu", seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.tower.state_dict().values(), b.tower.state_dict().values()))


@pytest.mark.parametrize("options, attention, limit", [
    (dict(), "cudnn", 8192),  # exact_eager_above
    (dict(), "fa4", 0),  # none with fa4: its packed buckets win for single frames
    (dict(tuning={"buckets.dense_max_tokens": 4096}), "fa4", 4096),  # an explicit limit wins over the fa4 default
    (dict(tuning={"buckets.dense_max_tokens": 16384}), "cudnn", 8192),  # never above exact_eager_above
    (dict(exact_eager_above=None), "sdpa", None),
    (dict(exact_eager_above=None), "fa4", 0),
    (dict(exact_eager_above=1024), "fa4", 0),
    (dict(exact_eager_above=1024, tuning={"buckets.dense_max_tokens": 2048}), "fa4", 1024),
    (dict(tuning={"buckets.dense": False}), "cudnn", 0),
    (dict(tuning={"buckets.dense": False, "buckets.dense_max_tokens": 2048}), "fa4", 0),
])
def test_dense_bucket_limit(options, attention, limit):
    options = EngineOptions(**options)
    assert dense_limit(options, attention, apply_overrides(Tuning(), options.tuning or {})) == limit


def test_dense_buckets_follow_the_limit():
    enc = GraphedVisionEncoder.from_config("tiny", device="cpu", budgets=[64, 128, 256],
                                           tuning={"buckets.dense_max_tokens": 128})
    assert [(b.tokens, b.max_segments) for b in enc.requested_buckets if b.max_segments == 1] == [(64, 1), (128, 1)]
    off = GraphedVisionEncoder.from_config("tiny", device="cpu", budgets=[64, 128, 256], tuning={"buckets.dense": False})
    assert [b.tokens for b in off.requested_buckets] == [64, 128, 256]


def test_short_frame_buckets_only_with_fa4_on_cuda():
    h200 = Tuning(attention=attention_tuning(9, 132, 80))
    assert short_cap_rule(EngineOptions(), "fa4", 16, torch.device("cpu"), 4, h200) is None
    off = dataclasses.replace(h200, buckets=dataclasses.replace(h200.buckets, short_frames=False))
    assert short_cap_rule(EngineOptions(), "fa4", 16, torch.device("cpu"), 4, off) is None
    # On CPU (sdpa) the ladder gets no short buckets.
    enc = GraphedVisionEncoder.from_config("tiny", device="cpu", budgets=[64, 128, 256])
    assert all(b.max_seqlen == b.tokens for b in enc.requested_buckets)


def test_fa4_short_tile_rule_on_an_h200():
    """132 SMs, 16 heads, 192-row default tiles. One frame of n tokens: ceil(16 * ceil(n / m) / 132)
    waves of m-row tiles. Worked by hand: 1024 -> 128-row tiles 1 wave (128 CTAs) x 128 against
    1 x 192; 1152 -> 2 waves (144) x 128 = 256 against 1 wave (96) x 192; 1536 -> 2 x 128 against
    1 wave (128 CTAs) x 192; 1664 -> 2 x 128 against 2 waves (144) x 192."""
    from vitgraph.ops.attention import fa4_prefers_short_tile, fa4_prefers_tiny_tile, fa4_short_cap, fa4_tile_kwargs

    h200 = attention_tuning(9, 132, 80)
    assert (h200.short_tile, h200.long_tile, h200.short_seqlen, h200.own_tile_m) == ((128, 128), None, 2048, 192)
    short = {n: fa4_prefers_short_tile(n, 16, h200) for n in (256, 576, 1024, 1028, 1152, 1536, 1540, 1664, 2048, 2052)}
    assert short == {256: True, 576: True, 1024: True, 1028: False, 1152: False, 1536: False, 1540: True,
                     1664: True, 2048: True, 2052: False}
    assert fa4_short_cap(1024, 16, 4, h200) is None and fa4_short_cap(2048, 16, 4, h200) is None
    assert fa4_short_cap(1152, 16, 4, h200) == 1024 and fa4_short_cap(1536, 16, 4, h200) == 1024
    assert fa4_short_cap(4096, 16, 4, h200) == 2048
    assert fa4_short_cap(4096, 16, 4, dataclasses.replace(h200, short_seqlen=0)) is None  # short tiles off
    # 64-row tiles: one wave while 16 * ceil(n / 64) <= 132, i.e. n <= 8 * 64 = 512 (528 is 9
    # tiles: 144 CTAs, 2 waves x 64 = 128, a tie with one wave of 128-row tiles: no).
    tiny = {n: fa4_prefers_tiny_tile(n, 16, h200) for n in (64, 256, 384, 512, 516, 768, 1024, 1540)}
    assert tiny == {64: True, 256: True, 384: True, 512: True, 516: False, 768: False, 1024: False, 1540: False}
    assert not fa4_prefers_tiny_tile(256, 16, dataclasses.replace(h200, tiny_tile=None))
    # Elsewhere FA4 keeps its own tiles; at head_dim 128 its own Hopper tile is 128 rows already.
    assert not attention_tuning(10, 148, 80).choose_tiles and not attention_tuning(None, None, 80).choose_tiles
    assert not fa4_prefers_short_tile(1024, 16, attention_tuning(8, 108, 80))
    assert attention_tuning(9, 132, 128).own_tile_m == 128
    assert fa4_tile_kwargs(None) == {}
    assert fa4_tile_kwargs((128, 128)) == {"tile_mn": (128, 128)}
    assert fa4_tile_kwargs((192, 144, False, True)) == {"tile_mn": (192, 144), "mma_pv_is_rs": False,
                                                        "intra_wg_overlap": True}


def test_kernel_tuning_holds_only_what_the_family_reads():
    """On an H200: Qwen2-VL and Qwen2.5-VL read every GEMM setting, Qwen3-VL all but split K
    (its proj and fc2 stay unsplit): a setting its tower never reads keeps its default, so the
    encoder shows what runs, and changing one is refused by name."""
    from vitgraph.models import family_of
    from vitgraph.models.qwen3_vl import Qwen3VisionConfig
    from vitgraph.ops.gemm import GemmTuning
    from vitgraph.runtime.tuning import tuning_for

    h200 = {name: tuning_for(tower_dims(PRESETS[name]), 9, 132, reads=family_of(PRESETS[name]).tower.tuning_reads)
            for name in ("qwen2-vl-2b", "qwen2.5-vl-7b", "qwen3-vl-8b")}
    for name in ("qwen2-vl-2b", "qwen2.5-vl-7b"):
        assert h200[name] == tuning_for(tower_dims(PRESETS[name]), 9, 132)  # reads everything
    assert h200["qwen2-vl-2b"].gemm.small_rows is not None and GemmTuning().small_rows is None
    assert h200["qwen2.5-vl-7b"].gemm.split_k_max_rows == 896
    every = tuning_for(tower_dims(PRESETS["qwen3-vl-8b"]), 9, 132).gemm
    assert every.split_k_max_rows > 0 and h200["qwen3-vl-8b"].gemm.split_k_max_rows == 0
    assert h200["qwen3-vl-8b"].gemm == dataclasses.replace(every, split_k_max_rows=0)  # quack's thresholds read
    assert all(t.attention.choose_tiles for t in h200.values())  # attention and norms: every family
    qwen3 = Qwen3VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=16,
                              num_position_embeddings=16, deepstack_visual_indexes=(0,))
    with pytest.raises(ValueError, match="does not read 'gemm.split_k_max_rows'"):
        GraphedVisionEncoder.from_config(qwen3, device="cpu", tuning={"gemm.split_k_max_rows": 64})
    enc = GraphedVisionEncoder.from_config(qwen3, device="cpu", tuning={"norms.one_row_max_rows": 8})
    assert enc.tuning.norms.one_row_max_rows == 8 and enc.tuning.gemm.split_k_max_rows == 0


def test_tuning_is_data_each_encoder_holds():
    """Settings changed by name reach the encoder's tower and the plans; another encoder in the
    same process keeps the derived ones; a bad name or value is refused before any build."""
    changed = GraphedVisionEncoder.from_config("tiny", device="cpu", tuning={
        "gemm.split_k_max_rows": 64, "norms.one_row_max_rows": 8, "plans.cache_entries": 1,
        "attention.tiny_tile": [64, 64]})  # a list, as JSON gives it: read as a tuple
    plain = GraphedVisionEncoder.from_config("tiny", device="cpu")
    assert plain.tuning == derive_tuning(tower_dims(TINY), torch.device("cpu"))
    assert changed.tuning.gemm.split_k_max_rows == 64 and plain.tuning.gemm.split_k_max_rows == 0
    assert changed.tower.tuning == changed.tuning.kernels and plain.tower.tuning == plain.tuning.kernels
    assert changed.tuning.attention.tiny_tile == (64, 64)
    assert changed.tower.tuning.attention is changed.tuning.attention
    assert changed.tuning.plans.cache_entries == 1 and plain.tuning.plans.cache_entries == 4096
    x = random_pixels([(1, 4, 4)], changed.tower.input_width)
    assert torch.equal(changed.encode(x, [(1, 4, 4)]), plain.encode(x, [(1, 4, 4)]))  # same seed, same math here
    with pytest.raises(ValueError, match="unknown setting 'gemm.tile_k'"):
        GraphedVisionEncoder.from_config("tiny", device="cpu", tuning={"gemm.tile_k": 1})
    with pytest.raises(ValueError, match="unknown setting 'gemm.backend'"):  # that is EngineOptions.gemm
        EngineOptions(tuning={"gemm.backend": "quack"})
    with pytest.raises(ValueError, match="routing.faster_next_max_tokens"):
        EngineOptions(tuning={"routing.faster_next_max_tokens": "big"})
    with pytest.raises(ValueError, match="routing.single_frames"):
        EngineOptions(tuning={"routing.single_frames": 1})  # a bool setting takes a bool
    with pytest.raises(ValueError, match="tuning must be a mapping"):
        EngineOptions(tuning=[("gemm.split_k", 4)])
    tile = [128, 192, True, 1, 2]
    for name, value in (("gemm.tile", "abcde"), ("gemm.tile", [128, "x", True, 1, 2]),
                        ("gemm.tile", [128, 192, 1, 1, 2]),
                        ("gemm.rope_tiles", [[tile]]), ("gemm.rope_tiles", [[tile, "x"]]), ("gemm.fc1_tiles", []),
                        ("gemm.small_rows", ["a", "b"]), ("attention.short_tile", [128, "x"])):
        with pytest.raises(ValueError, match=f"tuning\\['{name}'\\]"):  # a tile's fields, tuples of numbers
            EngineOptions(tuning={name: value})
    options = EngineOptions(tuning={"gemm.tile": {"tile_m": 64, "tile_n": 128, "pingpong": False, "cluster_m": 1,
                                                  "cluster_n": 1}, "gemm.rope_tiles": [[tile, 11]]})
    from vitgraph.runtime.tuning import apply_overrides
    from vitgraph.ops.gemm import Tile
    changed = apply_overrides(Tuning(), options.tuning).gemm
    assert changed.tile == Tile(64, 128, False, 1, 1) and changed.rope_tiles == ((Tile(128, 192, True, 1, 2), 11.0),)


# Settings that became module constants, table entries or a backend trait (benchmarks/HISTORY.md).
FOLDED = ("gemm.tile_margin", "gemm.fc1_small_tile", "gemm.rope_small_tile", "gemm.split_k_long",
          "gemm.split_k_long_min_k", "gemm.fc1_wave_us", "gemm.rope_wave_us", "norms.wide_min_rows",
          "norms.wide_layout", "norms.wide_widths", "attention.tiny_max_rows", "routing.min_tokens",
          "routing.margin", "routing.faster_next_margin", "routing.faster_next_reps", "plans.eager_min_padding",
          "plans.packed_eager_slower")


@pytest.mark.parametrize("name", FOLDED)
def test_folded_settings_are_unknown(name):
    """A fixed measured constant is no setting: naming one is the unknown-setting error."""
    from vitgraph.runtime.tuning import _names

    assert len(_names()) <= 30 and name not in _names()
    with pytest.raises(ValueError, match=f"unknown setting '{name}'"):
        EngineOptions(tuning={name: 1})


def test_cudnn_graphs_are_never_traded_for_eager_calls():
    """Only cuDNN's ragged graphs attend faster than its eager calls (FA2 varlen): there padding
    never sends a step eager."""
    from vitgraph.ops.backend_names import ATTENTION

    assert [name for name, traits in ATTENTION.items() if traits.eager_slower] == ["cudnn"]


def test_repr_names_family_device_dtype_mode_and_buckets():
    enc = GraphedVisionEncoder.from_config("tiny", device="cpu")
    assert repr(enc) == "GraphedVisionEncoder(qwen2_vl, cpu, float32, eager, 0 buckets captured)"
