"""The MLP's first GEMM with its activation in the epilogue (QuickGELU, GELU-tanh, SiLU, or a
SwiGLU's ``silu(gate) * up``): one CuTe-DSL GEMM instead of cuBLAS plus a Triton pass (and qkv
through the same GEMM at large row counts, with the rotary in its epilogue:
:mod:`vitgraph.ops.gemm_rope`).

The ``quack`` backend runs quack-kernels' Hopper GEMM (installed with the ``fa4`` extra) with
the bias and the activation applied to the fp32 accumulator before the one bf16 store: at 4096
tokens Qwen2-VL-2B saves the QuickGELU pass over fc1's output (84 MB read and written). Which rows take it, and in which tile, is a :class:`GemmTuning` the tower holds
(:func:`gemm_tuning`: from the device and the tower's widths); below its thresholds cuBLAS
plus the Triton pass is as fast. fc1's and (with the rotary) qkv's tile is picked per row
count by a wave model (:func:`pick_tile`), so that a bucket's last wave of output tiles is
not mostly idle. Every call with the same shape takes the same path, so graph replay stays
bitwise equal to eager.

proj and fc2 at small row counts (:func:`linear_split_k`, any backend): K split in two as one
strided-batched cuBLAS GEMM, for twice the output tiles; the add+LayerNorm kernel after each
sums the two partial products with the bias. Above those (:func:`bias_free_stream`) they add
into the residual stream inside cuBLAS, their biases kept out of it for the LayerNorms to add.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import kernels
from .activations import ACTIVATIONS
from .backend_names import GEMM_BACKENDS

logger = logging.getLogger(__name__)

QUACK_ARCHS = (9,)  # compute capability majors whose quack GEMM configuration was measured (Hopper)


class Tile(NamedTuple):
    """A quack GEMM tile (quack's ``GemmConfig`` fields)."""

    tile_m: int
    tile_n: int
    pingpong: bool
    cluster_m: int
    cluster_n: int


TILE = Tile(128, 160, True, 1, 2)  # the tile measured fastest for fc1 (1280 -> 5120) on Hopper (benchmarks/HISTORY.md)


@dataclass(frozen=True)
class GemmTuning:
    """Which GEMM each layer takes at each row count: data an encoder derives from its device
    and its tower's widths (:func:`gemm_tuning`) and a tower holds. The defaults are the plain
    path (cuBLAS, no split K), for a tower no encoder configured."""

    backend: str = "cublas"  # "quack": the MLP's first GEMM + activation and qkv through quack's GEMM (Hopper, bf16)
    sm_count: int = 132  # of the device: the wave model's
    fc1_min_rows: int = 512  # quack's MLP in + activation from here (cuBLAS + the Triton pass below)
    qkv_min_rows: int = 2048  # plain qkv through quack from here
    rope_min_rows: int = 576  # qkv with the rotary in its epilogue from here (vitgraph.ops.gemm_rope)
    small_rows: tuple[int, int] | None = None  # (fewest, most) rows: fc1 and qkv + rotary in 64-row tiles
    rope_small_rows: tuple[int, int] | None = None  # also qkv + rotary in its 64-row tile
    tile: Tile = TILE  # plain qkv's
    # (Tile, µs per wave) pairs: the first the default, the others alternatives (pick_tile)
    fc1_tiles: tuple = ((TILE, 9.04),)  # fc1 with QuickGELU
    rope_tiles: tuple = ((TILE, 9.37),)  # qkv with the rotary
    split_k_max_rows: int = 0  # proj and fc2 up to here: K in ``split_k`` slices (0: never)
    split_k: int = 2
    split_k_long_rows: tuple[int, ...] = ()  # there fc2 (K >= SPLIT_K_LONG_MIN_K) splits in SPLIT_K_LONG
    bias_free: bool = True  # where K is not split, proj and fc2 add into the stream, biases kept aside

    def __post_init__(self) -> None:
        if self.backend not in GEMM_BACKENDS:
            raise ValueError(f"gemm backend must be one of {GEMM_BACKENDS}, got {self.backend!r}")


# Rows, bands and tiles measured on Hopper for Qwen2-VL's tower (K = 1280; fc1 N = 5120, qkv N = 3840),
# each kept only where it beat the A/A noise end to end; the timings are in benchmarks/HISTORY.md.
_MEASURED = dict(fc1_min_rows=512, qkv_min_rows=2048, rope_min_rows=576, small_rows=(256, 256),
                 rope_small_rows=(512, 512), split_k_long_rows=(320, 416))
_MEASURED_SHAPE = (1280, 5120)  # (embed, MLP) widths of the tower those were measured on
_MEASURED_K = 1280  # the wave times' K
# The wave model's alternatives to the default tile, with their µs per wave at _MEASURED_K (benchmarks/HISTORY.md).
_ALTERNATIVES = dict(fc1_tiles=((Tile(128, 128, True, 1, 2), 7.39),),
                     rope_tiles=((Tile(128, 192, True, 1, 2), 11.36), (Tile(128, 240, False, 1, 2), 17.15)))
TILE_MARGIN = 0.05  # an alternative must be predicted this much faster (benchmarks/HISTORY.md)
FC1_SMALL_TILE = Tile(64, 160, True, 2, 1)  # fc1 in small_rows, measured in 2x1 clusters (benchmarks/HISTORY.md)
ROPE_SMALL_TILE = Tile(64, 128, True, 2, 1)  # qkv + rotary in its small bands (benchmarks/HISTORY.md)
SPLIT_K_LONG = 4  # fc2's slices at split_k_long_rows rows (benchmarks/HISTORY.md)
SPLIT_K_LONG_MIN_K = 4096  # the least K split in SPLIT_K_LONG (fc2's, not proj's: benchmarks/HISTORY.md)


def _row_tiles_filling(waves: float, sm_count: int, cols: int, tile_n: int) -> int:
    """Rows, in 128-row tiles, whose ``128 x tile_n`` output tiles of ``cols`` columns fill ``waves`` waves."""
    return 128 * math.ceil(waves * sm_count / math.ceil(cols / tile_n))


def gemm_tuning(backend: str, arch: int | None, sm_count: int | None, embed: int, mlp: int) -> GemmTuning:
    """The GEMM tuning for a tower ``embed`` wide with an MLP ``mlp`` wide on a device of compute
    capability major ``arch`` with ``sm_count`` SMs (None, None: not a GPU).

    Split K (proj and fc2, N = ``embed``) while their 128x128 output tiles fill at most 0.55 of
    the SMs (896 rows at 1280 wide on 132 SMs), where splitting measured faster (benchmarks/HISTORY.md).
    quack's row thresholds: where a 128-row tile grid fills one wave (fc1, qkv + rotary)
    or three (plain qkv), except on the measured tower, which keeps its measured rows and bands."""
    hopper = arch in QUACK_ARCHS and sm_count is not None
    sms = sm_count or GemmTuning.sm_count
    split_rows = 128 * int(0.55 * sms // math.ceil(embed / 128)) if hopper else 0
    scale = embed / _MEASURED_K  # each wave's work grows with K
    base = dict(backend=backend, sm_count=sms, split_k_max_rows=split_rows,
                **{name: tuple((t, us * scale) for t, us in getattr(GemmTuning, name) + alternatives)
                   for name, alternatives in _ALTERNATIVES.items()})
    if hopper and (embed, mlp) == _MEASURED_SHAPE and sms == GemmTuning.sm_count:
        return GemmTuning(**base, **_MEASURED)
    return GemmTuning(**base, fc1_min_rows=_row_tiles_filling(1, sms, mlp, TILE.tile_n),
                      qkv_min_rows=_row_tiles_filling(3, sms, 3 * embed, TILE.tile_n),
                      rope_min_rows=_row_tiles_filling(1, sms, 3 * embed, TILE.tile_n))


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
    """quack's GEMM-with-activation, gated-GEMM and plain GEMM entries, and the registered
    QuickGELU's name."""
    from quack import activation
    from quack.gemm_interface import gemm_act_tuned, gemm_gated_tuned, gemm_tuned

    # quack keeps compiled kernels on disk keyed by the activation's name: name it after its
    # source, so an edit here can never load a stale kernel.
    source = inspect.getsource(_quick_gelu_epilogue).encode()
    name = f"vitgraph_quick_gelu_{hashlib.sha256(source).hexdigest()[:12]}"
    activation.act_fn_map.setdefault(name, _quick_gelu_epilogue())
    return gemm_act_tuned.fn, gemm_tuned.fn, name, gemm_gated_tuned.fn


# hidden_act -> quack's epilogue activation (None: vitgraph's QuickGELU, registered by _quack)
EPILOGUE_ACTIVATIONS = {"quick_gelu": None, "gelu_pytorch_tanh": "gelu_tanh_approx", "silu": "silu"}
GATED_EPILOGUES = {"silu": "swiglu"}  # a gated MLP's act(gate) * up


def has_epilogue(activation: str, gated: bool) -> bool:
    """Whether an MLP's first GEMM with ``activation`` (``gated``: ``act(gate) * up``) has a quack epilogue."""
    return activation in (GATED_EPILOGUES if gated else EPILOGUE_ACTIVATIONS)


def _weight_fits(weight: torch.Tensor) -> bool:
    # 16-byte aligned rows for TMA, of the weight and of an input as wide as its K; the weight
    # is used as [K, N] through a transposed view.
    return weight.is_contiguous() and weight.shape[0] % 8 == 0 and weight.shape[1] % 8 == 0


def _in_band(rows: int, band: tuple[int, int] | None) -> bool:
    return band is not None and band[0] <= rows <= band[1]


def _small(rows: int, tuning: GemmTuning) -> bool:
    """fc1 and qkv with the rotary of ``rows`` rows take quack's 64-row tiles."""
    return _in_band(rows, tuning.small_rows)


def _small_rope(rows: int, tuning: GemmTuning) -> bool:
    """qkv with the rotary of ``rows`` rows takes quack's 64-row tile."""
    return _small(rows, tuning) or _in_band(rows, tuning.rope_small_rows)


def _quack_rows(rows: int, weight: torch.Tensor, tuning: GemmTuning, min_rows: int, small=None) -> bool:
    """``small``: None, or the predicate of the rows below ``min_rows`` that take quack too."""
    return (tuning.backend == "quack" and (rows >= min_rows or (small is not None and small(rows, tuning)))
            and _weight_fits(weight))


def _quack_fits(x: torch.Tensor, weight: torch.Tensor, tuning: GemmTuning, min_rows: int, small=None) -> bool:
    return (x.is_contiguous() and x.shape[1] == weight.shape[1]
            and _quack_rows(x.shape[0], weight, tuning, min_rows, small))


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, activation: str, gated: bool,
               tuning: GemmTuning) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` through quack's GEMM with the activation in its epilogue, for
    ``x [M, K]``, ``weight [N, K]``; ``gated``: the rows of ``weight`` are ``[gate; up]`` and the
    result ``act(gate) * up`` ``[M, N/2]``. Call it only where :func:`fc1_kernel` is not None."""
    gemm_act, _, quick_gelu, gemm_gated = _quack()
    config = _gemm_config(fc1_tile(x.shape[0], weight, tuning))
    if gated:  # quack reads B's columns [gate; up] as interleaved pairs (concat_layout)
        out = torch.empty(x.shape[0], weight.shape[0] // 2, device=x.device, dtype=x.dtype)
        gemm_gated(x, weight.t(), None, out, None, bias, GATED_EPILOGUES[activation], config=config,
                   concat_layout=("B", "bias"))
        return out
    out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
    gemm_act(x, weight.t(), None, out, None, bias, EPILOGUE_ACTIVATIONS[activation] or quick_gelu, config=config)
    return out


def linear_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, activation: str, gated: bool,
                      tuning: GemmTuning) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` (``gated``: ``act(gate) * up``): quack's epilogue where
    :func:`fc1_kernel` has one, else cuBLAS and :func:`activation_pass`."""
    if x.is_contiguous() and x.shape[1] == weight.shape[1] \
            and fc1_kernel(x.shape[0], weight, tuning, activation, gated) is not None:
        return linear_act(x, weight, bias, activation, gated, tuning)
    return activation_pass(F.linear(x, weight, bias), activation, gated)


def activation_pass(f: torch.Tensor, activation: str, gated: bool) -> torch.Tensor:
    """``activation`` of a GEMM's output ``f`` (``gated``: ``f`` is ``[gate | up]``, the result
    ``act(gate) * up``): a Triton pass where there is one, else torch's ops."""
    if gated:
        if activation == "silu":
            return kernels.silu_mul(f)
        gate, up = f.split(f.shape[-1] // 2, dim=-1)
        return ACTIVATIONS[activation](gate) * up
    if activation in kernels.FUSED_ACTIVATIONS:
        return kernels.activation_(f, activation)
    return ACTIVATIONS[activation](f)


def linear_qkv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tuning: GemmTuning) -> torch.Tensor:
    """``x @ weight.T + bias``: quack's GEMM from ``tuning.qkv_min_rows`` rows, cuBLAS below."""
    if _quack_fits(x, weight, tuning, tuning.qkv_min_rows):
        gemm = _quack()[1]
        out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
        gemm(x, weight.t(), out, bias=bias, config=_gemm_config(tuning.tile))
        return out
    return F.linear(x, weight, bias)


