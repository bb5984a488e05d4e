"""The coalescing front on a GPU, with graphs: merged requests against the same requests alone
(and against the distance that another bucket gives one request), isolation of a NaN request
inside a shared replay, rows made on another stream, and images. Run with
``python -m pytest -m cuda -s tests/test_cuda_coalesce.py``."""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import family_weights, make, pixels_for, random_grids, rel_err
from test_coalesce import assert_a_nan_request_leaves_the_others_bitwise, jpeg

pytestmark = pytest.mark.cuda

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


def _bucket_distance(enc, pixels, grids) -> float:
    """The largest distance between a request alone and the same request replayed in other
    buckets (pushed there by filler items after it)."""
    alone = enc.encode(pixels, grids)
    tokens = pixels.shape[0]
    worst = 0.0
    for bucket in enc.buckets:
        room = bucket.tokens - tokens
        if room < 16 or bucket.max_segments < len(grids) + 1:
            continue
        filler = [(1, 2, 2 * (room // 4))]  # one frame of 2 x w patches filling the bucket
        extra = pixels_for(enc, filler, seed=7, dtype=pixels.dtype)
        out = enc.encode(torch.cat([pixels, extra]), grids + filler)[:alone.shape[0]]
        worst = max(worst, rel_err(out, alone))
    return worst


def test_merged_requests_equal_each_request_alone_within_a_buckets_distance(family):
    enc = make(family_weights(family))
    rng = random.Random(5)
    requests = []
    for i in range(48):
        grids = random_grids(rng, rng.randint(1, 2), max_frames=2, max_side=12)
        requests.append((pixels_for(enc, grids, seed=i), grids))
    with ThreadPoolExecutor(16) as callers:
        futures = list(callers.map(lambda r: enc.submit(*r), requests))
    merged = [f.result(timeout=120) for f in futures]
    worst_merge = max(rel_err(m, enc.encode(p, g)) for m, (p, g) in zip(merged, requests))
    worst_bucket = max(_bucket_distance(enc, p, g) for p, g in requests[:8])
    front = enc.stats()["front"]
    print(f"\n{family}: merged vs alone {worst_merge:.2e}, another bucket vs alone {worst_bucket:.2e}, "
          f"{front['requests_per_batch']:.1f} requests per batch")
    assert front["batches"] < len(requests)
    assert worst_merge <= max(2 * worst_bucket, 1e-3), (worst_merge, worst_bucket)
    enc.close()


def test_fp32_merged_requests_equal_each_request_alone_to_1e_5(family):
    enc = make(family_weights(family), dtype=torch.float32)
    rng = random.Random(6)
    requests = [(pixels_for(enc, g, seed=i), g) for i, g in
                enumerate(random_grids(rng, 1, max_frames=2, max_side=12) for _ in range(24))]
    with ThreadPoolExecutor(8) as callers:
        futures = list(callers.map(lambda r: enc.submit(*r), requests))
    worst = max(rel_err(f.result(timeout=120), enc.encode(p, g)) for f, (p, g) in zip(futures, requests))
    print(f"\n{family} fp32: merged vs alone {worst:.2e}")
    assert worst <= 1e-5
    enc.close()


def test_a_nan_request_leaves_the_others_bitwise_in_a_shared_replay(family):
    enc = make(family_weights(family))
    rng = random.Random(7)
    requests = [(pixels_for(enc, g, seed=i), g) for i, g in
                enumerate(random_grids(rng, 1, max_frames=1, max_side=10) for _ in range(5))]

    assert_a_nan_request_leaves_the_others_bitwise(enc, requests, requests[0])
    enc.close()


def test_rows_made_on_a_side_stream_are_read_after_they_are_written():
    enc = make(family_weights("qwen2_vl"))
    grids = [(1, 8, 8)]
    source = pixels_for(enc, grids, seed=1)
    alone = enc.encode(source, grids)
    side = torch.cuda.Stream()
    for _ in range(4):  # one at a time: each goes alone, in the bucket encode() took
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # the rows are written long after submit returns
            rows = source * 1.0
            future = enc.submit(rows, grids)
            del rows
        assert torch.equal(future.result(timeout=60), alone)
    enc.close()


def test_images_through_the_front_equal_encode_images():
    enc = make(family_weights("qwen2_vl"))
    blobs = [jpeg(56 + 28 * (i % 4), 84 + 14 * (i % 3), seed=i) for i in range(24)]
    with ThreadPoolExecutor(12) as callers:
        futures = list(callers.map(lambda b: enc.submit_images([b]), blobs))
    for blob, future in zip(blobs, futures):
        (alone,) = enc.encode_images([blob])
        (got,) = future.result(timeout=120)
        assert got.shape == alone.shape and rel_err(got, alone) <= 2e-2
    assert enc.stats()["front"]["failed"] == 0
    enc.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("vitgraph-")]
