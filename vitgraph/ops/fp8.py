"""FP8 GEMMs of a block's four linears (``precision="fp8"``), fp32 accumulation, in one of two
scalings:

* rowwise: e4m3 weights with one scale per output channel, activations with one scale per row,
  through ``torch._scaled_mm`` (cuBLAS on Hopper; torch's own kernel on a CPU). A float or
  per-tensor FP8 checkpoint runs so: the fastest scaling measured on an H100 (block-128 ran
  4-16% slower at these shapes).
* grouped: a block FP8 checkpoint's own e4m3 weights with one scale per output row and 128 input
  columns (its 128x128 blocks, read per row: the tower may reorder a checkpoint's rows), and
  activations with one scale per row and 128 columns, through ``scaled_mm``'s 1x128 x 1x128
  block scaling (cuBLAS on Hopper; the same products in fp32 on a CPU). No weight is rounded twice.
  A weight whose aligned 128-row blocks share their scales (the linears the tower keeps in the
  checkpoint's row order) runs 1x128 x 128x128 instead, which an H100 ran at rowwise speed
  (1x128 x 1x128: 1.23-1.75x slower); that layout is checked against 1x128 on each weight's
  device as it is made (a wrong layout gives no error, only wrong products).

FP8 GEMMs take dimensions in multiples of 16, as the towers' widths are (Qwen2.5-VL's 3420-wide
MLP is kept padded to 3456). A row's (or group's) scale is its absolute maximum over 448, e4m3's
largest value, so a non-finite value spoils its own row only: items stay apart.

:func:`fake_quantize_rows` and :func:`fake_quantize_weight` give the same rounding in the input's
dtype: the floor every FP8 kernel shares (the reference with each GEMM's input rounded to e4m3 at
the kernel's scale granularity), against which the FP8 forward's error is judged.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_SCALE = 2.0 ** -126  # an all-zero row's scale: its e4m3 values are zeros whatever it is
ALIGN = 16  # _scaled_mm's dimensions: multiples of 16
GROUP = 128  # grouped scaling: one scale per row and 128 columns (the last group of a row may be short)
ROW_ALIGN = 16  # grouped GEMMs' rows, padded: an H100's cuBLAS refused 4095 and took 200 (HISTORY 68)


class Fp8Weight(NamedTuple):
    """A linear's e4m3 weight ``[N, K]`` and its fp32 scales: ``[1, N]`` (one per output channel)
    or, grouped, ``[N, ceil(K / GROUP)]`` laid out column-major (stride ``(1, N)``, cuBLAS's);
    ``blocks``: the same grouped scales as 128x128 blocks (:func:`block_scales`), or None."""

    q: torch.Tensor
    scale: torch.Tensor
    blocks: torch.Tensor | None = None

    @property
    def grouped(self) -> bool:
        return self.scale.shape[0] == self.q.shape[0] > 1


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> e4m3 ``[T, K]`` and fp32 ``[T, 1]`` scales, ``x ~ q * scale`` row by row."""
    xf = x.float()
    # Times 1/448 rather than over 448, and each value times its row's IEEE reciprocal rather than
    # over its scale: roundings that torch on any device and Triton share, one division per row.
    scale = (xf.abs().amax(dim=-1, keepdim=True) * (1.0 / E4M3_MAX)).clamp_min(MIN_SCALE)
    return (xf * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> e4m3 ``[T, K]`` and fp32 ``[T, ceil(K / GROUP)]`` scales (column-major, as
    cuBLAS takes them): :func:`quantize_rows` of each row's every ``GROUP`` columns."""
    rows, width = x.shape
    groups = -(-width // GROUP)
    xf = torch.nn.functional.pad(x.float(), (0, groups * GROUP - width)).view(rows, groups, GROUP)
    q, scale = quantize_rows(xf.reshape(-1, GROUP))
    q = q.view(rows, groups * GROUP)[:, :width].contiguous()
    return q, column_major(scale.view(rows, groups))


def quantize_input(x: torch.Tensor, grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 GEMM's input ``x [T, K]`` quantized as its weight is scaled: in groups or by rows."""
    return quantize_groups(x) if grouped else quantize_rows(x)


def kernel_group(grouped: bool, width: int) -> int:
    """The group a quantizing kernel takes for rows ``width`` wide: 0 (rowwise), ``GROUP``, or a row
    narrower than that whole (its power-of-two block of lanes)."""
    return min(GROUP, 1 << (width - 1).bit_length()) if grouped else 0


def column_major(scale: torch.Tensor) -> torch.Tensor:
    """``scale [R, G]`` laid out with stride ``(1, R)`` (cuBLAS's, a single row's too)."""
    out = torch.empty(scale.shape[1], scale.shape[0], device=scale.device, dtype=scale.dtype).t()
    return out.copy_(scale)


def empty_scales(rows: int, width: int, grouped: bool, device) -> torch.Tensor:
    """An FP8 kernel's scales for ``[rows, width]``: ``[rows, 1]``, or (``grouped``) ``[rows,
    ceil(width / GROUP)]`` column-major."""
    if not grouped:
        return torch.empty(rows, 1, device=device, dtype=torch.float32)
    return column_major(torch.empty(rows, -(-width // GROUP), device=device, dtype=torch.float32))


def input_rows(x: tuple[torch.Tensor, torch.Tensor], start: int, stop: int,
               grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start:stop`` of an FP8 GEMM's input pair (``grouped``: its scales column-major again)."""
    q, scale = x[0][start:stop], x[1][start:stop]
    return q, column_major(scale) if grouped else scale


def group_scales(scale: torch.Tensor, width: int) -> torch.Tensor:
    """Grouped scales ``[T, G]`` spread over their ``width`` columns: ``[T, width]``."""
    return scale.repeat_interleave(GROUP, 1)[:, :width]


def block_scales(scale: torch.Tensor) -> torch.Tensor | None:
    """Grouped scales ``[N, G]`` as cuBLAS's 128x128 blocks of the GEMM's second operand
    (``[round_up(G, 4), ceil(N / GROUP)]``, stride ``(1, round_up(G, 4))``: block ``(k, n)`` at
    ``k + n * round_up(G, 4)``), where every aligned block of ``GROUP`` rows shares its scales;
    else None."""
    rows, groups = scale.shape
    first = scale[::GROUP]  # each row block's first row
    if not torch.equal(first.repeat_interleave(GROUP, 0)[:rows], scale):
        return None
    blocks = torch.ones(first.shape[0], -(-groups // 4) * 4, device=scale.device, dtype=torch.float32)
    blocks[:, :groups] = first
    return blocks.t()


def with_blocks(weight: Fp8Weight) -> Fp8Weight:
    """A grouped weight with its :func:`block_scales` where it has them and, on CUDA, where the
    128x128 GEMM gives the 1x128 one's products on a test input (else as it was, logged)."""
    blocks = block_scales(weight.scale)
    if blocks is None or not weight.q.is_cuda:
        return weight._replace(blocks=blocks)
    disagreement = _blocks_disagree(weight, weight._replace(blocks=blocks))
    if disagreement is None:
        return weight._replace(blocks=blocks)
    logger.warning("FP8: cuBLAS's 128x128 weight scales did not give the 1x128 products for a %s weight on %s "
                   "(torch %s: %s); it runs 1x128", tuple(weight.q.shape), weight.q.device, torch.__version__,
                   disagreement)
    return weight


def _blocks_disagree(plain: Fp8Weight, blocked: Fp8Weight) -> str | None:
    """None where both GEMMs give the same products (to bf16's rounding) of a random input, else how not."""
    generator = torch.Generator(device=plain.q.device).manual_seed(0)
    pair = quantize_groups(torch.randn(32, plain.q.shape[1], device=plain.q.device, generator=generator))
    try:
        want, got = (_grouped_mm(*pair, w, None).float() for w in (plain, blocked))
    except (RuntimeError, ValueError) as err:  # a shape cuBLAS takes in 1x128 only (TORCH_CHECK_VALUE: ValueError)
        return str(err)
    difference = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    return None if difference < 1e-2 else f"relative difference {difference:.1e}"


def quantize_weight(weight: torch.Tensor, grouped: bool = False) -> Fp8Weight:
    """``weight [N, K]`` -> e4m3 ``[N, K]`` and fp32 ``[1, N]`` scales, one per output channel
    (``grouped``: ``[N, ceil(K / GROUP)]``, one per row and ``GROUP`` columns)."""
    if grouped:
        return Fp8Weight(*quantize_groups(weight))
    q, scale = quantize_rows(weight)
    return Fp8Weight(q.contiguous(), scale.reshape(1, -1).contiguous())


def fake_quantize_rows(x: torch.Tensor, grouped: bool = False) -> torch.Tensor:
    """``x`` rounded as :func:`quantize_rows` (``grouped``: :func:`quantize_groups`) rounds it,
    back in ``x``'s dtype."""
    if grouped:
        q, scale = quantize_groups(x.reshape(-1, x.shape[-1]))
        return (q.float() * group_scales(scale, x.shape[-1])).to(x.dtype).view(x.shape)
    q, scale = quantize_rows(x)
    return (q.float() * scale).to(x.dtype)


def fake_quantize_weight(weight: torch.Tensor, grouped: bool = False) -> torch.Tensor:
    q, scale, _ = quantize_weight(weight, grouped)
    spread = group_scales(scale, weight.shape[1]) if grouped else scale.reshape(-1, 1)
    return (q.float() * spread).to(weight.dtype)


def fits(linear: torch.nn.Linear) -> bool:
    """Whether ``linear``'s widths are multiples of 16 (what ``_scaled_mm`` takes)."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


def quantize_linear_(linear: torch.nn.Linear, grouped: bool = False) -> None:
    """Give ``linear`` its e4m3 weight and scales (``linear.fp8``, an :class:`Fp8Weight`): a plain
    attribute, neither in state dicts nor cast by ``Module.to`` (which would cast e4m3 too). An FP8
    checkpoint's linear keeps the checkpoint's own e4m3 values and scales (:func:`checkpoint_weight`:
    no second rounding); any other is quantized per output channel (``grouped``: per row and
    ``GROUP`` columns, beside a block checkpoint's linears). The float weight stays until
    :func:`release_float_`."""
    if released(linear):  # quantized before; its float weight is gone
        return
    own = checkpoint_weight(linear)
    weight = own if own is not None and own.grouped == grouped else quantize_weight(linear.weight.detach(), grouped)
    linear.fp8 = with_blocks(weight) if weight.grouped else weight


def check_grouped_device(device: torch.device) -> None:
    """Grouped GEMMs (1x128 x 1x128 scaling) run on Hopper (cuBLAS) or a CPU (:func:`linear_fp8`)."""
    if device.type == "cuda" and not hasattr(torch.nn.functional, "scaled_mm"):
        raise ValueError(f"precision='fp8' runs a block FP8 checkpoint's GEMMs through torch.nn.functional."
                         f"scaled_mm, which torch {torch.__version__} does not have: use precision='bf16'")
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        raise ValueError(f"precision='fp8' runs a block FP8 checkpoint's GEMMs in groups of 128 columns, which "
                         f"cuBLAS runs on Hopper only; {device} has compute capability "
                         f"{torch.cuda.get_device_capability(device)}: use precision='bf16' (dequantized)")


def runs_grouped(linears) -> bool:
    """Whether FP8 runs ``linears`` (a tower's) grouped: any is a block FP8 checkpoint's."""
    return any(block_scaled(linear) for linear in linears)


def release_float_(linear: torch.nn.Linear) -> None:
    """Drop a quantized ``linear``'s float weight (a meta tensor of its shape and dtype stays): the
    e4m3 copy alone is held, half the weight's bytes in bf16."""
    weight = linear.weight
    linear.weight = torch.nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                       requires_grad=False)


def released(linear: torch.nn.Module) -> bool:
    """Whether ``linear`` keeps only its e4m3 weight (:func:`release_float_`)."""
    return linear.weight.is_meta


def checkpoint_weight(linear: torch.nn.Module) -> Fp8Weight | None:
    """An FP8 checkpoint's e4m3 weight and scales (per-tensor: ``[1, N]``; block: grouped), taken
    back out of ``linear``'s dequantized weight by its ``checkpoint_fp8`` scales
    (:class:`vitgraph.checkpoints.fp8.CheckpointScales`); None for another linear, or one whose
    weight is no longer the checkpoint's (changed in place since, or loaded in fp16's narrow range)."""
    stored = getattr(linear, "checkpoint_fp8", None)
    if stored is None or (stored.row_scale is None and stored.group_scale is None):
        return None
    weight = linear.weight.detach()
    if stored.group_scale is not None:
        scale = stored.group_scale.float().to(weight.device)
        spread = group_scales(scale, weight.shape[1])
    else:
        scale = stored.row_scale.float().reshape(1, -1).to(weight.device)
        spread = scale.reshape(-1, 1)
    q = (weight.float() / spread).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    if not torch.equal((q.float() * spread).to(weight.dtype), weight):
        return None
    return Fp8Weight(q.contiguous(), column_major(scale) if stored.group_scale is not None else scale.contiguous())


def block_scaled(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a linear of a block-scaled FP8 checkpoint."""
    stored = getattr(module, "checkpoint_fp8", None)
    return stored is not None and stored.block is not None


def dequantize_linear_(linear: torch.nn.Linear, name: str = "linear") -> None:
    """Back to the float weight, which must not have been released."""
    if released(linear):
        raise ValueError(f"{name}'s float weight was released when it was quantized to FP8; load the "
                         f"checkpoint again for precision='bf16'")
    linear.__dict__.pop("fp8", None)


def is_quantized(linear: torch.nn.Module) -> bool:
    return getattr(linear, "fp8", None) is not None


def held_bytes(module: torch.nn.Module) -> int:
    """The bytes ``module``'s weights hold: its parameters not released, and its linears' e4m3 copies."""
    tensors = [p for p in module.parameters() if not p.is_meta]
    tensors += [t for m in module.modules() if getattr(m, "fp8", None) is not None for t in m.fp8 if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def linear_fp8(x, linear: torch.nn.Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T + b`` in FP8, ``linear`` quantized by :func:`quantize_linear_`: ``x`` a ``[T, K]``
    tensor (quantized here, as the weight is scaled) or the ``(e4m3 [T, K], fp32 scales)`` pair a
    kernel made (:mod:`vitgraph.ops.fp8_kernels`); one GEMM (its bf16 output), then ``dtype``
    (default: ``x``'s, bf16 for a pair)."""
    weight = linear.fp8
    if isinstance(x, torch.Tensor):
        dtype = dtype or x.dtype
        x = quantize_input(x, weight.grouped)
    q, scale = x
    if scale.shape[-1] != (-(-q.shape[1] // GROUP) if weight.grouped else 1):  # shapes only: no sync
        raise ValueError(f"an FP8 input's scales {tuple(scale.shape)} do not fit a "
                         f"{'grouped' if weight.grouped else 'rowwise'} weight {tuple(weight.q.shape)}")
    bias = linear.bias.to(torch.bfloat16) if linear.bias is not None else None
    if not weight.grouped:
        out = torch._scaled_mm(q, weight.q.t(), scale_a=scale, scale_b=weight.scale, bias=bias,
                               out_dtype=torch.bfloat16)
    else:
        out = _grouped_mm(q, scale, weight, bias)
    return out.to(dtype or torch.bfloat16)


def _grouped_mm(q: torch.Tensor, scale: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The grouped GEMM in bf16: cuBLAS's 1x128 x 1x128 scaling on CUDA, the same products in fp32
    elsewhere; rows padded to whole ``ROW_ALIGN`` s first."""
    rows, width = q.shape
    pad = -rows % ROW_ALIGN
    if pad:  # zero rows, unit scales: their outputs are the bias, cut off below
        q = torch.cat([q.view(torch.uint8), q.new_zeros(pad, width).view(torch.uint8)]).view(E4M3)
        scale = column_major(torch.cat([scale, scale.new_ones(pad, scale.shape[1])]))
    if q.is_cuda:
        kinds = torch.nn.functional.ScalingType
        scale_b, recipe_b = ((weight.scale, kinds.BlockWise1x128) if weight.blocks is None
                             else (weight.blocks, kinds.BlockWise128x128))
        out = torch.nn.functional.scaled_mm(q, weight.q.t(), scale, kinds.BlockWise1x128, scale_b, recipe_b,
                                            bias=bias, output_dtype=torch.bfloat16)
    else:
        out = (q.float() * group_scales(scale, width)) @ (weight.q.float() * group_scales(weight.scale, width)).t()
        out = (out if bias is None else out + bias.float()).to(torch.bfloat16)
    return out[:rows]
