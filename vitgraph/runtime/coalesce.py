"""The coalescing front: concurrent callers share replays (``submit``, ``submit_images`` and
their asyncio forms on :class:`vitgraph.runtime.encoder.GraphedVisionEncoder`).

A request is ready once its rows are on the encoder's device in its dtype: ``submit``
validates and normalises them on the caller's thread; ``submit_images`` decodes and
preprocesses in the front's thread pool, so host work for the next batch overlaps the
replay in flight. One scheduler thread takes ready requests in arrival order into a batch
that fits one replay of the largest bucket (its tokens and frames), and dispatches it when
the device is idle, when the batch is full, or when its oldest request has waited
``max_wait_ms``, with at most two batches in flight (one running, one staged behind it). A
request whose own plan is not one replay (larger than a bucket, or a frame that runs
eagerly at its exact shape) goes alone, in its turn: nothing is held back behind smaller
requests, and no item is split by merging. A completer thread waits for each batch on the
device and resolves its futures with views of the batch's output, complete when resolved.

A bad request fails its own future with the ``ValueError``/``TypeError`` ``encode`` raises;
an exception in a batch's encode fails that batch's futures only; a cancelled future is
dropped before it is dispatched. The threads hold the encoder weakly: dropping the encoder
without ``close()`` stops them too.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .validation import check_finite_rows, check_pixels, check_rows, normalize_grid

MAX_IN_FLIGHT = 2  # batches dispatched and not yet complete: one running, one staged behind it
FRONT_THREADS = 2  # preprocessing threads by default: more starve the scheduler of Python's lock (HISTORY 59)
_STOP = object()


class EncoderClosed(RuntimeError):
    """The encoder's front was closed before the request could be encoded."""


@dataclass(eq=False)
class _Request:
    rows: torch.Tensor  # [tokens, input_width], the encoder's dtype, on its device
    grids: list
    tokens: int
    segments: int
    alone: bool  # its own plan is not one replay: never merged
    future: Future
    finish: Callable[[torch.Tensor], Any]  # its output rows -> the future's result
    ready: torch.cuda.Event | None  # recorded on the stream that made ``rows``
    stream: torch.cuda.Stream | None
    ready_at: float = field(default_factory=time.perf_counter)


@dataclass
class _Counters:
    requests: int = 0
    failed: int = 0
    cancelled: int = 0
    batches: int = 0
    batched_requests: int = 0
    alone: int = 0  # requests larger than one replay, each sent alone
    waits_ms: deque = field(default_factory=lambda: deque(maxlen=100_000))

    def report(self, queued: int, in_flight: int, settings: dict[str, Any]) -> dict[str, Any]:
        """``stats()["front"]``: these counts, the queue and the settings."""
        waits = np.asarray(self.waits_ms, dtype=np.float64)
        return {"requests": self.requests, "batches": self.batches, "alone": self.alone, "failed": self.failed,
                "cancelled": self.cancelled,
                "requests_per_batch": self.batched_requests / self.batches if self.batches else 0.0,
                "queue_wait_ms": {"p50": float(np.percentile(waits, 50)) if waits.size else 0.0,
                                  "p99": float(np.percentile(waits, 99)) if waits.size else 0.0},
                "queued": queued, "in_flight": in_flight, **settings}


def front_settings(encoder) -> dict[str, Any]:
    """What bounds a batch: the wait, and one replay of the largest bucket (its tokens and
    frames; an eager encoder: its options' ``max_budget`` and ``max_items``)."""
    buckets = encoder.buckets
    return {"max_wait_ms": encoder.options.max_wait_ms,
            "max_tokens": max((b.tokens for b in buckets), default=encoder.options.max_budget),
            "max_frames": max((b.max_segments for b in buckets), default=encoder.options.max_items),
            "max_in_flight": MAX_IN_FLIGHT,
            "front_threads": encoder.options.front_threads or min(FRONT_THREADS, os.cpu_count() or 1)}


