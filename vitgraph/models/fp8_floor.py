"""The floor of FP8's error: a tower's reference forward with each of the blocks' four GEMMs fed
e4m3-rounded inputs (one scale per row, or per row and 128 columns beside a block FP8
checkpoint's weights) and weights (one scale per output channel, or per row and 128 columns; an
FP8 checkpoint's as they are), in the tower's own dtype (fp32 for the study): what any kernel at
that scale granularity gives, whatever it accumulates in. ``precision="fp8"``'s error is judged
against it."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..ops.fp8 import checkpoint_weight, fake_quantize_rows, fake_quantize_weight, runs_grouped


@contextmanager
def fp8_floor(tower):
    """Within it, ``tower.forward_reference`` computes the floor; the weights are restored after."""
    tower.check_float_weights()
    linears = [linear for block in tower.blocks for linear in tower.block_linears(block)]
    saved = [linear.weight.data for linear in linears]
    groups = runs_grouped(linears)
    hooks = [linear.register_forward_pre_hook(lambda module, args: (fake_quantize_rows(args[0], groups),) + args[1:])
             for linear in linears]
    try:
        for linear in linears:  # an FP8 checkpoint's weights run as they are
            own = checkpoint_weight(linear)
            if own is None or own.grouped != groups:
                linear.weight.data = fake_quantize_weight(linear.weight.data, groups)
        yield tower
    finally:
        for linear, weight in zip(linears, saved):
            linear.weight.data = weight
        for hook in hooks:
            hook.remove()


def reference_and_floor(tower, pixels: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``tower``'s reference forward of ``pixels`` and, within :func:`fp8_floor`, its floor."""
    with torch.inference_mode():
        reference = tower.forward_reference(pixels, batch)
        with fp8_floor(tower):
            return reference, tower.forward_reference(pixels, batch)
