"""Qwen2-VL's GPU behaviour: parity on CUDA with every backend, fused forward and GEMM, threads,
routing, fallbacks, the graph pool, quack's and cuDNN's and FA4's kernels. Graph replay
exactness, poisoned memory and 1,000 mixed calls run for every family, Qwen2-VL included, in
test_cuda_families.py, on the same encoders (helpers.make, conftest's fixtures).

Run on a CUDA machine with ``python -m pytest -m cuda -s`` (``-s`` shows the numbers).
"""

import dataclasses
import random
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import (BUDGETS, diff_report, hf_forward, load_frames, load_random_frames, make, random_grids,
                     random_pixels, rel_err, run_eager)

import vitgraph.ops.gemm
from vitgraph.ops import kernels
from vitgraph.ops.attention import available_backends
from vitgraph.engine.planner import Bucket, padded_batch
from vitgraph.models import PRESETS
from vitgraph.ops.gemm import linear_activation, linear_qkv, quack_available

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def family():
    """conftest's weights, graph_enc and eager_enc: helpers.TINY_FAMILIES' Qwen2-VL at CUDA size
    (head_dim 80 as in Qwen2-VL, small enough to capture in seconds)."""
    return "qwen2_vl"


def test_fp32_parity_every_backend(weights):
    grids = [(1, 8, 12), (2, 4, 4), (1, 2, 2)]
    pixels = random_pixels(grids, seed=1)
    ref = hf_forward(weights[0], pixels, grids)  # fp32 on CPU
    # These grids are small: lower quack's row thresholds so every quack GEMM really runs.
    low = {"gemm.fc1_min_rows": 0, "gemm.qkv_min_rows": 0, "gemm.rope_min_rows": 0}
    for backend in available_backends("cuda"):
        for dtype in (torch.float32, torch.bfloat16):
            if dtype == torch.float32 and backend != "sdpa":
                continue  # flash kernels are fp16/bf16 only
            for fuse, gemm in ((False, "cublas"), (True, "cublas"), (True, "quack")):
                if gemm == "quack" and (dtype == torch.float32 or not quack_available("cuda")):
                    continue
                # fused: also with the biases out of the residual stream (above the split-K rows,
                # which these grids are not: lowered)
                for split_k_max in ((None, 0) if fuse else (None,)):
                    tuning = {**low, **({} if split_k_max is None else {"gemm.split_k_max_rows": split_k_max})}
                    enc = make(weights, mode="eager", dtype=dtype, attention=backend, fuse=fuse, gemm=gemm,
                               tuning=tuning)
                    split_k_max = enc.tuning.gemm.split_k_max_rows
                    got = enc.encode(pixels.cuda(), grids).float().cpu()
                    err = rel_err(got, ref)
                    print(f"\n[parity] backend={backend:6s} dtype={str(dtype):14s} fused={fuse!s:5} gemm={gemm:6s} "
                          f"split-K up to {split_k_max} rows vs transformers fp32: {diff_report(got, ref)}")
                    assert err <= (1e-5 if dtype == torch.float32 else 2e-2), diff_report(got, ref)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="griddepcontrol needs compute capability 9+")
