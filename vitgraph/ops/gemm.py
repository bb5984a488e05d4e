"""fc1 with QuickGELU in its epilogue: one CuTe-DSL GEMM instead of cuBLAS plus a Triton pass
(and qkv through the same GEMM at large row counts, with the rotary in its epilogue from
``QUACK_ROPE_MIN_ROWS`` rows and in the 256- and 512-row buckets: :mod:`vitgraph.ops.gemm_rope`).

The ``quack`` backend runs quack-kernels' Hopper GEMM (installed with the ``fa4`` extra) with
the bias and ``x * sigmoid(1.702 x)`` applied to the fp32 accumulator before the one bf16
store. At 4096 tokens that saves the QuickGELU pass over fc1's output (84 MB read and
written) and quack's tile also beats cuBLAS there: 93.7 -> 73.6 µs per block on an H200
(``benchmarks/gemm_quack_epilogue.py``). Below ``QUACK_MIN_ROWS`` rows cuBLAS plus the
Triton pass is as fast, so small inputs keep it, except the 256-row bucket, where fc1 and qkv
(with the rotary) take quack's 64-row tiles (``QUACK_SMALL_ROWS``), and the 512-row one, where
qkv does (``QUACK_ROPE_SMALL_ROWS``). The plain qkv GEMM also takes quack's tile
from ``QUACK_QKV_MIN_ROWS`` rows, where it beats cuBLAS's choice. fc1's and (with the rotary)
qkv's tile is picked per row count by a wave model (:func:`pick_tile`), so that a bucket's last
wave of output tiles is not mostly idle; the tiles give the same bits. Every call with the same
shape takes the same path, so graph replay stays bitwise equal to eager.

proj and fc2 at small row counts (:func:`linear_split_k`, any backend): K split in two as one
strided-batched cuBLAS GEMM, for twice the output tiles; the add+LayerNorm kernel after each
sums the two partial products with the bias. Above those (:func:`bias_free_stream`) they add
into the residual stream inside cuBLAS, their biases kept out of it for the LayerNorms to add.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import logging

import torch
import torch.nn.functional as F

from . import kernels
from .attention import arch_and_sm_count

logger = logging.getLogger(__name__)

GEMM_BACKENDS = ("quack", "cublas")
QUACK_ARCHS = (9,)  # compute capability majors whose quack GEMM configuration was measured (Hopper)
# fc1 + QuickGELU: from 512 rows quack wins (14.5 vs 17.2 µs; equal at 384). Lower thresholds, end to
# end: the 384-row bucket 0.05 ms faster, the 416-row one 0.08-0.11 slower (BENCHMARKS.md).
QUACK_MIN_ROWS = 512
QUACK_QKV_MIN_ROWS = 2048  # plain qkv: quack's tile wins from 2048 rows (28.4 vs 31.5 µs), loses at 1024 (19.6 vs 17.8)
# qkv with the rotary in its epilogue (vitgraph.ops.gemm_rope) against qkv + the Triton rotary pass,
# µs per call on an H200 (benchmarks/gemm_rope_epilogue.py): 22.9 -> 22.1 at 1024 rows, 35.5 -> 31.1
# at 2048, 66.6 -> 56.9 at 4096; 15.1 -> 14.6 at 512 (noise) and 11.6 -> 14.2 at 256 (cuBLAS wins).
# Since the LayerNorm ahead launches quack's GEMM early (vitgraph.ops.kernels), each after it
# (--after-layernorm, the tile the wave model picks): 576 rows 20.6 -> 18.3, 640 19.8 -> 17.9,
# 704 21.4 -> 20.5, 768 21.7 -> 20.2, 832 24.6 -> 22.4, 896 25.4 -> 22.3; end to end one frame
# of 576-896 tokens 0.04-0.10 ms faster (benchmarks/ab_setting.py, both build orders).
QUACK_ROPE_MIN_ROWS = 576
# quack's Hopper tile for fc1 (1280 -> 5120): the fastest at 1024 and 4096 rows of those measured.
QUACK_TILE = dict(tile_m=128, tile_n=160, pingpong=True, cluster_m=1, cluster_n=2)
# qkv with the rotary (N = 3840) and fc1 (N = 5120; both K = 1280) pick their tile by a wave
# model: each candidate's µs per wave of 132 CTAs, measured at 4096 rows on an H200 where every
# tile runs many waves, times the waves a call needs; another tile than QUACK_TILE is taken
# only where it is predicted to save at least TILE_MARGIN. qkv (benchmarks/gemm_rope_epilogue.py
# --tiles, h200-gemm-rope-tiles.log: 56.2 µs in 6 waves, 56.8 in 5, 68.6 in 4): 1024 rows 21.7
# -> 19.4 µs (128x240, one wave instead of two), 1536 rows 29.4 -> 26.0 (128x192, two instead
# of three). fc1 with QuickGELU (benchmarks/gemm_quack_epilogue.py --layers fc1 --tiles,
# h200-gemm-fc1-tiles.log: 72.3 µs in 8 waves, 73.9 in 10): 1152 rows 28.8 -> 24.6 (128x128,
# three waves either way but smaller ones), 1664 rows 36.9 -> 32.0. Where the model keeps
# QUACK_TILE it was also the fastest measured (qkv 1152-4096 rows, fc1 1024-1536 and 4096).
# The tiles differ in N, not in the order K is summed: every tile gives the same bits.
QUACK_ROPE_WAVE_US = 9.37  # QUACK_TILE's, for qkv with the rotary
QUACK_ROPE_TILES = (  # the alternatives, each with its µs per wave
    (dict(tile_m=128, tile_n=192, pingpong=True, cluster_m=1, cluster_n=2), 11.36),
    (dict(tile_m=128, tile_n=240, pingpong=False, cluster_m=1, cluster_n=2), 17.15),
)
QUACK_FC1_WAVE_US = 9.04  # QUACK_TILE's, for fc1 with QuickGELU
QUACK_FC1_TILES = ((dict(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, cluster_n=2), 7.39),)
TILE_MARGIN = 0.05
# The 256-row bucket (every frame of up to 256 tokens): fc1 and qkv with the rotary through quack
# with 64-row tiles, one warpgroup's MMA each (128-row tiles leave most SMs idle there: 48 tiles of
# 128x160 for qkv on 132 SMs). Alone, back to back (µs on an H200): fc1 + QuickGELU 11.8 -> 9.8
# against cuBLAS + the Triton pass (h200-gemm-fc1-small.log), qkv + rotary 11.5 -> 9.3
# (h200-gemm-rope-small.log). In the tower that only pays since add+LayerNorm launches its
# dependents (vitgraph.ops.kernels.LAYERNORM_LAUNCHES_DEPENDENTS): after a LayerNorm launched the plain
# way qkv + rotary measured 13.7-14.1 against 13.2-13.6 µs, with it 12.2-12.5
# (h200-gemm-rope-launch-dependents.log); end to end (benchmarks/ab_setting.py, both build orders)
# the 256-row bucket 1.65 -> 1.55 and 1.69 -> 1.58 ms. The 288-row bucket lost 0.08-0.10 ms and
# 480 rows 0.05, so the band is that one bucket. The tiles give the 128-row tiles' bits.
# Both in 2x1 clusters: the two 64-row tiles of a cluster load each weight tile once (TMA
# multicast). qkv + rotary after the LayerNorm, 256 rows (h200-gemm-rope-small-clusters.log):
# 1x1 12.2-12.6 µs, 2x1 10.9-11.1, 4x1 11.3; end to end 1x256 -0.05 ms. fc1 in 4x1 clusters
# lost (13.5 against 9.8 µs alone; 1x256 +0.12 ms end to end).
QUACK_SMALL_ROWS = (256, 256)  # (fewest, most) rows
# qkv with the rotary also takes its 64-row tile in this band ((fewest, most) rows), where
# cuBLAS + the Triton rotary pass run otherwise (below QUACK_ROPE_MIN_ROWS). After the
# LayerNorm (h200-gemm-rope-416-512.log), µs: 512 rows 17.1 -> 15.1, 480 16.7 -> 16.1, 416
# 15.6 -> 16.4. End to end, one frame per bucket, both build orders (benchmarks/ab_setting.py):
# the 512-row bucket -0.02 to -0.07 ms, the 480-row one -0.04 to +0.04 (so not taken).
QUACK_ROPE_SMALL_ROWS = (512, 512)
QUACK_FC1_SMALL_TILE = dict(tile_m=64, tile_n=160, pingpong=True, cluster_m=2, cluster_n=1)
QUACK_ROPE_SMALL_TILE = dict(tile_m=64, tile_n=128, pingpong=True, cluster_m=2, cluster_n=1)
# proj and fc2 (N = 1280) up to this many rows: K split in SPLIT_K halves, one strided-batched
# cuBLAS GEMM whose partial products the next add+LayerNorm sums. At 256 rows a 128x128 tile
# grid has 20 tiles for 132 SMs. GEMM + add+LayerNorm, µs on an H200
# (benchmarks/gemm_batched_split_k.py): proj 8.8 -> 7.8 at 256 rows, 9.4 -> 8.4 at 384,
# 9.9 -> 9.3 at 512; fc2 16.1 -> 12.7, 16.5 -> 14.3, 17.6 -> 15.6; none at 1024 or more, and
# more than two splits or fp32 partials were slower. From 576 to 896 rows, end to end
# (benchmarks/ab_setting.py, one frame per bucket): 640 -0.05 ms, 704 -0.23 to -0.27 (unsplit, the
# 704-row bucket was slower than the 768-row one: presumably cuBLAS's kernels for that shape),
# 832 -0.05 to -0.07, 896 -0.06 to -0.07, 576 and 768 within +-0.02.
SPLIT_K_MAX_ROWS = 896
SPLIT_K = 2
# Row counts where fc2 (K = 5120, from SPLIT_K_LONG_MIN_K) splits in SPLIT_K_LONG slices of 1280
# instead (proj, K = 1280, keeps SPLIT_K): there cuBLAS's heuristic picks a slow kernel for
# fc2's two-split batched GEMM. GEMM + add+LayerNorm, µs on an H200
# (benchmarks/gemm_batched_split_k.py, h200-gemm-batched-split-k-buckets.log), fc2 in two ->
# four: 320 rows 17.2 -> 14.9, 416 18.5 -> 15.4 (288-384 rows 0.2-0.6 less, from 480 two win;
# proj in four lost at every row count). End to end (benchmarks/ab_setting.py, one frame per
# bucket, both build orders): the 320-row bucket 0.07-0.10 ms faster, the 416-row one
# 0.09-0.12 (with proj in four too; proj in two since, a tie), the 384-row one 0.01-0.06 ms
# slower with fc2 in four and the 256-, 288- and 352-row ones within 0.02.
SPLIT_K_LONG_ROWS = (320, 416)
SPLIT_K_LONG = 4
SPLIT_K_LONG_MIN_K = 4096
SPLIT_K_ARCHS = (9,)  # compute capability majors where it was measured (Hopper)
# Above SPLIT_K_MAX_ROWS rows the fused forward keeps proj's and fc2's biases out of the residual
# stream: cuBLAS adds each product into the stream itself (addmm_, beta 1), and the LayerNorm
# after it adds the biases so far (one fp32 vector per LayerNorm) to the rows it normalizes. The
# add+LayerNorm kernel then reads the stream and writes the normalized rows (21 MB at 4096
# tokens) instead of reading two tensors and writing two (42 MB). False: the plain adds.
BIAS_FREE_STREAM = True


def quack_available(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device)[0] not in QUACK_ARCHS:
        return False
    try:
        return importlib.util.find_spec("quack") is not None and importlib.util.find_spec("cutlass") is not None
    except ImportError:
        return False


def resolve_gemm(name: str, device: torch.device | str, dtype: torch.dtype, fused: bool) -> str:
    """``"auto"``: ``quack`` where it can run (Hopper, bf16, the fused forward, and quack imports),
    else ``cublas``. An explicit ``"quack"`` that cannot run is a ``ValueError``. bf16 only:
    the dtype the quack path was measured and tested in."""
    if name not in ("auto",) + GEMM_BACKENDS:
        raise ValueError(f"gemm must be 'auto' or one of {GEMM_BACKENDS}, got {name!r}")
    if name == "cublas":
        return name
    usable = fused and dtype == torch.bfloat16 and quack_available(device)
    if usable:
        try:
            _quack()  # imports quack and registers the epilogue: fail here, not during capture
        except Exception as err:  # a broken or incompatible install
            if name == "quack":
                raise ValueError(f"gemm='quack': quack-kernels is installed but failed to load: {err}") from err
            logger.warning("vitgraph: quack-kernels failed to load (%s); fc1 and qkv use cuBLAS", err)
            return "cublas"
        return "quack"
    if name == "quack":
        raise ValueError(f"gemm='quack' needs quack-kernels (pip install 'vitgraph[fa4]'), a Hopper GPU, bf16 "
                         f"and the fused forward; got device {device}, dtype {dtype}, fused {fused}")
    return "cublas"


def _quick_gelu_epilogue():
    import cutlass.cute as cute
    from cutlass import const_expr
    from cutlass.cutlass_dsl import dsl_user_op
    from quack.activation import sigmoid

    @dsl_user_op
    def quick_gelu(x, *, loc=None, ip=None):
        if const_expr(not isinstance(x, tuple)):
            return x * sigmoid(1.702 * x)
        return cute.arch.mul_packed_f32x2(x, sigmoid(cute.arch.mul_packed_f32x2((1.702, 1.702), x)))

    return quick_gelu


@functools.cache
def _quack():
    """quack's GEMM-with-activation and plain GEMM entries, and the registered activation's name."""
    from quack import activation
    from quack.gemm_interface import gemm_act_tuned, gemm_tuned

    # quack keeps compiled kernels on disk keyed by the activation's name: name it after its
    # source, so an edit here can never load a stale kernel.
    source = inspect.getsource(_quick_gelu_epilogue).encode()
    name = f"vitgraph_quick_gelu_{hashlib.sha256(source).hexdigest()[:12]}"
    activation.act_fn_map.setdefault(name, _quick_gelu_epilogue())
    return gemm_act_tuned.fn, gemm_tuned.fn, name


def _weight_fits(weight: torch.Tensor) -> bool:
    # 16-byte aligned rows for TMA, of the weight and of an input as wide as its K; the weight
    # is used as [K, N] through a transposed view.
    return weight.is_contiguous() and weight.shape[0] % 8 == 0 and weight.shape[1] % 8 == 0


def _in_band(rows: int, band: tuple[int, int]) -> bool:
    fewest, most = band
    return fewest <= rows <= most


def _small(rows: int) -> bool:
    """fc1 and qkv with the rotary of ``rows`` rows take quack's 64-row tiles (``QUACK_SMALL_ROWS``)."""
    return _in_band(rows, QUACK_SMALL_ROWS)


