"""CUDA-graph capture and replay over a bank of buckets. Knows nothing of Qwen.

The model contract it uses: ``model.input_width``, ``model.merge_unit``,
``model.build_batch(grids, num_tokens=, num_segments=, max_seqlen=)`` and
``model(pixels, batch)``.

Static buffers are sized to the largest bucket and every bucket reads a prefix
view of them; all graphs share one memory pool, captured largest first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .planner import Bucket

logger = logging.getLogger(__name__)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


@dataclass
class CapturedGraph:
    bucket: Bucket
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # lives in the pool; [bucket.tokens / merge_unit, hidden]


class GraphBank:
    """Static buffers plus one captured graph per bucket."""

    def __init__(self, model: torch.nn.Module, buckets: Sequence[Bucket], device: torch.device,
                 dtype: torch.dtype) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.device = device
        self.dtype = dtype
        self.requested = sorted(buckets)
        self.graphs: dict[Bucket, CapturedGraph] = {}
        self.dropped: dict[Bucket, str] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        largest = self.requested[-1]
        max_segments = max(b.max_segments for b in self.requested)
        self.static_pixels = torch.zeros(largest.tokens, model.input_width, device=device, dtype=dtype)
        host = model.build_batch([], num_tokens=largest.tokens, num_segments=max_segments)
        self.static_batch = host.to(device)
        self._views = {b: self._view(b) for b in self.requested}

    @property
    def buckets(self) -> list[Bucket]:
        return sorted(self.graphs)

    def _view(self, bucket: Bucket):
        """The static metadata as ``bucket`` sees it: each tensor a prefix of the largest
        bucket's buffer, as long as the model's own layout for this bucket says."""
        layout = self.model.build_batch([], num_tokens=bucket.tokens, num_segments=bucket.max_segments,
                                        max_seqlen=bucket.max_seqlen)
        prefixes = {name: getattr(self.static_batch, name)[:t.shape[0]] for name, t in layout.tensors().items()}
        return replace(layout, **prefixes)

    def batch_view(self, bucket: Bucket):
        return self._views[bucket]

    def pixels_view(self, bucket: Bucket) -> torch.Tensor:
        return self.static_pixels[:bucket.tokens]

    def load(self, bucket: Bucket, pixels: torch.Tensor, host_batch) -> None:
        """Copy one step's inputs into the static buffers (rows past ``pixels`` keep stale values:
        they lie outside every segment, so they are never read into a real row)."""
        self.static_pixels[:pixels.shape[0]].copy_(pixels, non_blocking=True)
        view = self.batch_view(bucket)
        for name, src in host_batch.tensors().items():
            getattr(view, name).copy_(src, non_blocking=True)

    def run_eager(self, bucket: Bucket) -> torch.Tensor:
        """The same forward the graph holds, run eagerly on the static buffers (for tests)."""
        with torch.inference_mode():
            return self.model(self.pixels_view(bucket), self.batch_view(bucket))

    def capture(self, *, pool_limit_bytes: int | None = None, progress: bool = True) -> None:
        """Capture every requested bucket, largest first, into one shared pool."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool = None
        todo = [b for b in reversed(self.requested) if b not in self.graphs]
        for bucket in tqdm(todo, desc="capturing CUDA graphs", unit="graph", disable=not progress):
            # Valid (empty) metadata for warm-up and capture; kernels read the real one at replay.
            self.load(bucket, self.static_pixels[:0],
                      self.model.build_batch([], num_tokens=bucket.tokens, num_segments=bucket.max_segments))
            try:
                captured = self._capture_one(bucket, pool)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
                if not _is_oom(err):
                    raise
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                self.dropped[bucket] = "out of memory"
                logger.warning("vitgraph: out of memory capturing bucket %s; it is skipped", bucket.name)
                continue
            used = torch.cuda.memory_reserved(self.device) - reserved_before
            if pool_limit_bytes is not None and used > pool_limit_bytes:
                del captured
                self.dropped[bucket] = f"pool would use {used} bytes > limit {pool_limit_bytes}"
                logger.warning("vitgraph: bucket %s would grow the pool to %d bytes (limit %d); skipped",
                               bucket.name, used, pool_limit_bytes)
                if not self.graphs:
                    pool = None
                torch.cuda.empty_cache()
                continue
            self.graphs[bucket] = captured
            if pool is None:
                pool = captured.graph.pool()
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        self.capture_seconds += time.perf_counter() - start
        logger.info("vitgraph: captured %d CUDA graph(s) (%s, tokens x segments), pool %.1f MiB, %.2f s",
                    len(self.graphs), ",".join(b.name for b in self.buckets),
                    self.pool_bytes / 2**20, self.capture_seconds)

    def _capture_one(self, bucket: Bucket, pool) -> CapturedGraph:
        pixels, batch = self.pixels_view(bucket), self.batch_view(bucket)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode():
            with torch.cuda.stream(side):  # warm-up: kernel selection and workspaces, off the capture
                self.model(pixels, batch)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self.model(pixels, batch)
        return CapturedGraph(bucket, graph, output)

    def replay(self, bucket: Bucket) -> torch.Tensor:
        """Replay on the current stream; returns the graph's static output (copy it before the next replay)."""
        captured = self.graphs[bucket]
        captured.graph.replay()
        return captured.output
