"""FP8 GEMMs of a block's four linears (``precision="fp8"``): e4m3 weights with one scale per
output channel, e4m3 activations with one scale per row, fp32 accumulation, through
``torch._scaled_mm`` (cuBLAS on Hopper; torch's own kernel on a CPU).

Rowwise scaling was the fastest of the scalings measured on an H100 (block-128 ran 4-16% slower
at these shapes). ``_scaled_mm`` takes dimensions in multiples of 16; the towers' widths are
(Qwen2.5-VL's 3420-wide MLP is kept padded to 3456). A row's scale is its absolute maximum over
448, e4m3's largest value, so a non-finite value spoils its own row only: items stay apart.

:func:`fake_quantize_rows` and :func:`fake_quantize_weight` give the same rounding in the input's
dtype: the floor every FP8 kernel shares (the reference with each GEMM's input rounded to e4m3 at
the kernel's scale granularity), against which the FP8 forward's error is judged.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_SCALE = 2.0 ** -126  # an all-zero row's scale: its e4m3 values are zeros whatever it is
ALIGN = 16  # _scaled_mm's dimensions: multiples of 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> e4m3 ``[T, K]`` and fp32 ``[T, 1]`` scales, ``x ~ q * scale`` row by row."""
    xf = x.float()
    # Times 1/448 rather than over 448, and each value times its row's IEEE reciprocal rather than
    # over its scale: roundings that torch on any device and Triton share, one division per row.
    scale = (xf.abs().amax(dim=-1, keepdim=True) * (1.0 / E4M3_MAX)).clamp_min(MIN_SCALE)
    return (xf * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> e4m3 ``[N, K]`` and fp32 ``[1, N]`` scales, one per output channel."""
    q, scale = quantize_rows(weight)
    return q.contiguous(), scale.reshape(1, -1).contiguous()


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as :func:`quantize_rows` rounds it, back in ``x``'s dtype."""
    q, scale = quantize_rows(x)
    return (q.float() * scale).to(x.dtype)


def fake_quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_weight(weight)
    return (q.float() * scale.reshape(-1, 1)).to(weight.dtype)


def fits(linear: torch.nn.Linear) -> bool:
    """Whether ``linear``'s widths are multiples of 16 (what ``_scaled_mm`` takes)."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


def quantize_linear_(linear: torch.nn.Linear) -> None:
    """Give ``linear`` its e4m3 weight ``[N, K]`` and per-channel scales ``[1, N]`` (``linear.fp8``): a
    plain attribute, neither in state dicts nor cast by ``Module.to`` (which would cast e4m3 too).
    A per-tensor FP8 checkpoint's linear keeps the checkpoint's own e4m3 values and scales
    (:func:`checkpoint_weight`): no second rounding. The float weight stays until :func:`release_float_`."""
    if block_scaled(linear):  # set_precision refuses these first, naming the linear
        raise ValueError("a block-scaled FP8 weight has no exact per-channel form")
    if released(linear):  # quantized before; its float weight is gone
        return
    linear.fp8 = checkpoint_weight(linear) or quantize_weight(linear.weight.detach())


def release_float_(linear: torch.nn.Linear) -> None:
    """Drop a quantized ``linear``'s float weight (a meta tensor of its shape and dtype stays): the
    e4m3 copy alone is held, half the weight's bytes in bf16."""
    weight = linear.weight
    linear.weight = torch.nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                       requires_grad=False)


def released(linear: torch.nn.Module) -> bool:
    """Whether ``linear`` keeps only its e4m3 weight (:func:`release_float_`)."""
    return linear.weight.is_meta


def checkpoint_weight(linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A per-tensor FP8 checkpoint's e4m3 weight and ``[1, N]`` scales, taken back out of
    ``linear``'s dequantized weight by its ``checkpoint_fp8`` row scales
    (:class:`vitgraph.checkpoints.fp8.CheckpointScales`); None for another linear, or one whose
    weight is no longer the checkpoint's (changed in place since, or loaded in fp16's narrow range)."""
    stored = getattr(linear, "checkpoint_fp8", None)
    if stored is None or stored.row_scale is None:
        return None
    weight = linear.weight.detach()
    scale = stored.row_scale.float().reshape(-1, 1).to(weight.device)
    q = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    if not torch.equal((q.float() * scale).to(weight.dtype), weight):
        return None
    return q.contiguous(), scale.reshape(1, -1).contiguous()


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
    tensors += [t for m in module.modules() if getattr(m, "fp8", None) is not None for t in m.fp8]
    return sum(t.numel() * t.element_size() for t in tensors)


def linear_fp8(x, linear: torch.nn.Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T + b`` in FP8, ``linear`` quantized by :func:`quantize_linear_`: ``x`` a ``[T, K]``
    tensor (its rows quantized here) or the ``(e4m3 [T, K], fp32 [T, 1])`` pair a kernel made
    (:mod:`vitgraph.ops.fp8_kernels`); one ``_scaled_mm`` (rowwise scales give bf16), then ``dtype``
    (default: ``x``'s, bf16 for a pair)."""
    if isinstance(x, torch.Tensor):
        dtype = dtype or x.dtype
        x = quantize_rows(x)
    q, scale = x
    weight, weight_scale = linear.fp8
    bias = linear.bias.to(torch.bfloat16) if linear.bias is not None else None
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, bias=bias, out_dtype=torch.bfloat16)
    return out.to(dtype or torch.bfloat16)