def _small_rope(rows: int) -> bool:
    """qkv with the rotary of ``rows`` rows takes quack's 64-row tile (``QUACK_SMALL_ROWS``,
    ``QUACK_ROPE_SMALL_ROWS``)."""
    return _small(rows) or _in_band(rows, QUACK_ROPE_SMALL_ROWS)


def _quack_rows(rows: int, weight: torch.Tensor, min_rows: int, small=None) -> bool:
    """``small``: None, or the predicate of the rows below ``min_rows`` that take quack too."""
    return (rows >= min_rows or (small is not None and small(rows))) and _weight_fits(weight)


def _quack_fits(x: torch.Tensor, weight: torch.Tensor, min_rows: int, small=None) -> bool:
    return (x.is_contiguous() and x.shape[1] == weight.shape[1]
            and _quack_rows(x.shape[0], weight, min_rows, small))


def linear_quick_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, backend: str) -> torch.Tensor:
    """``quick_gelu(x @ weight.T + bias)`` for ``x [M, K]``, ``weight [N, K]``."""
    if backend == "quack" and _quack_fits(x, weight, QUACK_MIN_ROWS, small=_small):
        gemm_act, _, name = _quack()
        out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
        gemm_act(x, weight.t(), None, out, None, bias, name,
                 config=_config(fc1_tile, x.shape[0], weight.shape[0], x.device))
        return out
    return kernels.quick_gelu_(F.linear(x, weight, bias))