def idle_front_stats(encoder) -> dict[str, Any]:
    """``stats()["front"]`` of an encoder nobody has submitted to yet."""
    return _Counters().report(0, 0, front_settings(encoder))


class CoalescingFront:
    """The scheduler of one encoder. Made by the encoder on first use; ``close()`` stops it."""

    def __init__(self, encoder) -> None:
        self._encoder = weakref.ref(encoder)
        self.refresh(encoder)
        self.device = encoder.device
        self.merge_unit = encoder.tower.merge_unit
        self._queue: deque[_Request] = deque()
        self._cv = threading.Condition()
        self._in_flight = 0
        self._accepting = True  # submit() takes requests
        self._cancelling = False  # close(cancel_pending=True): what is not dispatched fails
        self._stopping = False  # the scheduler ends once the queue is empty
        self._counters = _Counters()
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (batch, output, event) to resolve
        self._pool = ThreadPoolExecutor(max_workers=self._settings["front_threads"], thread_name_prefix="vitgraph-front")
        self._scheduler = threading.Thread(target=self._schedule, name="vitgraph-scheduler", daemon=True)
        self._completer = threading.Thread(target=self._complete, name="vitgraph-completer", daemon=True)
        self._scheduler.start()
        self._completer.start()
        # Dropping the encoder without close() stops the threads (they hold it weakly).
        weakref.finalize(encoder, CoalescingFront._abandon, weakref.ref(self))

    def refresh(self, encoder) -> None:
        """Take the encoder's limits anew (its buckets changed: a capture)."""
        self._settings = front_settings(encoder)
        self.max_wait_ms = self._settings["max_wait_ms"]
        self.max_tokens, self.max_frames = self._settings["max_tokens"], self._settings["max_frames"]

    # -- requests in --------------------------------------------------------------------

    def submit(self, pixels, grid_thw, check_finite: bool = False) -> Future:
        """A future of ``encode(pixels, grid_thw)``; a bad request fails it at once."""
        future = self._future()
        encoder = self._encoder()
        try:
            check_pixels(pixels, encoder.tower.input_width)
            grids = normalize_grid(grid_thw, encoder.shape.spatial_merge_size)
            tokens = check_rows(pixels, grids)
            check_finite_rows(pixels, grids, check_finite)
            with torch.inference_mode():
                if pixels.device.type == "cpu" and encoder.device.type == "cuda" and pixels.is_pinned():
                    pixels = pixels.to(encoder.device)  # a synchronous copy: the caller may reuse its buffer
                rows = encoder.normalized_rows(pixels)
                if rows.data_ptr() == pixels.data_ptr() and tokens:  # the caller may reuse its buffer at once
                    rows = rows.clone()
            self._enqueue(encoder, rows, grids, tokens, future, lambda out: out)
        except Exception as err:  # the caller's error, on its own future
            self._fail([future], err)
        return future

    def submit_images(self, images, videos, kwargs: dict) -> Future:
        """A future of ``encode_images(images, videos, **kwargs)``, prepared in the front's pool."""
        future = self._future()
        try:
            self._pool.submit(self._prepare_images, images, videos, kwargs, future)
        except RuntimeError:  # close() shut the pool down since the check
            self._fail([future], EncoderClosed("the encoder was closed before this request was queued"))
        return future

    def _prepare_images(self, images, videos, kwargs: dict, future: Future) -> None:
        try:
            if future.cancelled():
                return
            if self._cancelling:
                raise EncoderClosed("the encoder was closed before this request was encoded")
            encoder = self._encoder()
            if encoder is None:
                raise EncoderClosed("the encoder was garbage-collected before this request was encoded")
            with torch.inference_mode():
                rows, grid = encoder.encodable_rows(images, videos, **kwargs)
            grids = [tuple(g) for g in grid.tolist()]
            self._enqueue(encoder, rows, grids, rows.shape[0], future, lambda out: encoder.per_item(out, grids))
        except Exception as err:
            self._fail([future], err)

    def _future(self) -> Future:
        with self._cv:
            if not self._accepting:
                raise EncoderClosed("the encoder is closed: it takes no more requests")
            self._counters.requests += 1
        return Future()

    def _enqueue(self, encoder, rows: torch.Tensor, grids: list, tokens: int, future: Future, finish) -> None:
        if tokens == 0:  # nothing to encode: the empty result, now
            if future.set_running_or_notify_cancel():
                future.set_result(finish(encoder._encode_checked(rows, grids, 0)))
            return
        ready = stream = None
        if rows.is_cuda:  # the scheduler's stream waits for the stream that made the rows
            stream = torch.cuda.current_stream(rows.device)
            ready = torch.cuda.Event()
            ready.record(stream)
        segments = sum(t for t, _, _ in grids)
        alone = not self._one_replay(encoder, grids, tokens, segments)
        request = _Request(rows, grids, tokens, segments, alone, future, finish, ready, stream)
        with self._cv:
            if self._stopping or self._cancelling:
                raise EncoderClosed("the encoder was closed before this request was encoded")
            self._queue.append(request)
            self._cv.notify()

    def _one_replay(self, encoder, grids: list, tokens: int, segments: int) -> bool:
        if tokens > self.max_tokens or segments > self.max_frames:
            return False
        if not encoder.use_graphs:
            return True
        steps = encoder._prepare(grids).plan.steps  # cached per request's grids
        return len(steps) == 1 and steps[0].bucket is not None

    # -- the scheduler --------------------------------------------------------------------

    def _schedule(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._queue:
                        wait = self._wait_s()
                        if wait <= 0:
                            break
                    elif self._stopping:
                        self._done.put(_STOP)
                        return
                    else:
                        wait = None
                    self._cv.wait(wait)
                batch = self._take()
                self._in_flight += bool(batch)
            if batch:
                self._dispatch(batch)

    def _wait_s(self) -> float:
        """Seconds until the queue's head may go (0: now). Under the lock."""
        if self._in_flight >= MAX_IN_FLIGHT:
            return 3600.0  # the completer notifies
        if self._in_flight == 0 or self._stopping or self._full():
            return 0.0
        return self._queue[0].ready_at + self.max_wait_ms / 1000 - time.perf_counter()

    def _full(self) -> bool:
        """Whether the queue holds a whole batch: its head and the requests that fit after it
        are followed by one that does not fit."""
        tokens = frames = 0
        for request in self._queue:
            if request.alone or not self._fits(tokens, frames, request):
                return True
            tokens, frames = tokens + request.tokens, frames + request.segments
        return False

    def _fits(self, tokens: int, frames: int, request: _Request) -> bool:
        return tokens + request.tokens <= self.max_tokens and frames + request.segments <= self.max_frames

    def _take(self) -> list[_Request]:
        """The next batch, in arrival order: the head alone if it goes alone, else the head and
        the requests after it while they fit; cancelled ones dropped. Under the lock."""
        batch: list[_Request] = []
        tokens = frames = 0
        now = time.perf_counter()
        while self._queue and not self._cancelling:
            request = self._queue[0]
            if batch and (request.alone or not self._fits(tokens, frames, request)):
                break
            self._queue.popleft()
            if not request.future.set_running_or_notify_cancel():
                self._counters.cancelled += 1
                continue
            self._counters.waits_ms.append((now - request.ready_at) * 1000)
            batch.append(request)
            tokens, frames = tokens + request.tokens, frames + request.segments
            if request.alone:
                self._counters.alone += 1
                break
        return batch

    def _dispatch(self, batch: list[_Request]) -> None:
        """One encode call for the batch, queued on the device; the completer resolves it."""
        encoder = self._encoder()
        try:
            if encoder is None:
                raise EncoderClosed("the encoder was garbage-collected before this request was encoded")
            with torch.inference_mode():
                stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
                for request in batch:
                    if request.ready is not None:
                        stream.wait_event(request.ready)
                        if request.stream != stream:  # the allocator must not reuse the rows early
                            request.rows.record_stream(stream)
                rows = batch[0].rows if len(batch) == 1 else torch.cat([r.rows for r in batch])
                grids = [g for r in batch for g in r.grids]
                output = encoder._encode_checked(rows, grids, rows.shape[0], cache_plan=len(batch) == 1)
                done = None
                if stream is not None:
                    done = torch.cuda.Event(blocking=True)  # the completer sleeps on it, not spins
                    done.record(stream)
        except Exception as err:
            self._fail([r.future for r in batch], err)
            self._finished()
            return
        finally:
            del encoder
        with self._cv:
            self._counters.batches += 1
            self._counters.batched_requests += len(batch)
        self._done.put((batch, output, done))

    # -- the completer --------------------------------------------------------------------

    def _complete(self) -> None:
        while True:
            item = self._done.get()
            if item is _STOP:
                return
            batch, output, done = item
            done_stream = torch.cuda.current_stream(self.device) if done is not None else None
            try:
                if done is not None:
                    done.synchronize()
                parts = output.split([r.tokens // self.merge_unit for r in batch])
                for request, rows in zip(batch, parts):
                    if request.stream is not None and request.stream != done_stream:
                        output.record_stream(request.stream)  # read there: not reused before it is
                    request.future.set_result(request.finish(rows))
            except Exception as err:  # a device error surfaces here
                self._fail([r.future for r in batch if not r.future.done()], err)
            self._finished()

    def _finished(self) -> None:
        with self._cv:
            self._in_flight -= 1
            self._cv.notify_all()

    def _fail(self, futures: list[Future], err: BaseException) -> None:
        failed = cancelled = 0
        for future in futures:
            if future.done():
                continue
            if not future.running() and not future.set_running_or_notify_cancel():
                cancelled += 1
                continue
            future.set_exception(err)
            failed += 1
        with self._cv:
            self._counters.failed += failed
            self._counters.cancelled += cancelled

    # -- stopping and stats --------------------------------------------------------------

    def close(self, cancel_pending: bool = False) -> None:
        """Stop taking requests, then encode every request already submitted (or, with
        ``cancel_pending``, fail those not yet dispatched with :class:`EncoderClosed`), and join
        every thread of the front. Idempotent."""
        with self._cv:
            self._accepting = False
            self._cancelling = self._cancelling or cancel_pending
            dropped = self._drain_queue() if self._cancelling else []
        self._fail(dropped, EncoderClosed("the encoder was closed before this request was encoded"))
        # Preparations finish (or fail, cancelling) and queue; a pool thread cannot wait for itself.
        self._pool.shutdown(wait=not threading.current_thread().name.startswith("vitgraph-front"))
        with self._cv:
            self._stopping = True
            dropped = self._drain_queue() if self._cancelling else []
            self._cv.notify_all()
        self._fail(dropped, EncoderClosed("the encoder was closed before this request was encoded"))
        if threading.current_thread() not in (self._scheduler, self._completer):
            self._scheduler.join()
            self._completer.join()

    def _drain_queue(self) -> list[Future]:
        """The queued requests' futures, the queue emptied. Under the lock."""
        futures = [r.future for r in self._queue]
        self._queue.clear()
        return futures

    @staticmethod
    def _abandon(front_ref) -> None:
        """The encoder was collected: fail what waits and let the threads end (no join: this
        may run on one of them)."""
        front = front_ref()
        if front is None:
            return
        with front._cv:
            front._accepting, front._cancelling, front._stopping = False, True, True
            dropped = front._drain_queue()
            front._cv.notify_all()
        front._pool.shutdown(wait=False)
        front._fail(dropped, EncoderClosed("the encoder was garbage-collected"))

    @property
    def closed(self) -> bool:
        return not self._accepting

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return self._counters.report(len(self._queue), self._in_flight, self.settings())

    def settings(self) -> dict[str, Any]:
        return dict(self._settings)
