"""CUDA-graph capture and replay over a bank of buckets. Knows nothing of Qwen.

The run side of plan/run: the caller plans on the host (which bucket, the metadata laid out
for it: :func:`vitgraph.engine.planner.padded_batch`) and hands the bank each bucket's empty
layout at construction and a step's staged metadata at :meth:`GraphBank.load`; the bank only
captures, loads and replays, calling the model's forward (and ``warm_up``) and nothing else of
it. It reads ``model.input_width``, ``model.output_width`` and ``model.merge_unit``.

Static buffers: pixel rows sized to the largest bucket (each bucket reads a prefix),
and one flat int32 metadata buffer in which each bucket's tensors lie back to back,
so a replay's metadata arrives in one host-to-device copy from a pinned staging
buffer, which each graph makes itself as its first node. All graphs share one memory
pool, captured largest first; the first capture reserves one segment the size of a
forward's activation peak, so the pool stays near that peak instead of keeping a
segment per tensor size.

Every address a graph bakes in is memory the bank owns: its static buffers, its pool,
and the workspaces cuBLAS keeps per (handle, stream). The last are torch's, and torch
frees them process-wide (``torch._C._cuda_clearCublasWorkspaces``, which torch.compile's
CUDA-graph trees call around every recording); a workspace outside the pool would then be
handed to other tensors while the graphs still write to it. So warm-ups run on the
caller's stream, and the bank's capture stream is used by captures alone: its workspaces
are allocated inside the pool (first by a small primer graph, before the arena), where
freeing them returns them to memory only this bank's captures draw from. That stream is
created for the bank (:func:`vitgraph.engine.streams.own_stream`), not taken from torch's
pool of streams, which hands the same few out again: a pooled stream may come with the
workspace a caller or an earlier bank left on it, outside this pool.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np
import torch
from tqdm.auto import tqdm

from .contract import BatchLayout, VisionTower
from .planner import Bucket
from .streams import own_stream

logger = logging.getLogger(__name__)


ARENA_ALIGN = 2 << 20  # the caching allocator rounds large segments to 2 MiB
ARENA_MARGIN = 16  # the pool's first segment is the forward's peak plus 1/16


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _arena_usable() -> bool:
    """The caching allocator splits large free blocks (no ``max_split_size_mb``), so one
    big segment can serve many allocations."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "max_split_size" not in conf and torch.cuda.get_allocator_backend() == "native"


def _external_event() -> torch.cuda.Event | None:
    """An event a captured graph can record as a node of its own (torch >= 2.8), else None."""
    try:
        return torch.cuda.Event(external=True)
    except TypeError:
        return None


def _int32_layout(layout: BatchLayout) -> BatchLayout:
    for name, t in layout.tensors().items():
        if t.dtype != torch.int32:
            raise TypeError(f"the graph engine stages int32 metadata; {name} is {t.dtype}")
    return layout


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


@dataclass
class CapturedGraph:
    bucket: Bucket
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # a prefix of the bank's static output: [bucket.tokens / merge_unit, hidden]