def linear_qkv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, backend: str) -> torch.Tensor:
    """``x @ weight.T + bias``: quack's GEMM from ``QUACK_QKV_MIN_ROWS`` rows, cuBLAS below."""
    if backend == "quack" and _quack_fits(x, weight, QUACK_QKV_MIN_ROWS):
        _, gemm, _ = _quack()
        out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
        gemm(x, weight.t(), out, bias=bias, config=plain_config())
        return out
    return F.linear(x, weight, bias)


def _split_k_device(device: torch.device) -> bool:
    return device.type == "cuda" and arch_and_sm_count(device)[0] in SPLIT_K_ARCHS


def split_k_count(rows: int, k: int) -> int:
    """How many slices of K :func:`linear_split_k` splits ``rows`` rows into where it runs
    (1: unsplit): ``SPLIT_K``, or ``SPLIT_K_LONG`` for long K at ``SPLIT_K_LONG_ROWS`` rows."""
    if rows > SPLIT_K_MAX_ROWS:
        return 1
    if k >= SPLIT_K_LONG_MIN_K and rows in SPLIT_K_LONG_ROWS:
        return SPLIT_K_LONG
    return SPLIT_K


def bias_free_stream(rows: int) -> bool:
    """Whether the fused forward of ``rows`` rows keeps the biases out of the residual stream
    (``BIAS_FREE_STREAM``): where proj and fc2 do not split K."""
    return BIAS_FREE_STREAM and rows > SPLIT_K_MAX_ROWS


