"""Attention backends for packed (varlen) vision sequences.

Every backend takes ``q, k, v`` of shape ``[T, heads, head_dim]`` and a
:class:`SegmentedBatch`, and returns ``[T, heads, head_dim]``.
Each is capturable in a CUDA graph: segment boundaries are read from device
tensors and ``max_seqlen`` is a Python int fixed for the graph.

Rows outside every segment (bucket padding) are never read by torch's varlen
and flash-attn's kernels and their outputs are left unwritten; FlashAttention 4
loads whole key tiles past a segment's end, so the fused forward zeroes padding
rows for it; the masked-SDPA fallback zeroes them before its matmuls. Every later
op is row-local, so padding never reaches a real output row, whatever the memory
holds.

Items stay isolated: a key outside a query's segment gets weight exactly 0, but 0 * NaN is
NaN, so a backend that multiplies values outside a segment (FlashAttention 4's and cuDNN's
key tiles past a segment's end, the masked-SDPA fallback's one dense product) only ever sees
finite ones there (:func:`finite_values`); the fallback then marks every row of a segment
that held a non-finite value NaN (alone, a non-finite key or value would reach them all).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .backend_names import BACKENDS, attention_backend  # noqa: F401  (the traits need no torch)


class SegmentedBatch(Protocol):
    """What the attention backends read of a batch's metadata (the model's batch type has it)."""

    cu_seqlens: torch.Tensor  # [S + 1] int32 segment offsets; empty slots repeat the last one
    segment_ids: torch.Tensor  # [T] int32, -1 on padding rows
    max_seqlen: int  # baked into a captured graph
    segment_lengths: tuple[int, ...] | None  # exact lengths of an unpadded batch, else None
    padded: bool
    dense: bool  # exactly one segment slot


class SegmentFlags:
    """``padded`` and ``dense`` of a :class:`SegmentedBatch`, from its other fields."""

    @property
    def padded(self) -> bool:
        return self.segment_lengths is None

    @property
    def dense(self) -> bool:
        """Exactly one segment slot."""
        return self.cu_seqlens.shape[0] == 2


logger = logging.getLogger(__name__)

FA4_ARCHS = (9, 10)  # compute capability majors FlashAttention 4 has forward kernels for (Hopper, Blackwell)
FA4_SHORT_TILE_ARCHS = (9,)  # its tiles were measured on Hopper only; elsewhere FA4 keeps its own


@dataclass(frozen=True)
class AttentionTuning:
    """FlashAttention 4's tiles per batch: data an encoder derives from its device and its
    tower's heads (:func:`attention_tuning`) and a tower holds. A tile is ``(m, n)``, or
    ``(m, n, pv_from_registers, intra_warpgroup_overlap)``; None: FA4's own choice."""

    choose_tiles: bool = False  # the tile follows the batch (measured on Hopper); False: FA4's own tiles
    sm_count: int = 132  # of the device: the wave model's
    # A short segment wastes most of FA4's last 192-row query tile: up to short_seqlen tokens
    # (a batch's max_seqlen, which a graph bakes in) short_tile where the wave model allows.
    short_seqlen: int = 2048
    short_tile: tuple | None = (128, 128)
    long_tile: tuple | None = None
    own_tile_m: int = 192  # the query tile FA4 picks itself (Hopper, non-causal)
    # Below TINY_MAX_ROWS rows, tiny_tile where one frame fits one wave with it. None: off.
    tiny_tile: tuple | None = (64, 128)


def attention_tuning(arch: int | None, sm_count: int | None, head_dim: int) -> AttentionTuning:
    """The attention tuning on a device of compute capability major ``arch`` with ``sm_count``
    SMs (None, None: not a GPU) for heads ``head_dim`` wide: FA4's own Hopper tile is 192 query
    rows up to head_dim 96 and 128 above (then the short tile saves nothing)."""
    tuning = AttentionTuning(own_tile_m=192 if head_dim <= 96 else 128)
    if arch in FA4_SHORT_TILE_ARCHS and sm_count is not None:
        tuning = dataclasses.replace(tuning, choose_tiles=True, sm_count=sm_count)
    return tuning