GEMM_SETTINGS = frozenset(f"gemm.{f.name}" for f in dataclasses.fields(GemmTuning))
# What split_k_count and linear_split_k read: a tower that splits K only there reads these.
SPLIT_K_SETTINGS = frozenset({"gemm.split_k_max_rows", "gemm.split_k", "gemm.split_k_long_rows"})


def split_k_count(rows: int, k: int, tuning: GemmTuning) -> int:
    """How many slices of K :func:`linear_split_k` splits ``rows`` rows into (1: unsplit)."""
    if rows > tuning.split_k_max_rows:
        return 1
    if k >= SPLIT_K_LONG_MIN_K and rows in tuning.split_k_long_rows:
        return SPLIT_K_LONG
    return tuning.split_k


def bias_free_stream(rows: int, tuning: GemmTuning) -> bool:
    """Whether the fused forward of ``rows`` rows keeps the biases out of the residual stream:
    where proj and fc2 do not split K."""
    return tuning.bias_free and rows > tuning.split_k_max_rows


def linear_split_k(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tuning: GemmTuning
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x @ weight.T + bias`` for :func:`vitgraph.ops.kernels.add_layernorm` to add: ``(y, None)``
    with the bias applied, or, for at most ``tuning.split_k_max_rows`` rows, ``(partials, bias)``:
    ``[S, T, N]`` products of K's slices (``S``: :func:`split_k_count`) from one strided-batched
    cuBLAS GEMM over views (no copies), for twice the output tiles; the kernel sums them with
    the bias."""
    rows, k = x.shape
    splits = split_k_count(rows, k, tuning)
    if splits < 2 or k % (8 * splits) or not (x.is_contiguous() and weight.is_contiguous()):
        return F.linear(x, weight, bias), None
    xs = x.view(rows, splits, k // splits).transpose(0, 1)  # [S, T, K/S]
    ws = weight.view(weight.shape[0], splits, k // splits).permute(1, 2, 0)  # [S, K/S, N]
    return torch.bmm(xs, ws), bias


def rope_in_gemm(rows: int, weight: torch.Tensor, tuning: GemmTuning) -> bool:
    """Whether qkv of ``rows`` rows (contiguous input) takes :func:`linear_qkv_rope`, the rotary in
    the GEMM's epilogue. The per-row fp32 vectors need ``rows % 4 == 0`` (16-byte aligned rows)."""
    return _quack_rows(rows, weight, tuning, tuning.rope_min_rows, small=_small_rope) and rows % 4 == 0


def linear_qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, freq_h: torch.Tensor,
                    freq_w: torch.Tensor, pos_h: torch.Tensor, pos_w: torch.Tensor,
                    tuning: GemmTuning) -> torch.Tensor:
    """qkv with q and k rotated, padding rows (``pos_h < 0``) and v's non-finite values zeroed, one
    quack GEMM; see :func:`vitgraph.ops.gemm_rope.qkv_rope`. Call it only where :func:`rope_in_gemm`
    holds."""
    from .gemm_rope import qkv_rope

    return qkv_rope(x, weight, bias, freq_h, freq_w, pos_h, pos_w,
                    _gemm_config(rope_tile(x.shape[0], weight, tuning)))