def linear_split_k(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x @ weight.T + bias`` for :func:`vitgraph.ops.kernels.add_layernorm` to add: ``(y, None)``
    with the bias applied, or, for at most ``SPLIT_K_MAX_ROWS`` rows on a GPU where it was
    measured, ``(partials, bias)``: ``[S, T, N]`` products of K's slices (``S``:
    :func:`split_k_count`) from one strided-batched GEMM over views (no copies), which the
    kernel sums with the bias."""
    rows, k = x.shape
    splits = split_k_count(rows, k)
    if (splits < 2 or k % (8 * splits)
            or not (x.is_contiguous() and weight.is_contiguous()) or not _split_k_device(x.device)):
        return F.linear(x, weight, bias), None
    xs = x.view(rows, splits, k // splits).transpose(0, 1)  # [S, T, K/S]
    ws = weight.view(weight.shape[0], splits, k // splits).permute(1, 2, 0)  # [S, K/S, N]
    return torch.bmm(xs, ws), bias


def rope_in_gemm(rows: int, weight: torch.Tensor, backend: str) -> bool:
    """Whether qkv of ``rows`` rows (contiguous input) takes :func:`linear_qkv_rope`, the rotary in
    the GEMM's epilogue. The per-row fp32 vectors need ``rows % 4 == 0`` (16-byte aligned rows)."""
    return backend == "quack" and _quack_rows(rows, weight, QUACK_ROPE_MIN_ROWS, small=_small_rope) and rows % 4 == 0