def test_layernorm_launching_its_dependents_changes_no_bit(graph_enc):
    """On Hopper add+LayerNorm lets the kernel after it launch early (quack's GEMMs then run
    their prologue while it finishes, and wait for its results): every bucket's replay equals
    an eager run on the same buffers with every kernel launched the plain way."""
    norms = graph_enc.tuning.norms
    assert kernels._launches_dependents(torch.empty(BUDGETS[-1], 1, device="cuda"), norms)
    assert not kernels._launches_dependents(torch.empty(norms.launch_dependents_max_rows + 1, 1, device="cuda"), norms)
    bank, tuned = graph_enc.bank, graph_enc.tower.tuning
    plain_way = dataclasses.replace(tuned, norms=dataclasses.replace(norms, launch_dependents_max_rows=0))
    rng = random.Random(1)
    try:
        for bucket in bank.buckets:
            _, tokens = load_random_frames(bank, bucket, rng)
            replayed = bank.replay(bucket)[:tokens // 4].clone()
            graph_enc.tower.set_tuning(plain_way)
            plain = run_eager(bank, bucket)[:tokens // 4]
            graph_enc.tower.set_tuning(tuned)
            assert torch.equal(replayed, plain), f"bucket {bucket.name}: {diff_report(replayed, plain)}"
    finally:
        graph_enc.tower.set_tuning(tuned)


@pytest.mark.parametrize("long_splits", [None, 1, 2])
def test_split_k_partials_summed_by_layernorm_at_every_split_size(long_splits, monkeypatch):
    """proj and fc2 at the real widths, split in K up to split_k_max_rows rows on Hopper (fc2 in
    SPLIT_K_LONG slices at split_k_long_rows rows, or there unsplit or in two): the
    add+LayerNorm that sums the partials (one row per program, or several above
    one_row_max_rows) matches the unsplit GEMM plus add and LayerNorm in fp32."""
    from vitgraph.models import tower_dims
    from vitgraph.runtime.tuning import derive_tuning

    torch.manual_seed(0)
    width = 1280
    gamma = torch.rand(width, device="cuda", dtype=torch.bfloat16) + 0.5
    beta = torch.randn(width, device="cuda", dtype=torch.bfloat16) * 0.1
    tuning = derive_tuning(tower_dims(PRESETS["qwen2-vl-2b"]), torch.device("cuda")).gemm
    if long_splits is not None:
        monkeypatch.setattr(vitgraph.ops.gemm, "SPLIT_K_LONG", long_splits)
    for rows in (256, 288, 320, 416, 704, 896):
        for k in (width, 4 * width):  # proj, fc2
            splits = vitgraph.ops.gemm.split_k_count(rows, k, tuning)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(width, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            bias = torch.randn(width, device="cuda", dtype=torch.bfloat16) * 0.1
            residual = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
            y, y_bias = vitgraph.ops.gemm.linear_split_k(x, weight, bias, tuning)
            assert (y_bias is not None) == (splits > 1), (rows, k)
            assert tuple(y.shape) == ((splits, rows, width) if splits > 1 else (rows, width)), (rows, k)
            got_x = residual.clone()
            got_h = kernels.add_layernorm(got_x, y, gamma, beta, 1e-6, y_bias=y_bias)
            expect_x = residual.float() + x.float() @ weight.float().T + bias.float()
            expect_h = F.layer_norm(expect_x, (width,), gamma.float(), beta.float(), 1e-6)
            assert rel_err(got_x.float(), expect_x) <= 1e-2, (rows, k)
            assert rel_err(got_h.float(), expect_h) <= 1e-2, (rows, k)


def test_replay_matches_unpadded_eager(graph_enc, eager_enc):
    rng = random.Random(1)
    for trial in range(20):
        grids = random_grids(rng, rng.randint(1, 5))
        pixels = random_pixels(grids, seed=trial).cuda()
        got, ref = graph_enc.encode(pixels, grids), eager_enc.encode(pixels, grids)
        assert rel_err(got, ref) <= 1e-2, diff_report(got, ref)


def test_single_frame_replays_in_a_dense_bucket(graph_enc, eager_enc):
    grids = [(1, 16, 20)]  # 320 tokens, one frame -> the 512-token dense bucket
    pixels = random_pixels(grids, seed=13).cuda()
    before = graph_enc.stats()["buckets"]["512x1"]["replays"]
    got = graph_enc.encode(pixels, grids)
    assert graph_enc.stats()["buckets"]["512x1"]["replays"] == before + 1
    assert graph_enc.tower.fused and rel_err(got, eager_enc.encode(pixels, grids)) <= 1e-2


def test_single_frames_follow_the_routing_measured_at_capture(weights, graph_enc, eager_enc):
    measured = graph_enc.stats()["single_frame_packed_below"]
    print(f"\n[routing] single frames to the packed bucket below: {measured}")
    assert set(measured) <= {1024} and all(0 < n <= 1025 for n in measured.values())
    bucket = graph_enc.buckets[0]
    assert graph_enc.bank.time_replay(bucket, graph_enc.bank.stage(padded_batch(graph_enc.tower, bucket, [(1, 2, 2)]))) > 0
    # Force the 512 budget's single frames into its packed bucket: same numbers, other graph.
    enc = make(weights, mode="graph", budgets=[256, 512], tuning={"routing.single_frames": False})
    assert enc.stats()["single_frame_packed_below"] == {}
    enc._packed_single_below = {512: 400}
    grids = [(1, 16, 20)]  # 320 tokens
    pixels = random_pixels(grids, seed=14).cuda()
    got = enc.encode(pixels, grids)
    assert enc.stats()["buckets"]["512x8"]["replays"] == 1 and enc.stats()["buckets"]["512x1"]["replays"] == 0
    assert rel_err(got, eager_enc.encode(pixels, grids)) <= 1e-2
    enc.encode(random_pixels([(1, 16, 26)], seed=15).cuda(), [(1, 16, 26)])  # 416 tokens: dense
    assert enc.stats()["buckets"]["512x1"]["replays"] == 1


def test_steps_follow_a_faster_next_bucket_measured_at_capture(weights, eager_enc):
    enc = make(weights, mode="graph", budgets=[256, 512], tuning={"routing.faster_buckets": True})
    measured = enc.stats()["faster_next_bucket"]
    print(f"\n[routing] faster next buckets: {measured}")
    assert measured in ({}, {"256x8": "512x8"}) and enc._routing_seconds > 0
    # Force it: a step of the 256-token packed bucket replays in the 512-token one, same numbers.
    enc._faster_next = {Bucket(256, 8): Bucket(512, 8)}
    enc._plans.clear()
    grids = [(2, 8, 8)]  # two frames, 128 tokens
    pixels = random_pixels(grids, seed=16).cuda()
    before = {name: enc.stats()["buckets"][name]["replays"] for name in ("256x8", "512x8")}
    got = enc.encode(pixels, grids)
    after = {name: enc.stats()["buckets"][name]["replays"] for name in ("256x8", "512x8")}
    assert after == {"256x8": before["256x8"], "512x8": before["512x8"] + 1}
    assert rel_err(got, eager_enc.encode(pixels, grids)) <= 1e-2
    single = [(1, 16, 16)]  # one frame: its dense bucket, never rerouted by this map
    enc.encode(random_pixels(single, seed=17).cuda(), single)
    assert enc.stats()["buckets"]["256x1"]["replays"] == 1


def test_load_refuses_metadata_staged_for_another_bucket(graph_enc, eager_enc):
    bank = graph_enc.bank
    small, large = bank.buckets[0], bank.buckets[-1]
    staged = bank.stage(padded_batch(bank.model, small, [(1, 2, 2)]))
    with pytest.raises(ValueError, match="staged metadata"):
        bank.load(large, bank.static_pixels[:0], staged)
    grids = [(1, 4, 6)]
    pixels = random_pixels(grids, seed=3).cuda()
    assert rel_err(graph_enc.encode(pixels, grids), eager_enc.encode(pixels, grids)) <= 1e-2


def test_first_result_survives_second_call(graph_enc):
    g1, g2 = [(1, 8, 8)], [(1, 8, 8)]
    p1, p2 = random_pixels(g1, seed=7).cuda(), random_pixels(g2, seed=8).cuda()
    first = graph_enc.encode(p1, g1)
    snapshot = first.clone()
    second = graph_enc.encode(p2, g2)
    torch.cuda.synchronize()
    assert torch.equal(first, snapshot) and not torch.equal(first, second)
    assert first.data_ptr() not in {c.output.data_ptr() for c in graph_enc.bank.graphs.values()}


def test_calls_queued_ahead_of_a_lagging_gpu(graph_enc):
    """Every replay reads its metadata from one pinned staging buffer (inside the graph where
    torch can record an event there): calls queued while earlier replays have not started
    must not overwrite what those replays will read."""
    layouts = [[(1, 8, 8)], [(1, 4, 8), (1, 4, 8)], [(1, 2, 4)] * 8, [(1, 8, 4), (1, 2, 4), (1, 2, 12)]]
    inputs = [(g, random_pixels(g, seed=300 + i).cuda().bfloat16()) for i, g in enumerate(layouts)]
    expected = []
    for grids, pixels in inputs:  # one at a time: nothing queued
        expected.append(graph_enc.encode(pixels, grids))
        torch.cuda.synchronize()
    assert all(not torch.equal(expected[0], e) for e in expected[1:])  # the layouts give different outputs
    for _ in range(3):
        torch.cuda._sleep(100_000_000)  # tens of ms: the host queues every call before the first replay starts
        outs = [graph_enc.encode(pixels, grids) for grids, pixels in inputs * 2]
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            assert torch.equal(out, expected[i % len(inputs)]), f"call {i}: {diff_report(out, expected[i % len(inputs)])}"
    print(f"\n[queued calls] metadata copied inside the graphs: {graph_enc.bank.copies_metadata_in_graph}")


def test_eight_threads(graph_enc):
    rng = random.Random(3)
    inputs = [(g, random_pixels(g, seed=200 + i).cuda()) for i, g in
              enumerate(random_grids(rng, rng.randint(1, 4)) for _ in range(8))]
    expected = [graph_enc.encode(p, g) for g, p in inputs]
    torch.cuda.synchronize()
    results = [None] * 8
    errors = []

    def worker(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                outs = [graph_enc.encode(inputs[i][1], inputs[i][0]) for _ in range(20)]
            stream.synchronize()
            results[i] = outs
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(8):
        for out in results[i]:
            assert torch.equal(out, expected[i]), f"thread {i}: {diff_report(out, expected[i])}"


def test_replay_path_really_runs(weights, monkeypatch):
    enc = make(weights, mode="graph")
    grids = [(1, 8, 8), (2, 4, 4)]
    pixels = random_pixels(grids, seed=9).cuda()
    before = enc.encode(pixels, grids)

    def refuse(*args, **kwargs):
        raise AssertionError("eager forward called in graph mode")

    monkeypatch.setattr(enc.tower, "forward", refuse)
    after = enc.encode(pixels, grids)
    assert torch.equal(before, after)
    assert enc.stats()["buckets"]["128x8"]["replays"] == 2


def test_oversize_item_takes_eager_fallback(graph_enc, eager_enc):
    grids = [(1, 8, 8), (1, 40, 40), (1, 4, 4)]  # 1600 > 1024 tokens
    pixels = random_pixels(grids, seed=10).cuda()
    before = dict(graph_enc.stats()["eager_fallbacks"])
    got = graph_enc.encode(pixels, grids)
    after = graph_enc.stats()["eager_fallbacks"]
    assert after.get("oversize", 0) == before.get("oversize", 0) + 1
    assert rel_err(got, eager_enc.encode(pixels, grids)) <= 1e-2


@pytest.mark.parametrize("backend", ["fa4", "cudnn", "varlen"])
def test_padded_large_packed_steps_run_eagerly(weights, backend):
    """Above exact_eager_above, a step of several frames that its bucket would pad enough runs
    eagerly at its exact shape (bitwise what an eager encoder gives), unless the backend's
    graphs attend through a faster kernel than its eager calls (cudnn); a well-filled one replays."""
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not available")
    enc = make(weights, mode="graph", attention=backend, exact_eager_above=256)
    eager = make(weights, mode="eager", attention=backend)
    padded = [(1, 12, 12), (2, 8, 10), (1, 4, 4)]  # 144 + 160 + 16 = 320 tokens in the 512 bucket
    full = [(1, 16, 16), (1, 8, 30)]  # 256 + 240 = 496 tokens in 512: 3% padding
    for grids, replays in ((padded, backend == "cudnn"), (full, True)):
        pixels = random_pixels(grids, seed=12).cuda()
        (step,) = enc.plan(grids).steps
        assert (step.bucket is not None) == replays and step.segments == sum(t for t, _, _ in grids)
        got, want = enc.encode(pixels, grids), eager.encode(pixels, grids)
        assert torch.equal(got, want) if not replays else rel_err(got, want) <= 1e-2
    assert enc.stats()["eager_fallbacks"] == ({} if backend == "cudnn" else {"exact_eager": 1})


def test_many_frames_beyond_segment_capacity_are_split(graph_enc, eager_enc):
    grids = [(20, 4, 4)]  # 20 frames > max_items 8
    pixels = random_pixels(grids, seed=11).cuda()
    assert rel_err(graph_enc.encode(pixels, grids), eager_enc.encode(pixels, grids)) <= 1e-2


def test_empty_input_touches_nothing(graph_enc):
    out = graph_enc.encode(torch.empty(0, 1176, device="cuda"), [])
    assert out.shape == (0, 256) and out.device.type == "cuda"


def test_out_of_memory_during_capture_drops_the_bucket(weights, monkeypatch, caplog):
    from vitgraph.models.qwen2_vl import Qwen2VisionTower

    real_forward = Qwen2VisionTower.forward

    def flaky(self, pixels, batch):
        if pixels.shape[0] == 512 and torch.cuda.is_current_stream_capturing():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(self, pixels, batch)

    monkeypatch.setattr(Qwen2VisionTower, "forward", flaky)
    enc = make(weights, mode="graph", tuning={"routing.single_frames": False})  # single frames: always dense
    assert 512 not in [b.tokens for b in enc.buckets] and len(enc.buckets) == 2 * len(BUDGETS) - 2
    assert "out of memory" in enc.stats()["dropped_buckets"]["512x1"]
    assert "out of memory" in enc.stats()["dropped_buckets"]["512x8"]
    monkeypatch.setattr(Qwen2VisionTower, "forward", real_forward)
    grids = [(1, 16, 20)]  # 320 tokens: would have used 512, now 1024
    out = enc.encode(random_pixels(grids, seed=12).cuda(), grids)
    assert torch.isfinite(out).all() and enc.stats()["buckets"]["1024x1"]["replays"] == 1


def test_pool_limit(weights):
    enc = make(weights, mode="graph", pool_limit_bytes=1)
    assert enc.buckets == [] and len(enc.stats()["dropped_buckets"]) == 2 * len(BUDGETS)
    assert enc.stats()["pool_bytes"] == enc.stats()["pool_workspace_bytes"] == 0  # no pool kept for nothing
    grids = [(1, 4, 4)]
    out = enc.encode(random_pixels(grids).cuda(), grids)
    assert torch.isfinite(out).all() and enc.stats()["eager_fallbacks"] == {"no_graphs": 1}


@pytest.mark.parametrize("bias_free", [True, False], ids=["bias-free", "bias-in-stream"])
def test_graph_pool_stays_near_one_eager_forward(weights, bias_free):
    """Every bucket's graph shares one pool the size of the largest forward's activation peak
    plus its margin (the 1.2x target): an allocation order that leaves fc1's output no gap
    to fit in would grow the pool by a segment of that size. Buckets of 4096-16384 rows, so
    that every activation comes from the caching allocator's large pool, as in the real tower."""
    from vitgraph.bench.common import eager_peak_bytes

    enc = make(weights, mode="graph", budgets=[4096, 8192, 16384], max_items=4, tuning={"gemm.bias_free": bias_free})
    assert vitgraph.ops.gemm.bias_free_stream(4096, enc.tower.tuning.gemm) == bias_free
    # The pool also holds the capture stream's cuBLAS workspaces, which are no activations
    # (the eager peak leaves out the eager stream's too).
    stats = enc.stats()
    pool, peak = stats["pool_bytes"] - stats["pool_workspace_bytes"], eager_peak_bytes(enc)
    print(f"\n[pool] bias_free={bias_free} pool {pool / 2**20:.1f} MiB (+ {stats['pool_workspace_bytes'] / 2**20:.1f}"
          f" MiB workspaces), eager peak {peak / 2**20:.1f} MiB")
    assert max(b.tokens for b in enc.buckets) == 16384 and 0 < pool <= 1.2 * peak, (pool, peak)


def test_cached_plans_stage_the_right_metadata(graph_enc):
    plans = graph_enc.tuning.plans
    graph_enc.tuning = dataclasses.replace(graph_enc.tuning, plans=dataclasses.replace(plans, cache_bytes=4096))
    try:
        _check_cached_plans(graph_enc)  # a few plans: forces eviction
    finally:
        graph_enc.tuning = dataclasses.replace(graph_enc.tuning, plans=plans)


def _check_cached_plans(graph_enc):
    pool_bytes, routing = graph_enc.stats()["pool_bytes"], graph_enc.stats()["single_frame_packed_below"]
    routing_s = graph_enc._routing_seconds
    graph_enc.capture()  # nothing new to capture; empties the plan cache, keeps the routing timings
    assert graph_enc.stats()["pool_bytes"] == pool_bytes and not graph_enc._plans
    assert graph_enc._routing_seconds == routing_s and graph_enc.stats()["single_frame_packed_below"] == routing
    calls = [[(1, 8, 8)], [(2, 4, 6), (1, 2, 2)], [(1, 8, 8)], [(1, 16, 16)], [(2, 4, 6), (1, 2, 2)], [(1, 8, 8)]]
    first = {}
    for i, grids in enumerate(calls):
        pixels = random_pixels(grids, seed=len(grids)).cuda()
        out = graph_enc.encode(pixels, grids)
        key = tuple(grids)
        if key in first:  # the same grids replay the same bucket: bitwise the same output
            assert torch.equal(out, first[key]), f"call {i} {grids}: {diff_report(out, first[key])}"
        first.setdefault(key, out)
        assert graph_enc._plans.nbytes <= 4096 and graph_enc._plans


def test_stats_report(graph_enc):
    stats = graph_enc.stats()
    print(f"\n[stats] buckets={sorted(stats['buckets'])} capture_seconds={stats['capture_seconds']:.2f} "
          f"pool_bytes={stats['pool_bytes']} attention={stats['attention']} gemm={stats['gemm']}")
    assert stats["mode"] == "graph" and stats["pool_bytes"] > 0 and stats["capture_seconds"] > 0
    used = [b for b in stats["buckets"].values() if b["replays"]]
    assert used and all(b["real_tokens"] > 0 and b["padded_tokens"] >= 0 for b in used)


# vitgraph.ops.gemm's quack paths: (function, output width, the cuBLAS path it replaces, row threshold, more rows)
QUACK_LAYERS = {
    "fc1+quick_gelu": (lambda x, w, b, tuning: linear_activation(x, w, b, "quick_gelu", False, tuning), 5120,
                       lambda x, w, b: kernels.activation_(F.linear(x, w, b), "quick_gelu"),
                       "fc1_min_rows", (256, 1000, 1152, 4096)),
    "qkv": (linear_qkv, 3840, F.linear, "qkv_min_rows", (4000,)),
}


def quack_2b():
    """The GEMM tuning of Qwen2-VL's tower on this GPU, quack's backend."""
    from vitgraph.models import tower_dims
    from vitgraph.runtime.tuning import derive_tuning

    return dataclasses.replace(derive_tuning(tower_dims(PRESETS["qwen2-vl-2b"]), torch.device("cuda")).gemm, backend="quack")


@pytest.mark.skipif(not quack_available("cuda"), reason="needs quack-kernels on a Hopper GPU")
@pytest.mark.parametrize("layer", list(QUACK_LAYERS))
def test_quack_gemm_against_cublas_in_and_out_of_a_graph(layer):
    """quack's GEMM (fc1 with QuickGELU in its epilogue; plain qkv) against the cuBLAS path it
    replaces, at the real widths, eagerly and replayed on new inputs; below its row threshold
    the function is the cuBLAS path, bit for bit."""
    fn, width, cublas, threshold, more_rows = QUACK_LAYERS[layer]
    quack = quack_2b()
    threshold = getattr(quack, threshold)
    torch.manual_seed(0)
    weight = torch.randn(width, 1280, device="cuda", dtype=torch.bfloat16) * 0.03
    bias = torch.randn(width, device="cuda", dtype=torch.bfloat16) * 0.1
    for rows in (threshold, *more_rows):
        x = torch.randn(rows, 1280, device="cuda", dtype=torch.bfloat16)
        ref, got = cublas(x, weight, bias), fn(x, weight, bias, quack)
        print(f"\n[quack {layer}] rows={rows}: {diff_report(got.float(), ref.float())}")
        assert rel_err(got.float(), ref.float()) <= 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = fn(x, weight, bias, quack)
        x.copy_(torch.randn_like(x))  # new input: the replay must really run the GEMM
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, fn(x, weight, bias, quack))
    small = torch.randn(threshold - 1, 1280, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fn(small, weight, bias, quack), cublas(small, weight, bias))


@pytest.mark.skipif(not quack_available("cuda"), reason="needs quack-kernels on a Hopper GPU")
def test_fc1_tiles_give_the_same_bits():
    """fc1's tile follows a wave model (128x128 at 1152 rows on an H200, the default tile at 4096):
    every candidate gives the bits the picked one gives."""
    from vitgraph.ops.gemm import FC1_SMALL_TILE, _gemm_config, _quack

    quack = quack_2b()

    gemm_act, _, name, _ = _quack()
    torch.manual_seed(0)
    weight = torch.randn(5120, 1280, device="cuda", dtype=torch.bfloat16) * 0.03
    bias = torch.randn(5120, device="cuda", dtype=torch.bfloat16) * 0.1
    for rows in (256, 1152, 4096):
        x = torch.randn(rows, 1280, device="cuda", dtype=torch.bfloat16)
        got = linear_activation(x, weight, bias, "quick_gelu", False, quack)
        for tile in [FC1_SMALL_TILE] + [tile for tile, _ in quack.fc1_tiles]:
            other = torch.empty_like(got)
            gemm_act(x, weight.t(), None, other, None, bias, name, config=_gemm_config(tile))
            assert torch.equal(other, got), (rows, tile)


@pytest.mark.skipif(not quack_available("cuda"), reason="needs quack-kernels on a Hopper GPU")
def test_qkv_rope_epilogue_against_gemm_plus_triton_rotary():
    """qkv with the rotary in quack's epilogue against F.linear plus the Triton rotary pass, at
    the real widths, positions far from 0 (angles up to ~1000 rad), NaN in the padding rows'
    inputs; eagerly and replayed on new inputs."""
    from vitgraph.models import PRESETS
    from vitgraph.ops.gemm import ROPE_SMALL_TILE, _gemm_config, linear_qkv_rope
    from vitgraph.ops.gemm_rope import qkv_rope
    from vitgraph.models.qwen2_vl import Qwen2VisionTower

    cfg, quack = PRESETS["qwen2-vl-2b"], quack_2b()
    tower = Qwen2VisionTower(dataclasses.replace(cfg, depth=1)).cuda()  # for its rotary frequencies
    freq_h, freq_w = tower.rope_columns()
    inv_freq = tower.inv_freq
    torch.manual_seed(0)
    weight = torch.randn(3 * cfg.embed_dim, cfg.embed_dim, device="cuda", dtype=torch.bfloat16) * 0.03
    bias = torch.randn(3 * cfg.embed_dim, device="cuda", dtype=torch.bfloat16) * 0.1
    heads, head_dim = cfg.num_heads, cfg.head_dim
    for rows, real in ((256, 240), (512, 484), (704, 676), (1024, 1024), (1536, 1500), (4096, 3900)):
        x = torch.randn(rows, cfg.embed_dim, device="cuda", dtype=torch.bfloat16)
        x[real:] = float("nan")
        positions = torch.randint(0, 1000, (rows, 2), device="cuda", dtype=torch.int32)
        segment_ids = torch.where(torch.arange(rows, device="cuda") < real, 0, -1).int()
        pos_h = torch.where(segment_ids >= 0, positions[:, 0].float(), -1.0)
        pos_w = positions[:, 1].float().contiguous()
        angles = (positions.float()[..., None] * inv_freq).flatten(1)
        ref = F.linear(x, weight, bias)
        kernels.rotary_(ref, angles.cos(), angles.sin(), heads, segment_ids, zero_padding=True)
        got = linear_qkv_rope(x, weight, bias, freq_h, freq_w, pos_h, pos_w, quack)
        print(f"\n[qkv rope epilogue] rows={rows}: {diff_report(got[:real].float(), ref[:real].float())}")
        assert torch.equal(got[real:], torch.zeros_like(got[real:]))  # padding rows zeroed, NaN inputs or not
        assert rel_err(got[:real].float(), ref[:real].float()) <= 1e-2
        # Whichever tile the wave model picks (128x240 for 1024 rows on an H200), the others
        # give the same bits: the tiles differ in N, not in the order K is summed.
        for tile in [ROPE_SMALL_TILE] + [tile for tile, _ in quack.rope_tiles]:
            other = qkv_rope(x, weight, bias, freq_h, freq_w, pos_h, pos_w, _gemm_config(tile))
            assert torch.equal(other, got), tile
        v = slice(2 * heads * head_dim, None)  # v is not rotated
        assert rel_err(got[:real, v].float(), ref[:real, v].float()) <= 1e-2
        # A real row with an inf: its v comes out 0 where not finite (FlashAttention 4 weighs a
        # tile's values past a segment's end 0), every other row as it was.
        poisoned = x.clone()
        poisoned[real // 2, 7] = float("inf")
        hit = linear_qkv_rope(poisoned, weight, bias, freq_h, freq_w, pos_h, pos_w, quack)
        assert not torch.isfinite(F.linear(poisoned[real // 2], weight)[v]).all()
        assert (hit[real // 2, v] == 0).all() and not torch.isfinite(hit[real // 2, :v.start]).all()
        others = torch.arange(rows, device="cuda") != real // 2
        assert torch.equal(hit[others], got[others])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = linear_qkv_rope(x, weight, bias, freq_h, freq_w, pos_h, pos_w, quack)
        x[:real].copy_(torch.randn_like(x[:real]))  # new input: the replay must really run the GEMM
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, linear_qkv_rope(x, weight, bias, freq_h, freq_w, pos_h, pos_w, quack))


def test_cudnn_ragged_attention_in_a_graph_follows_new_layouts():
    """cuDNN's ragged attention captured once, replayed for other segmentations (empty slots,
    NaN padding rows included), against FA2 varlen on each exact layout."""
    from torch.nn.attention.varlen import varlen_attn

    from vitgraph.ops import cudnn_attention

    if not cudnn_attention.available():
        pytest.skip("nvidia-cudnn-frontend is not installed")
    tokens, slots, heads, head_dim = 512, 8, 4, 80
    qkv = torch.randn(tokens, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.zeros(slots + 1, device="cuda", dtype=torch.int32)
    box = {}

    def run():
        meta = cudnn_attention.ragged_metadata(cu, heads, head_dim)
        box["out"] = cudnn_attention.ragged_attention(qkv, meta, tokens)

    run()  # builds the cuDNN graph outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ([512], [100, 200, 3], [64] * 8, [1, 300]):
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        real = offsets[-1]
        cu.copy_(torch.tensor(offsets + [real] * (slots + 1 - len(offsets)), dtype=torch.int32))
        qkv[real:] = float("nan")
        graph.replay()
        exact = torch.tensor(offsets, device="cuda", dtype=torch.int32)
        q, k, v = qkv[:real].unbind(1)
        ref = varlen_attn(q, k, v, exact, exact, max(lens), max(lens))
        got = box["out"][:real]
        assert torch.isfinite(got).all() and rel_err(got, ref) <= 1e-2, (lens, diff_report(got, ref))
        qkv[real:] = torch.randn_like(qkv[real:])


def test_fa4_short_tiles_follow_max_seqlen_and_match_varlen(monkeypatch):
    """FlashAttention 4 with its 128-row tiles (batches whose max_seqlen is at most
    short_seqlen) and with its default tiles, against FA2 varlen, padding rows zeroed."""
    from torch.nn.attention.varlen import varlen_attn

    import vitgraph.ops.attention
    from vitgraph.ops.attention import attend, fa4_tile, fa4_tile_kwargs
    from vitgraph.models.qwen2_vl import VisionBatch
    from vitgraph.models import tower_dims
    from vitgraph.runtime.tuning import derive_tuning

    if "fa4" not in available_backends("cuda"):
        pytest.skip("flash-attn-4 is not installed")
    tuning = derive_tuning(tower_dims(PRESETS["qwen2-vl-2b"]), torch.device("cuda")).attention
    if not tuning.choose_tiles:
        pytest.skip("FlashAttention 4's tiles follow the batch on Hopper only")
    short, long, tiny = (fa4_tile_kwargs(t) for t in (tuning.short_tile, tuning.long_tile, tuning.tiny_tile))
    assert fa4_tile_kwargs(fa4_tile(1024, 16, None, tuning)) == short and short["tile_mn"][0] == 128
    assert fa4_tile_kwargs(fa4_tile(tuning.short_seqlen + 1, 16, None, tuning)) == long
    assert fa4_tile(512, 16, 512, tuning) == tuning.tiny_tile and fa4_tile(512, 16, 1024, tuning) == tuning.short_tile
    calls = []
    forward = vitgraph.ops.attention._fa4_forward()
    monkeypatch.setattr(vitgraph.ops.attention, "_fa4_forward",
                        lambda: lambda *a, **kw: calls.append(kw.get("tile_mn")) or forward(*a, **kw))
    heads, head_dim, tokens, slots = 4, 80, 640, 8
    lens = [300, 17, 200]
    real = sum(lens)
    cu = torch.tensor([0, 300, 317, 517] + [real] * (slots - 3), device="cuda", dtype=torch.int32)
    ids = torch.full((tokens,), -1, device="cuda", dtype=torch.int32)
    ids[:real] = torch.repeat_interleave(torch.arange(3, device="cuda", dtype=torch.int32),
                                         torch.tensor(lens, device="cuda"))
    q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    exact = cu[:4]
    ref = varlen_attn(q[:real], k[:real], v[:real], exact, exact, 300, 300)
    # 640 rows, 4 heads: 64-row tiles fit one wave (40 CTAs), unless turned off.
    for cap, tiny_tile, tile in ((tokens, tiny["tile_mn"], tiny["tile_mn"]), (tokens, None, short["tile_mn"]),
                                 (tokens - 1, tiny["tile_mn"], long.get("tile_mn"))):
        case = dataclasses.replace(tuning, short_seqlen=cap, tiny_tile=tiny_tile)
        batch = VisionBatch(torch.zeros(tokens, 2, device="cuda", dtype=torch.int32), ids, cu, tokens)
        v_poisoned = v.clone()
        v_poisoned[real:] = float("nan")  # attend zeroes padding rows of v for FA4
        got = attend("fa4", q, k, v_poisoned, batch, tuning=case)[:real]
        assert calls[-1] == tile
        assert torch.isfinite(got).all() and rel_err(got, ref) <= 1e-2, (tile, diff_report(got, ref))
        print(f"\n[fa4] tile {tile or 'default'}: {diff_report(got, ref)}")


def test_short_frame_buckets_replay_bitwise_and_take_short_steps(weights, eager_enc):
    """With a low short_seqlen every budget above it gets a short-frame bucket (128-row
    FA4 tiles) beside its packed one (default tiles): both replay bitwise equal to eager on
    the same buffers, steps of short frames go to the short bucket, and results match."""
    if "fa4" not in available_backends("cuda"):
        pytest.skip("flash-attn-4 is not installed")
    enc = make(weights, mode="graph", attention="fa4", budgets=[128, 256, 512],
               tuning={"buckets.dense": False, "attention.short_seqlen": 128})
    assert [b.name for b in enc.buckets] == ["128x8", "256x8s128", "256x8", "512x8s128", "512x8"]
    assert enc.stats()["buckets"]["256x8s128"]["max_seqlen"] == 128 and enc.stats()["buckets"]["256x8"]["max_seqlen"] == 256
    rng = random.Random(5)
    for bucket in enc.bank.buckets:
        grids, tokens = load_random_frames(enc.bank, bucket, rng) if bucket.max_seqlen == bucket.tokens else \
            _load_short_frames(enc.bank, bucket)
        replayed = enc.bank.replay(bucket)[:tokens // 4].clone()
        eager = run_eager(enc.bank, bucket)[:tokens // 4]
        assert torch.equal(replayed, eager), f"bucket {bucket.name}: {diff_report(replayed, eager)}"
    short = [(1, 8, 8), (1, 6, 10), (1, 10, 12)]  # 244 tokens, longest frame 120
    long = [(1, 8, 8), (1, 12, 12)]  # 208 tokens, longest frame 144
    for grids, name in ((short, "256x8s128"), (long, "256x8")):
        assert [s.bucket.name for s in enc.plan(grids).steps] == [name]
        pixels = random_pixels(grids, seed=7).cuda()
        before = enc.stats()["buckets"][name]["replays"]
        got = enc.encode(pixels, grids)
        assert enc.stats()["buckets"][name]["replays"] == before + 1
        assert rel_err(got, eager_enc.encode(pixels, grids)) <= 1e-2, diff_report(got, eager_enc.encode(pixels, grids))


def _load_short_frames(bank, bucket):
    return load_frames(bank, bucket, [(1, 8, 8)] * (bucket.tokens // 128) + [(1, 2, 8)])  # 64-token frames, one of 16
