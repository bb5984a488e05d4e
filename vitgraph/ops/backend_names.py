"""The attention backends' traits and the GEMM backends' names, without torch: what the rest of
vitgraph asks of a backend (the benchmarks' ``--help`` lists the names before torch is
imported). A new attention backend is one row here and its kernel call in
:func:`vitgraph.ops.attention.attend` (with its availability in ``available_backends``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionBackend:
    """One attention backend, as the towers, the buckets and the precompile ask of it."""

    name: str
    half_only: bool = True  # fp16/bf16 only (the flash kernels); fp32 takes sdpa
    # Loads whole key tiles past a segment's end: padding rows of v zeroed, values there finite.
    reads_past_segments: bool = False
    ragged: bool = False  # the fused forward runs cuDNN's ragged attention on packed buckets
    lane_pad: bool = True  # a dense padded bucket masks its padding keys with one extra head lane
    compiles: bool = False  # compiles kernels on first use (kernel precompile, a disk cache)
    tiles: bool = False  # FA4's per-batch tiles: short-frame buckets, packed single frames
    eager_slower: bool = False  # eager calls attend slower than its graphs: padding never sends a step eager


ATTENTION = {b.name: b for b in (
    AttentionBackend("fa4", reads_past_segments=True, compiles=True, tiles=True),
    AttentionBackend("cudnn", ragged=True, eager_slower=True),  # eager: FA2 varlen (benchmarks/HISTORY.md)
    AttentionBackend("varlen"),
    AttentionBackend("flash"),
    AttentionBackend("sdpa", half_only=False, lane_pad=False),
)}  # fastest first: "auto" takes the first available
BACKENDS = tuple(ATTENTION)
GEMM_BACKENDS = ("quack", "cublas")
PRECISIONS = ("bf16", "fp8")  # the blocks' GEMMs: the weights' dtype, or FP8 (vitgraph.ops.fp8)


def attention_backend(name: str) -> AttentionBackend:
    """The traits of backend ``name`` (a resolved one: not "auto")."""
    if name not in ATTENTION:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    return ATTENTION[name]