def linear_qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, freq_h: torch.Tensor,
                    freq_w: torch.Tensor, pos_h: torch.Tensor, pos_w: torch.Tensor) -> torch.Tensor:
    """qkv with q and k rotated and padding rows (``pos_h < 0``) zeroed, one quack GEMM; see
    :func:`vitgraph.ops.gemm_rope.qkv_rope`. Call it only where :func:`rope_in_gemm` holds."""
    from .gemm_rope import qkv_rope

    config = _config(rope_tile, x.shape[0], weight.shape[0], x.device)
    return qkv_rope(x, weight, bias, freq_h, freq_w, pos_h, pos_w, config)


def fc1_kernel(rows: int, weight: torch.Tensor, backend: str) -> tuple | None:
    """The compiled kernel :func:`linear_quick_gelu` runs for a contiguous input of ``rows``
    rows, as a hashable key (equal keys: one kernel); None where it runs on cuBLAS."""
    if backend != "quack" or not _quack_rows(rows, weight, QUACK_MIN_ROWS, small=_small):
        return None
    return "fc1", str(weight.dtype), _tile_items(fc1_tile, rows, weight.shape[0], weight.device)


def qkv_kernel(rows: int, weight: torch.Tensor, backend: str) -> tuple | None:
    """The compiled kernel :func:`linear_qkv` runs for a contiguous input of ``rows`` rows
    (None: cuBLAS)."""
    if backend != "quack" or not _quack_rows(rows, weight, QUACK_QKV_MIN_ROWS):
        return None
    return "qkv", str(weight.dtype), tuple(QUACK_TILE.items())


