"""The coalescing front (``submit``, ``submit_images``, ``encode_async``): concurrent requests
share encode calls, each answer equals the request made alone, bad, cancelled and failing
requests touch no other, and ``close()`` leaves no thread behind."""

import asyncio
import gc
import io
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor, wait

import pytest
import torch
from helpers import rel_err
from PIL import Image

from vitgraph import GraphedVisionEncoder
from vitgraph.runtime.coalesce import EncoderClosed

GRIDS = [[(1, 8, 8)], [(1, 4, 6), (1, 2, 2)], [(2, 8, 4)], [(1, 10, 10)], [(1, 6, 6)], [(3, 4, 4)], [(1, 12, 8)]]


def front_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("vitgraph-scheduler", "vitgraph-completer",
                                                                    "vitgraph-front"))]


def rows_for(grids, seed, width=1176):
    tokens = sum(t * h * w for t, h, w in grids)
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed))


def jpeg(w, h, seed) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


class SlowEncodes:
    """Holds every batch's encode until released, recording each batch's grids."""

    def __init__(self, encoder):
        self.encoder, self.release, self.batches = encoder, threading.Event(), []
        self.entered = threading.Event()
        self.inner = encoder._encode_checked

    def __call__(self, rows, grids, tokens, out=None, **kw):
        self.batches.append(list(grids))
        self.entered.set()
        assert self.release.wait(30)
        return self.inner(rows, grids, tokens, out, **kw)


@pytest.fixture
def enc():
    encoder = GraphedVisionEncoder.from_config("tiny", device="cpu")
    yield encoder
    encoder.close()


def test_many_threads_share_encode_calls_and_each_answer_equals_the_request_alone(enc):
    requests = [(rows_for(g, seed=i), g) for i, g in enumerate(GRIDS * 6)]
    with ThreadPoolExecutor(16) as callers:
        answers = list(callers.map(lambda r: enc.submit(*r).result(timeout=60), requests))
    for (pixels, grids), answer in zip(requests, answers):
        alone = enc.encode(pixels, grids)
        assert answer.shape == alone.shape
        assert rel_err(answer, alone) <= 1e-5
    front = enc.stats()["front"]
    assert front["requests"] == len(requests) and front["failed"] == 0
    assert front["batches"] < len(requests), front  # requests shared encode calls
    assert front["requests_per_batch"] > 1
    assert front["queue_wait_ms"]["p99"] >= front["queue_wait_ms"]["p50"] >= 0


def test_a_batch_holds_at_most_one_replay_of_tokens_and_frames():
    enc = GraphedVisionEncoder.from_config("tiny", device="cpu", max_budget=256, max_items=4)
    slow = SlowEncodes(enc)
    enc._encode_checked = slow
    try:
        first = enc.submit(rows_for([(1, 8, 8)], 0), [(1, 8, 8)])
        assert slow.entered.wait(30)  # the first batch is held in its encode: the rest queue up
        grids = [[(1, 8, 8)], [(2, 4, 4)], [(1, 8, 16)], [(1, 4, 4)], [(1, 2, 2)], [(1, 2, 2)], [(1, 2, 2)],
                 [(1, 20, 20)]]
        futures = [enc.submit(rows_for(g, i), g) for i, g in enumerate(grids)]
        slow.release.set()
        for future in [first, *futures]:
            future.result(timeout=60)
    finally:
        enc.close()
    assert slow.batches[0] == [(1, 8, 8)]  # an idle encoder takes a lone request at once
    for batch in slow.batches[1:]:
        tokens = sum(t * h * w for t, h, w in batch)
        frames = sum(t for t, _, _ in batch)
        assert (tokens <= 256 and frames <= 4) or len(batch) == 1, slow.batches
    # arrival order is kept, and the 400-token request, larger than a replay, went alone in its turn
    assert [g for batch in slow.batches[1:] for g in batch] == [g for gs in grids for g in gs]
    assert [(1, 20, 20)] in slow.batches