def fc1_kernel(rows: int, weight: torch.Tensor, tuning: GemmTuning, activation: str = "quick_gelu",
               gated: bool = False) -> tuple | None:
    """The compiled kernel :func:`linear_act` runs for a contiguous input of ``rows`` rows, as a
    hashable key (equal keys: one kernel); None where the MLP's first GEMM runs on cuBLAS."""
    if not has_epilogue(activation, gated) or not _quack_rows(rows, weight, tuning, tuning.fc1_min_rows, small=_small):
        return None
    return "fc1", str(weight.dtype), fc1_tile(rows, weight, tuning), activation, gated


def qkv_kernel(rows: int, weight: torch.Tensor, tuning: GemmTuning) -> tuple | None:
    """The compiled kernel :func:`linear_qkv` runs for a contiguous input of ``rows`` rows
    (None: cuBLAS)."""
    if not _quack_rows(rows, weight, tuning, tuning.qkv_min_rows):
        return None
    return "qkv", str(weight.dtype), tuning.tile


def qkv_rope_kernel(rows: int, weight: torch.Tensor, tuning: GemmTuning) -> tuple:
    """The compiled kernel :func:`linear_qkv_rope` runs for ``rows`` rows."""
    return "qkv_rope", str(weight.dtype), rope_tile(rows, weight, tuning)