class GraphBank:
    """Static buffers plus one captured graph per bucket."""

    def __init__(self, model: VisionTower, layouts: Mapping[Bucket, BatchLayout], device: torch.device,
                 dtype: torch.dtype) -> None:
        """``layouts``: each bucket's empty padded layout (valid metadata for warm-up and capture;
        :func:`vitgraph.engine.planner.padded_batch` with no grids)."""
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.device = device
        self.dtype = dtype
        self.requested = sorted(layouts)
        self.graphs: dict[Bucket, CapturedGraph] = {}
        self.dropped: dict[Bucket, str] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        largest = self.requested[-1]
        self.static_pixels = torch.zeros(largest.tokens, model.input_width, device=device, dtype=dtype)
        # Every graph copies its result here, so no graph keeps its own output alive in the pool.
        self.static_output = torch.zeros(largest.tokens // model.merge_unit, model.output_width, device=device,
                                         dtype=dtype)
        self._layouts = {b: _int32_layout(layouts[b]) for b in self.requested}
        sizes = {b: sum(t.numel() for t in layout.tensors().values()) for b, layout in self._layouts.items()}
        size = max(sizes.values())
        self.static_meta = torch.zeros(size, device=device, dtype=torch.int32)
        self._staging = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self._staging_np = self._staging.numpy()
        # Recorded after each copy out of the staging buffer. Where torch can record an event
        # inside a graph, each graph copies its metadata from the staging buffer itself: a
        # host op fewer before every replay, on hosts where each costs measurable time (benchmarks/HISTORY.md).
        external = _external_event()
        self.copies_metadata_in_graph = external is not None
        self._staged = external or torch.cuda.Event()
        self._views = {b: self._carve(layout, self.static_meta) for b, layout in self._layouts.items()}
        # Per bucket: (device metadata, pinned staging, its numpy view), sliced once: slicing
        # tensors on every call is measurable host time.
        self._meta_copy = {b: (self.static_meta[:n], self._staging[:n], self._staging_np[:n])
                           for b, n in sizes.items()}
        # Used by captures alone, so that the workspaces cuBLAS keeps for it live in the pool
        # (see the module doc). Warm-ups run on the caller's stream.
        self._capture_stream = own_stream(device)
        self._primer: tuple | None = None  # (graph, its tensors): owns the pool before any bucket
        self.workspace_bytes = 0  # the pool's bytes that hold library workspaces, not activations

    @property
    def buckets(self) -> list[Bucket]:
        return sorted(self.graphs)

    @property
    def uncaptured(self) -> list[Bucket]:
        """Requested buckets with no graph yet (never captured, or dropped), largest first."""
        return [b for b in reversed(self.requested) if b not in self.graphs]

    @staticmethod
    def _carve(layout, flat: torch.Tensor):
        """``layout`` with each tensor replaced by a view of ``flat``, back to back in field order."""
        views, offset = {}, 0
        for name, t in layout.tensors().items():
            views[name] = flat[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
        return replace(layout, **views)

    def batch_view(self, bucket: Bucket):
        return self._views[bucket]

    def pixels_view(self, bucket: Bucket) -> torch.Tensor:
        return self.static_pixels[:bucket.tokens]

    @staticmethod
    def stage(host_batch) -> np.ndarray:
        """A host batch (built for some bucket's layout) as the flat int32 array :meth:`load`
        copies: its tensors back to back in field order. Callers may cache it per plan."""
        return np.concatenate([t.numpy().reshape(-1) for t in host_batch.tensors().values()])

    def load(self, bucket: Bucket, pixels: torch.Tensor, staged: np.ndarray, *, replay: bool = False) -> None:
        """Copy one step's inputs into the static buffers, on the current stream (rows past
        ``pixels`` keep stale values: they lie outside every segment, so no real row reads them).
        ``staged``: :meth:`stage` of a batch built for ``bucket``'s layout. ``replay``: a replay
        of ``bucket`` follows at once, so where the graphs copy their metadata themselves only
        the pixels are copied here and the metadata staged."""
        copy_metadata = not (replay and self.copies_metadata_in_graph)
        meta, pinned, pinned_np = self._meta_copy[bucket]
        if staged.shape != pinned_np.shape:
            raise ValueError(f"staged metadata has {staged.shape[0]} values; bucket {bucket.name} takes "
                             f"{pinned_np.shape[0]}")
        self.static_pixels[:pixels.shape[0]].copy_(pixels, non_blocking=True)
        self._staged.synchronize()  # the previous copy (a graph's, or one made here) has left the staging buffer
        pinned_np[:] = staged
        if copy_metadata:
            meta.copy_(pinned, non_blocking=True)
            self._staged.record()

    def capture(self, *, pool_limit_bytes: int | None = None, progress: bool = True) -> None:
        """Capture every requested bucket, largest first, into one shared pool."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # cached free blocks would hide the pool's growth from the limit check
        reserved_before = torch.cuda.memory_reserved(self.device)
        for bucket in tqdm(self.uncaptured, desc="capturing CUDA graphs", unit="graph", disable=not progress):
            pool = self._pool()
            # Valid (empty) metadata for warm-up and capture; kernels read the real one at replay.
            self.load(bucket, self.static_pixels[:0], self.stage(self._layouts[bucket]))
            try:
                captured = self._capture_one(bucket, pool, first=not self.graphs)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
                if not _is_oom(err):
                    raise
                self._drop(bucket, "out of memory")
                logger.warning("vitgraph: out of memory capturing bucket %s; it is skipped", bucket.name)
                continue
            torch.cuda.empty_cache()  # release the warm-up's blocks: what stays reserved is the pool
            used = torch.cuda.memory_reserved(self.device) - reserved_before
            if pool_limit_bytes is not None and used > pool_limit_bytes:
                del captured
                self._drop(bucket, f"pool would use {used} bytes > limit {pool_limit_bytes}")
                logger.warning("vitgraph: bucket %s would grow the pool to %d bytes (limit %d); skipped",
                               bucket.name, used, pool_limit_bytes)
                continue
            self.graphs[bucket] = captured
        torch.cuda.synchronize(self.device)
        pool = self._primer[0].pool() if self._primer is not None else None
        self.pool_bytes = self._pool_segment_bytes(pool)
        if self.pool_bytes is None:
            self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        self.capture_seconds += time.perf_counter() - start
        logger.info("vitgraph: captured %d CUDA graph(s) (%s, tokens x segments), pool %.1f MiB "
                    "(%.1f MiB of it library workspaces), %.2f s", len(self.graphs),
                    ",".join(b.name for b in self.buckets), self.pool_bytes / 2**20, self.workspace_bytes / 2**20,
                    self.capture_seconds)

    def _drop(self, bucket: Bucket, why: str) -> None:
        self.dropped[bucket] = why
        if not self.graphs:  # a fresh pool for the next try: the first capture reserves the arena in it
            self._primer = None
            self.workspace_bytes = 0
            # and a fresh stream: cuBLAS would hand the old one its workspace, in the pool let go
            self._capture_stream = own_stream(self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def _pool(self):
        """The graphs' pool, made by a primer graph whose GEMMs allocate the capture stream's
        cuBLAS and cuBLASLt workspaces inside it, ahead of the arena (module doc)."""
        if self._primer is None:
            a = torch.zeros(64, 64, device=self.device, dtype=self.dtype)
            bias, out = torch.zeros(64, device=self.device, dtype=self.dtype), torch.empty_like(a)
            graph = torch.cuda.CUDAGraph()
            stream = self._capture_stream

            def gemms():
                torch.mm(a, a, out=out)
                torch.addmm(bias, a, a, out=out)  # a bias epilogue: cuBLASLt's path

            with torch.inference_mode():
                gemms()  # on the caller's stream: the handles exist before the capture
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.graph(graph, stream=stream):
                    gemms()
            self._primer = (graph, a, bias, out)
            self.workspace_bytes = self._pool_segment_bytes(graph.pool()) or 0
        return self._primer[0].pool()

    def _pool_segment_bytes(self, pool) -> int | None:
        """Bytes of the device segments that belong to the graphs' private pool (None if unknown)."""
        if pool is None:
            return 0
        try:
            segments = torch.cuda.memory_snapshot()
            total = sum(s["total_size"] for s in segments
                        if s.get("device") == self.device.index and tuple(s.get("segment_pool_id", ())) == tuple(pool))
        except (RuntimeError, KeyError, TypeError):
            return None
        return total or None

    def _capture_one(self, bucket: Bucket, pool, first: bool) -> CapturedGraph:
        pixels, batch = self.pixels_view(bucket), self.batch_view(bucket)
        stream = self._capture_stream
        with torch.inference_mode():
            # Warm-up on the caller's stream: kernel selection, JIT and library plans, off the capture.
            if first and _arena_usable():
                peak = self.activation_peak(bucket)  # warms up too
                # A margin for the holes short-lived temporaries leave between long-lived tensors.
                arena = _round_up(peak + peak // ARENA_MARGIN, ARENA_ALIGN)
            else:
                self._warm_up(pixels, batch)
                arena = 0
            stream.wait_stream(torch.cuda.current_stream(self.device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                if arena:
                    # One segment as large as the forward's peak, freed at once: every later
                    # allocation of every capture is split from it. Without it the pool keeps
                    # a segment per size the first forward allocated (x, qkv, fc1 out, ...),
                    # since a block never spans segments: well above the peak (benchmarks/HISTORY.md).
                    torch.empty(arena, dtype=torch.uint8, device=self.device)
                if self.copies_metadata_in_graph:
                    meta, pinned, _ = self._meta_copy[bucket]
                    meta.copy_(pinned, non_blocking=True)  # reads the staging buffer at each replay
                    self._staged.record(stream)  # an event node: the host reuses the buffer after it
                result = self.model(pixels, batch)
                output = self.static_output[:result.shape[0]]
                output.copy_(result)
                del result  # back to the pool for the next capture
        return CapturedGraph(bucket, graph, output)

    def _warm_up(self, pixels: torch.Tensor, batch) -> None:
        """Run every kernel the forward runs once, off the capture: JIT compiles, kernel
        selection, library plans and workspaces; through the tower's warm-up (one block of each
        kind: the same kernels at the same shapes) where it has one."""
        (getattr(self.model, "warm_up", None) or self.model)(pixels, batch)

    def activation_peak(self, bucket: Bucket) -> int:
        """Bytes one eager forward of ``bucket`` allocates at its peak, on the static buffers and
        the current stream, measured after a first forward has warmed up kernels and library
        workspaces (which are not activations). Resets the device's peak-memory statistics."""
        pixels, batch = self.pixels_view(bucket), self.batch_view(bucket)
        stream = torch.cuda.current_stream(self.device)
        with torch.inference_mode():
            self._warm_up(pixels, batch)
            stream.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            self.model(pixels, batch)
            stream.synchronize()
        return torch.cuda.max_memory_allocated(self.device) - base

    def time_replay(self, bucket: Bucket, staged: np.ndarray, reps: int = 2) -> float:
        """GPU milliseconds of one replay of ``bucket`` holding the ``staged`` metadata (the least
        of ``reps`` replays, timed by CUDA events). The pixel rows are whatever the static buffer
        holds: the work does not depend on their values. Overwrites the static output."""
        self.load(bucket, self.static_pixels[:0], staged)
        stream = torch.cuda.current_stream(self.device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self.graphs[bucket].graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        return min(times)

    def replay(self, bucket: Bucket) -> torch.Tensor:
        """Replay on the current stream; returns the graph's static output (copy it before the next replay)."""
        captured = self.graphs[bucket]
        captured.graph.replay()
        return captured.output