def test_asyncio_forms_equal_the_synchronous_calls(enc):
    images = [jpeg(64 + 8 * i, 48 + 4 * i, seed=i) for i in range(6)]
    clip = [Image.new("RGB", (56, 56), "teal"), Image.new("RGB", (56, 56), "navy")]
    requests = [(rows_for(g, seed=i), g) for i, g in enumerate(GRIDS)]

    async def main():
        rows = [enc.encode_async(p, g) for p, g in requests]
        pictures = [enc.encode_images_async([image]) for image in images]
        both = enc.encode_images_async(images[:2], videos=[clip])
        return await asyncio.gather(*rows), await asyncio.gather(*pictures), await both

    rows, pictures, both = asyncio.run(main())
    for (pixels, grids), answer in zip(requests, rows):
        assert rel_err(answer, enc.encode(pixels, grids)) <= 1e-5
    for image, answer in zip(images, pictures):
        (alone,) = enc.encode_images([image])
        assert len(answer) == 1 and answer[0].shape == alone.shape and rel_err(answer[0], alone) <= 1e-5
    for answer, alone in zip(both, enc.encode_images(images[:2], videos=[clip]), strict=True):
        assert answer.shape == alone.shape and rel_err(answer, alone) <= 1e-5


def test_bad_requests_fail_their_own_futures_with_encodes_errors(enc):
    good = [(rows_for(g, seed=i), g) for i, g in enumerate(GRIDS)]
    bad = [(torch.randn(64, 1000), [(1, 8, 8)]), (torch.randn(64, 1176), [(1, 8, 4)]),
           (torch.randn(64, 1176), [(1, 7, 8)]), (torch.randn(64, 1176).int(), [(1, 8, 8)]),
           ([[0.0] * 1176] * 64, [(1, 8, 8)]), (torch.randn(64, 1176), "grid")]
    futures = []
    for i in range(max(len(good), len(bad))):
        futures += [enc.submit(*good[i]) if i < len(good) else None, enc.submit(*bad[i]) if i < len(bad) else None]
    image_bad = enc.submit_images([b"not an image"])
    image_good = enc.submit_images([jpeg(64, 64, seed=3)])
    for i, (pixels, grids) in enumerate(bad):
        with pytest.raises((TypeError, ValueError)) as direct:
            enc.encode(pixels, grids)
        err = futures[2 * i + 1].exception(timeout=60)
        assert type(err) is type(direct.value) and str(err) == str(direct.value)
    for i, (pixels, grids) in enumerate(good):
        assert rel_err(futures[2 * i].result(timeout=60), enc.encode(pixels, grids)) <= 1e-5
    with pytest.raises(ValueError, match=r"images\[0\]"):
        image_bad.result(timeout=60)
    assert image_good.result(timeout=60)[0].shape[0] > 0
    with pytest.raises(TypeError):
        enc.submit_images([jpeg(64, 64, seed=3)], resize=True)  # an unknown keyword, as encode_images
    assert enc.stats()["front"]["failed"] == len(bad) + 1
    # the front goes on
    pixels, grids = good[0]
    assert rel_err(enc.submit(pixels, grids).result(timeout=60), enc.encode(pixels, grids)) <= 1e-5


def test_empty_requests_resolve_to_empty_rows(enc):
    out = enc.submit(torch.empty(0, 1176), []).result(timeout=60)
    assert out.shape == (0, enc.output_width)
    assert enc.submit_images([]).result(timeout=60) == []


def test_a_cancelled_request_is_dropped_and_the_others_are_encoded(enc):
    slow = SlowEncodes(enc)
    enc._encode_checked = slow
    first = enc.submit(rows_for([(1, 8, 8)], 0), [(1, 8, 8)])
    assert slow.entered.wait(30)
    kept = enc.submit(rows_for([(1, 4, 4)], 1), [(1, 4, 4)])
    dropped = enc.submit(rows_for([(1, 6, 6)], 2), [(1, 6, 6)])
    also = enc.submit(rows_for([(1, 2, 2)], 3), [(1, 2, 2)])
    assert dropped.cancel()
    slow.release.set()
    first.result(timeout=60), kept.result(timeout=60), also.result(timeout=60)
    with pytest.raises(CancelledError):
        dropped.result(timeout=0)
    encoded = [g for batch in slow.batches for g in batch]
    assert (1, 6, 6) not in encoded and (1, 4, 4) in encoded and (1, 2, 2) in encoded
    assert enc.stats()["front"]["cancelled"] == 1