def _tiles(rows: int, cols: int, tile: Tile) -> int:
    return -(-rows // tile.tile_m) * -(-cols // tile.tile_n)


def pick_tile(rows: int, cols: int, tuning: GemmTuning, tiles) -> Tile:
    """The tile predicted fastest for ``rows x cols`` among ``tiles`` (``(tile, µs per wave)``
    pairs; a wave: one CTA per SM): one of the others where it saves ``TILE_MARGIN`` or more
    against the first, else the first. The tiles differ in N, not in the order K is summed:
    every tile gives the same bits."""
    def cost(tile: Tile, per_wave: float) -> float:
        return -(-_tiles(rows, cols, tile) // tuning.sm_count) * per_wave

    (first, wave_us), *alternatives = tiles
    default = cost(first, wave_us)
    best, best_cost = first, default
    for tile, per_wave in alternatives:
        if cost(tile, per_wave) < best_cost:
            best, best_cost = tile, cost(tile, per_wave)
    return best if best_cost <= (1 - TILE_MARGIN) * default else first


def rope_tile(rows: int, weight: torch.Tensor, tuning: GemmTuning) -> Tile:
    """qkv with the rotary (``weight [N, K]``): its 64-row tile in its bands, else the wave model's."""
    if _small_rope(rows, tuning):
        return ROPE_SMALL_TILE
    return pick_tile(rows, weight.shape[0], tuning, tuning.rope_tiles)


def fc1_tile(rows: int, weight: torch.Tensor, tuning: GemmTuning) -> Tile:
    """fc1 with QuickGELU: its 64-row tile in its band, else the wave model's."""
    if _small(rows, tuning):
        return FC1_SMALL_TILE
    return pick_tile(rows, weight.shape[0], tuning, tuning.fc1_tiles)


@functools.cache
def _gemm_config(tile: Tile):
    from quack.gemm_config import GemmConfig

    return GemmConfig(**tile._asdict(), swap_ab=False, is_dynamic_persistent=False)