DEFAULT_ATTENTION = AttentionTuning()
TINY_MAX_ROWS = 1024  # the tiny tile only below it: above, FA4's persistent kernel takes over (benchmarks/HISTORY.md)


def _has_torch_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _has_flash_attn() -> bool:
    # flash-attn 2 is a regular package; flash-attn-4 alone leaves a namespace ``flash_attn``
    # (origin None) holding only ``cute``.
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and spec.origin is not None


def _has_fa4(device: torch.device) -> bool:
    if torch.cuda.get_device_capability(device)[0] not in FA4_ARCHS:
        return False
    return fa4_importable()


@functools.lru_cache(maxsize=None)
def fa4_importable() -> bool:
    """FlashAttention 4 imports, with what it needs (quack, the CuTe DSL): tried for real, once.
    Installed but broken is a warning, and "auto" then picks another backend."""
    try:
        if importlib.util.find_spec("flash_attn.cute") is None:
            return False
    except ImportError:
        return False
    try:
        _fa4_forward()
    except Exception as err:  # a broken or incompatible install
        logger.warning("vitgraph: flash-attn-4 is installed but failed to import (%s: %s); not using it",
                       type(err).__name__, err)
        return False
    return True


# FA4 keeps compiled kernels on disk only where this variable is "1" as it is imported (its
# default is off); vitgraph leaves the choice to the process.
FA4_CACHE_SWITCH = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"


def _fa4_forward():
    # The forward the public varlen function wraps (in an autograd Function), which also takes
    # a tile shape; vitgraph never needs FA4's backward.
    from flash_attn.cute.interface import _flash_attn_fwd

    return _flash_attn_fwd


def fa4_tile_kwargs(tile: tuple | None) -> dict:
    """FlashAttention 4's forward keywords for a tile (see :class:`AttentionTuning`)."""
    if tile is None:
        return {}
    m, n, *flags = tile
    kwargs = {"tile_mn": (m, n)}
    if flags:  # else FA4 turns both on for an explicit tile
        kwargs["mma_pv_is_rs"], kwargs["intra_wg_overlap"] = flags
    return kwargs


def _wave_cost(max_seqlen: int, heads: int, tuning: AttentionTuning, tile: tuple | None) -> int:
    """Tile-rows of time one frame of ``max_seqlen`` tokens takes: ``heads * ceil(n / m)``
    CTAs, one per SM at a time, each ``m`` rows."""
    m = tuning.own_tile_m if tile is None else tile[0]
    return math.ceil(heads * math.ceil(max_seqlen / m) / tuning.sm_count) * m


def fa4_prefers_short_tile(max_seqlen: int, heads: int, tuning: AttentionTuning) -> bool:
    """Whether a batch whose segments hold at most ``max_seqlen`` tokens attends with the short
    tile rather than the long one: never above ``short_seqlen``; below, where one frame of
    ``max_seqlen`` tokens (what a bucket's single-frame steps hold) takes no more tile-rows of
    time with it (where the short tile needs more waves it replays slower: benchmarks/HISTORY.md)."""
    if not tuning.choose_tiles or max_seqlen > tuning.short_seqlen:
        return False
    return (_wave_cost(max_seqlen, heads, tuning, tuning.short_tile)
            <= _wave_cost(max_seqlen, heads, tuning, tuning.long_tile))


def fa4_prefers_tiny_tile(max_seqlen: int, heads: int, tuning: AttentionTuning) -> bool:
    """Whether a small batch whose segments hold at most ``max_seqlen`` tokens attends with the
    tiny tile rather than the short one: only where one such frame takes strictly less time by
    the same wave count (on a tie the larger tile is the faster one: benchmarks/HISTORY.md)."""
    if tuning.tiny_tile is None or not fa4_prefers_short_tile(max_seqlen, heads, tuning):
        return False
    return (_wave_cost(max_seqlen, heads, tuning, tuning.tiny_tile)
            < _wave_cost(max_seqlen, heads, tuning, tuning.short_tile))