def test_an_exception_in_a_batch_fails_that_batch_only_and_the_front_goes_on(enc):
    inner = enc._encode_checked
    seen = []

    def failing(rows, grids, tokens, out=None, **kw):
        seen.append(list(grids))
        if (1, 6, 6) in grids:
            raise RuntimeError("injected failure")
        return inner(rows, grids, tokens, out, **kw)

    enc._encode_checked = failing
    poisoned = enc.submit(rows_for([(1, 6, 6)], 0), [(1, 6, 6)])
    with pytest.raises(RuntimeError, match="injected"):
        poisoned.result(timeout=60)
    requests = [(rows_for(g, seed=i), g) for i, g in enumerate(GRIDS)]
    with ThreadPoolExecutor(8) as callers:
        futures = list(callers.map(lambda r: enc.submit(*r), requests))
    wait(futures, timeout=60)
    in_failed_batch = {tuple(g) for batch in seen if (1, 6, 6) in batch for g in batch}
    for (pixels, grids), future in zip(requests, futures):
        if tuple(grids)[0] in in_failed_batch:
            assert isinstance(future.exception(timeout=60), RuntimeError)
        else:
            assert rel_err(future.result(timeout=60), enc.encode(pixels, grids)) <= 1e-5
    enc._encode_checked = inner
    pixels, grids = requests[0]
    assert rel_err(enc.submit(pixels, grids).result(timeout=60), enc.encode(pixels, grids)) <= 1e-5


def assert_a_nan_request_leaves_the_others_bitwise(enc, requests, head):
    """``requests`` (five) merged into one batch behind ``head``, first finite, then with NaN and
    inf in the third: the other four answers are the same bits."""

    def batch_of(nan: bool):
        slow = SlowEncodes(enc)
        enc._encode_checked = slow
        first = enc.submit(*head)
        assert slow.entered.wait(30)
        pixels = [p.clone() for p, _ in requests]
        if nan:
            pixels[2][1, 5] = float("nan")
            pixels[2][2, 1] = float("inf")
        futures = [enc.submit(p, g) for p, (_, g) in zip(pixels, requests)]
        slow.release.set()
        first.result(timeout=60)
        answers = [f.result(timeout=60).clone() for f in futures]
        enc._encode_checked = slow.inner
        assert len(slow.batches) == 2, slow.batches  # all five shared one batch
        return answers

    clean, dirty = batch_of(False), batch_of(True)
    assert not torch.isfinite(dirty[2]).all()
    for i in (0, 1, 3, 4):
        assert torch.equal(clean[i], dirty[i]), i


def test_a_nan_request_leaves_the_others_bitwise_as_the_same_batch_without_it(enc):
    requests = [(rows_for(g, seed=i), g) for i, g in enumerate(GRIDS[:5])]
    assert_a_nan_request_leaves_the_others_bitwise(enc, requests, (rows_for([(1, 2, 2)], 99), [(1, 2, 2)]))


def test_close_drains_pending_work_and_joins_every_thread():
    enc = GraphedVisionEncoder.from_config("tiny", device="cpu")
    slow = SlowEncodes(enc)
    enc._encode_checked = slow
    futures = [enc.submit(rows_for(g, seed=i), g) for i, g in enumerate(GRIDS)]
    images = enc.submit_images([jpeg(64, 64, seed=1)])
    assert slow.entered.wait(30)
    threading.Timer(0.2, slow.release.set).start()
    enc.close()  # waits for every submitted request
    assert all(f.done() and f.exception() is None for f in futures + [images])
    assert not front_threads()
    with pytest.raises(EncoderClosed):
        enc.submit(rows_for(GRIDS[0], 0), GRIDS[0])
    assert rel_err(enc.encode(rows_for(GRIDS[0], 0), GRIDS[0]), futures[0].result()) <= 1e-5  # encode still works