def qkv_rope_kernel(rows: int, weight: torch.Tensor) -> tuple:
    """The compiled kernel :func:`linear_qkv_rope` runs for ``rows`` rows."""
    return "qkv_rope", str(weight.dtype), _tile_items(rope_tile, rows, weight.shape[0], weight.device)


def _tiles(rows: int, cols: int, tile: dict) -> int:
    return -(-rows // tile["tile_m"]) * -(-cols // tile["tile_n"])


def pick_tile(rows: int, cols: int, sm_count: int, wave_us: float, alternatives) -> dict:
    """The tile predicted fastest for ``rows x cols`` on ``sm_count`` SMs: one of
    ``alternatives`` (``(tile, µs per wave)`` pairs) where it saves ``TILE_MARGIN`` or more
    against ``QUACK_TILE`` at ``wave_us`` per wave, else ``QUACK_TILE``."""
    def cost(tile: dict, per_wave: float) -> float:
        return -(-_tiles(rows, cols, tile) // sm_count) * per_wave

    default = cost(QUACK_TILE, wave_us)
    best, best_cost = QUACK_TILE, default
    for tile, per_wave in alternatives:
        if cost(tile, per_wave) < best_cost:
            best, best_cost = tile, cost(tile, per_wave)
    return best if best_cost <= (1 - TILE_MARGIN) * default else QUACK_TILE


def rope_tile(rows: int, cols: int, sm_count: int) -> dict:
    """qkv with the rotary: see ``QUACK_ROPE_TILES`` (and ``QUACK_SMALL_ROWS``, ``QUACK_ROPE_SMALL_ROWS``)."""
    if _small_rope(rows):
        return QUACK_ROPE_SMALL_TILE
    return pick_tile(rows, cols, sm_count, QUACK_ROPE_WAVE_US, QUACK_ROPE_TILES)


def fc1_tile(rows: int, cols: int, sm_count: int) -> dict:
    """fc1 with QuickGELU: see ``QUACK_FC1_TILES`` (and ``QUACK_SMALL_ROWS``)."""
    if _small(rows):
        return QUACK_FC1_SMALL_TILE
    return pick_tile(rows, cols, sm_count, QUACK_FC1_WAVE_US, QUACK_FC1_TILES)


def _tile_items(pick, rows: int, cols: int, device: torch.device) -> tuple:
    """The tile ``pick`` (:func:`fc1_tile`, :func:`rope_tile`) gives ``rows x cols`` on ``device``,
    as hashable items: a kernel's key, and :func:`_config`'s."""
    return tuple(pick(rows, cols, arch_and_sm_count(device)[1]).items())


def _config(pick, rows: int, cols: int, device: torch.device):
    return _gemm_config(_tile_items(pick, rows, cols, device))


def plain_config():
    """quack's GemmConfig for ``QUACK_TILE``: the plain qkv GEMM's (:func:`linear_qkv`)."""
    return _gemm_config(tuple(QUACK_TILE.items()))


@functools.cache
def _gemm_config(tile: tuple):
    from quack.gemm_config import GemmConfig

    return GemmConfig(**dict(tile), swap_ab=False, is_dynamic_persistent=False)