def fa4_short_cap(budget: int, heads: int, unit: int, tuning: AttentionTuning) -> int | None:
    """The frame cap of a short-frame bucket for ``budget``, or None where its own packed
    bucket attends with the short tile already (or the tile does not follow the batch): the
    largest frame length (a multiple of ``unit``) below the budget that takes the short tile."""
    if not tuning.choose_tiles or fa4_prefers_short_tile(budget, heads, tuning):
        return None
    cap = min(budget - unit, tuning.short_seqlen) // unit * unit
    while cap > 0 and not fa4_prefers_short_tile(cap, heads, tuning):
        cap -= unit
    return cap if cap > 0 else None


@functools.lru_cache(maxsize=None)
def arch_and_sm_count(device: torch.device) -> tuple[int, int]:
    """A CUDA ``device``'s compute capability major and SM count (cached)."""
    return torch.cuda.get_device_capability(device)[0], torch.cuda.get_device_properties(device).multi_processor_count


def fa4_tile(max_seqlen: int, heads: int, rows: int | None = None,
             tuning: AttentionTuning = DEFAULT_ATTENTION) -> tuple | None:
    """FlashAttention 4's tile for a batch of ``rows`` rows (None: many) whose segments hold at
    most ``max_seqlen`` tokens; None: FA4's own."""
    if not tuning.choose_tiles:
        return None
    if not fa4_prefers_short_tile(max_seqlen, heads, tuning):
        return tuning.long_tile
    if rows is not None and rows < TINY_MAX_ROWS and fa4_prefers_tiny_tile(max_seqlen, heads, tuning):
        return tuning.tiny_tile
    return tuning.short_tile


def fa4_kernel(max_seqlen: int, heads: int, rows: int, dtype: torch.dtype,
               tuning: AttentionTuning = DEFAULT_ATTENTION) -> tuple:
    """The compiled FlashAttention 4 kernel :func:`attend` runs for such a batch, as a
    hashable key (equal keys: one kernel)."""
    return ("fa4", str(dtype), fa4_tile(max_seqlen, heads, rows, tuning))


def _fa4_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: SegmentedBatch,
                tuning: AttentionTuning) -> torch.Tensor:
    tile = fa4_tile(batch.max_seqlen, q.shape[1], q.shape[0], tuning)
    return _fa4_forward()(q, k, v, cu_seqlens_q=batch.cu_seqlens, cu_seqlens_k=batch.cu_seqlens,
                          max_seqlen_q=batch.max_seqlen, max_seqlen_k=batch.max_seqlen, **fa4_tile_kwargs(tile))[0]


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on ``device``, fastest first."""
    device = torch.device(device)
    found = []
    if device.type == "cuda":
        if _has_fa4(device):
            found.append("fa4")
        if _has_torch_varlen():
            from . import cudnn_attention

            if cudnn_attention.available():
                found.append("cudnn")
            found.append("varlen")
        if _has_flash_attn():
            found.append("flash")
    found.append("sdpa")
    return found


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str:
    """Turn ``"auto"`` into the best available backend, and check an explicit choice.

    The flash kernels (``fa4``, ``cudnn``, ``varlen``, ``flash``) take fp16/bf16 only; fp32
    uses ``sdpa``. ``fa4`` (needs ``flash-attn-4``, Hopper or Blackwell) is FlashAttention 4's
    varlen kernel, for every call but the fused forward's one-frame buckets. ``cudnn`` (needs
    ``nvidia-cudnn-frontend``) is cuDNN's ragged attention for the packed buckets of the fused
    forward; everywhere else it behaves as ``varlen``.
    """
    available = available_backends(device)
    if dtype not in (torch.float16, torch.bfloat16):
        available = [b for b in available if not attention_backend(b).half_only]
    if name == "auto":
        return available[0]
    if name not in BACKENDS:
        raise ValueError(f"attention must be 'auto' or one of {BACKENDS}, got {name!r}")
    if name not in available:
        raise ValueError(
            f"attention backend {name!r} is not available on {device} for {dtype} (not installed, failed to "
            f"import, or not for this GPU); available: {available}")
    return name


def _heads_first(*xs: torch.Tensor):
    """``[T, H, D]`` -> ``[1, H, T, D]`` views: the layout of torch's dense attention ops."""
    return (x.transpose(0, 1).unsqueeze(0) for x in xs)