def test_close_with_cancel_pending_fails_what_was_not_dispatched():
    with GraphedVisionEncoder.from_config("tiny", device="cpu") as enc:
        slow = SlowEncodes(enc)
        enc._encode_checked = slow
        first = enc.submit(rows_for([(1, 8, 8)], 0), [(1, 8, 8)])
        assert slow.entered.wait(30)
        pending = [enc.submit(rows_for(g, seed=i), g) for i, g in enumerate(GRIDS)]
        images = enc.submit_images([jpeg(64, 64, seed=1)])
        threading.Timer(0.2, slow.release.set).start()
        enc.close(cancel_pending=True)
        assert first.result(timeout=0).shape[0] == 16  # dispatched before close: encoded
        for future in pending + [images]:
            assert isinstance(future.exception(timeout=0), EncoderClosed)
    assert not front_threads()


def test_leaving_the_context_manager_closes_the_front():
    with GraphedVisionEncoder.from_config("tiny", device="cpu") as enc:
        future = enc.submit(rows_for([(1, 8, 8)], 0), [(1, 8, 8)])
        assert front_threads()
    assert future.done() and not front_threads()


def test_a_dropped_encoder_stops_its_threads():
    enc = GraphedVisionEncoder.from_config("tiny", device="cpu")
    assert enc.submit(rows_for([(1, 8, 8)], 0), [(1, 8, 8)]).result(timeout=60).shape[0] == 16
    assert front_threads()
    del enc
    gc.collect()
    deadline = time.monotonic() + 10
    while front_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not front_threads()


def test_max_wait_ms_is_validated():
    for bad in (-1, float("nan"), "2", True, 10**9):
        with pytest.raises(ValueError, match="max_wait_ms"):
            GraphedVisionEncoder.from_config("tiny", device="cpu", max_wait_ms=bad)


def test_a_callers_buffer_may_be_reused_as_soon_as_submit_returns(enc):
    buffer = rows_for([(1, 8, 8)], 1)
    expected = enc.encode(buffer, [(1, 8, 8)])
    slow = SlowEncodes(enc)
    enc._encode_checked = slow
    enc.submit(rows_for([(1, 2, 2)], 0), [(1, 2, 2)])
    assert slow.entered.wait(30)  # the next request waits in the queue while its buffer is overwritten
    future = enc.submit(buffer, [(1, 8, 8)])
    buffer.fill_(float("nan"))
    slow.release.set()
    assert torch.equal(future.result(timeout=60), expected)


def test_close_with_cancel_pending_fails_the_queue_while_images_are_still_prepared(enc, monkeypatch):
    slow = SlowEncodes(enc)
    enc._encode_checked = slow
    first = enc.submit(rows_for([(1, 8, 8)], 0), [(1, 8, 8)])
    assert slow.entered.wait(30)
    inner, started = enc.image_rows, threading.Event()

    def slow_rows(*args, **kwargs):  # an image still decoding when close() begins
        started.set()
        time.sleep(0.5)
        return inner(*args, **kwargs)

    monkeypatch.setattr(enc, "image_rows", slow_rows)
    image = enc.submit_images([jpeg(64, 64, seed=2)])
    assert started.wait(30)
    queued = [enc.submit(rows_for(g, seed=i), g) for i, g in enumerate(GRIDS[:5])]
    threading.Timer(0.1, slow.release.set).start()
    enc.close(cancel_pending=True)
    assert first.result(timeout=0).shape[0] == 16
    for future in queued + [image]:
        assert isinstance(future.exception(timeout=0), EncoderClosed)
    assert slow.batches == [[(1, 8, 8)]]  # nothing queued was encoded
    assert enc.stats()["front"]["failed"] == 6 and not front_threads()


def test_stats_before_any_request_have_every_key(enc):
    idle = enc.stats()["front"]
    enc.submit(rows_for([(1, 8, 8)], 0), [(1, 8, 8)]).result(timeout=60)
    assert set(idle) == set(enc.stats()["front"]) and idle["requests"] == 0

