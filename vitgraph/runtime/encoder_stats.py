"""What ``GraphedVisionEncoder.stats()`` reports: replays and padding per bucket, eager
fallbacks, capture time, pool bytes, the plan cache and the coalescing front."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from .coalesce import idle_front_stats


@dataclass
class BucketStats:
    replays: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0


@dataclass
class Counters:
    buckets: dict[str, BucketStats] = field(default_factory=dict)  # by bucket name
    eager: Counter = field(default_factory=Counter)
    calls: int = 0


def encoder_stats(encoder) -> dict[str, Any]:
    """What ``encoder.stats()`` returns."""
    with encoder._lock:
        buckets = {
            b.name: {"tokens": b.tokens, "max_segments": b.max_segments, "max_seqlen": b.max_seqlen,
                     **vars(encoder._counters.buckets.get(b.name, BucketStats()))}
            for b in encoder.buckets
        }
        front = encoder._front
        result = {
            "device": str(encoder.device),
            "dtype": str(encoder.dtype).replace("torch.", ""),
            "attention": encoder.attention,
            "fused": encoder.tower.fused,
            "gemm": encoder.gemm if encoder.device.type == "cuda" else "torch",  # the CPU's own matmul
            "precision": encoder.options.precision,  # the blocks' GEMMs: "bf16" (the weights' dtype) or "fp8"
            "mode": "graph" if encoder.use_graphs else "eager",
            "calls": encoder._counters.calls,
            "buckets": buckets,
            "dropped_buckets": {b.name: why for b, why in (encoder.bank.dropped.items() if encoder.bank else [])},
            "eager_fallbacks": dict(encoder._counters.eager),
            "capture_seconds": ((encoder._precompile_seconds + encoder.bank.capture_seconds + encoder._routing_seconds)
                                if encoder.bank else 0.0),
            "precompile": asdict(encoder._precompile),
            "single_frame_packed_below": dict(encoder._packed_single_below),
            "faster_next_bucket": {small.name: large.name for small, large in encoder._faster_next.items()},
            "pool_bytes": encoder.bank.pool_bytes if encoder.bank else 0,
            # of which cuBLAS's workspaces for the capture stream (not activations)
            "pool_workspace_bytes": encoder.bank.workspace_bytes if encoder.bank else 0,
        }
    result["plans"] = encoder._plans.stats()
    result["front"] = front.stats() if front is not None else idle_front_stats(encoder)
    return result