def _tokens_first(out: torch.Tensor) -> torch.Tensor:
    return out.squeeze(0).transpose(0, 1)


def _sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # torch picks cuDNN / flash / efficient kernels itself.
    q, k, v = _heads_first(q, k, v)
    return _tokens_first(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


LANE_PAD = 8  # extra head-dim lanes for dense attention over a padded bucket (one masks, cuDNN wants multiples of 8)


def dense_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense cuDNN attention over one padded segment: ``q, k [T, H, D + LANE_PAD]``, ``v [T, H, D]``.

    The extra lane of q is 1 and that of a padding key is a large negative number (see
    :func:`vitgraph.ops.kernels.rotary_`), so ``q.k`` of every real query with a padding key
    underflows ``exp`` to exactly 0: the real rows get exact single-segment attention,
    with no mask tensor (which halves cuDNN's speed) and no per-call plan build.
    """
    q, k, v = _heads_first(q, k, v)
    return _tokens_first(
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, False, False, scale=scale)[0])


def finite_values(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every non-finite value 0: what a kernel may multiply by a masked-out weight."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def finite_values_(x: torch.Tensor) -> torch.Tensor:
    """:func:`finite_values` in place (a view of a packed qkv, say)."""
    return torch.nan_to_num_(x, nan=0.0, posinf=0.0, neginf=0.0)


def _isolated_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal attention over segment ``ids`` (-1: padding, its own block) as one dense
    masked product, capturable: q, k, v enter it finite, and a segment that held a non-finite
    value comes out NaN on every row, so no segment's values reach another's rows."""
    same = ids[:, None] == ids[None, :]
    finite = torch.isfinite(q).logical_and_(torch.isfinite(k)).logical_and_(torch.isfinite(v)).flatten(1).all(1)
    out = _sdpa_dense(finite_values(q), finite_values(k), finite_values(v), same)
    poisoned = same.logical_and_(~finite[None, :]).any(1)
    return torch.where(poisoned[:, None, None], float("nan"), out)


def attend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: SegmentedBatch,
           padding_zeroed: bool = False, tuning: AttentionTuning = DEFAULT_ATTENTION,
           values_finite: bool = False) -> torch.Tensor:
    """Non-causal attention inside each segment of ``batch.cu_seqlens``. ``padding_zeroed``: the
    caller has zeroed the padding rows of ``v`` (FlashAttention 4 reads them, weighted 0);
    ``values_finite``: and every non-finite value of ``v`` (the rotary kernel's ``zero_padding``,
    qkv's rope epilogue).
    ``tuning``: the tower's (FlashAttention 4's tiles)."""
    if attention_backend(backend).reads_past_segments:  # FA4
        if not batch.dense and not values_finite:  # FA4 weighs the next segment's values 0: finite only
            v = finite_values(v)
        if batch.padded and not padding_zeroed:
            v = torch.where((batch.segment_ids >= 0)[:, None, None], v, 0.0)
        return _fa4_attend(q, k, v, batch, tuning)
    if batch.dense and not batch.padded:
        # One segment covers every row: plain SDPA, no mask (cuDNN on Hopper).
        return _sdpa_dense(q, k, v, None)
    if backend in ("varlen", "cudnn"):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen)
    if backend == "flash":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, batch.cu_seqlens, batch.cu_seqlens,
                                      batch.max_seqlen, batch.max_seqlen, causal=False)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if backend == "sdpa" and batch.segment_lengths is not None and not capturing:
        # Eager, unpadded: attend segment by segment instead of through a T x T mask.
        parts = zip(*(x.split(batch.segment_lengths) for x in (q, k, v)))
        return torch.cat([_sdpa_dense(qs, ks, vs, None) for qs, ks, vs in parts])
    if backend == "sdpa":
        return _isolated_sdpa(q, k, v, batch.segment_ids)
    raise ValueError(f"unknown attention backend {backend!r}")
