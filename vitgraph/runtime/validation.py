"""Input checks for ``encode``: every one runs before anything touches the GPU."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

Grid = tuple[int, int, int]


def _is_int(value) -> bool:
    if type(value) is int:  # the common case, first: this runs for every grid value of every call
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, np.integer)


def check_int(name: str, value, *, minimum: int = 1, optional: bool = False) -> None:
    """Refuse anything but an int (no bool) of at least ``minimum`` (``optional``: or None), by name."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {kind}{' or None' if optional else ''}, got {value!r}")


def normalize_grid(grid_thw, merge_size: int) -> list[Grid]:
    """``grid_thw`` as a list of ``(t, h, w)`` ints, checked."""
    if isinstance(grid_thw, (torch.Tensor, np.ndarray)):
        if isinstance(grid_thw, torch.Tensor) and grid_thw.is_meta:
            raise ValueError("grid_thw is a tensor on the meta device (it holds no values)")
        if isinstance(grid_thw, torch.Tensor) and grid_thw.layout != torch.strided:
            raise TypeError(f"grid_thw must be a dense tensor, got layout {grid_thw.layout}")
        if isinstance(grid_thw, np.ndarray):
            integer = grid_thw.dtype.kind in "iu"
        else:
            integer = not (grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex or grid_thw.dtype == torch.bool)
        if not integer:
            raise TypeError(f"grid_thw must be an integer tensor or array, got dtype {grid_thw.dtype}")
        if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must have shape [k, 3], got {list(grid_thw.shape)}")
        rows = [tuple(row) for row in grid_thw.tolist()]  # tolist() gives Python ints
    elif isinstance(grid_thw, Sequence) and not isinstance(grid_thw, (str, bytes)):
        rows = []
        for i, row in enumerate(grid_thw):
            # Fast path, first: a tuple or list of three Python ints (this runs per grid, per call).
            if type(row) in (tuple, list) and len(row) == 3:
                t, h, w = row
                if type(t) is int and type(h) is int and type(w) is int:
                    rows.append((t, h, w))
                    continue
            if isinstance(row, (torch.Tensor, np.ndarray)):
                row = row.tolist()
            if not isinstance(row, Sequence) or isinstance(row, (str, bytes)) or len(row) != 3:
                raise ValueError(f"grid_thw[{i}] must be a (t, h, w) triple, got {row!r}")
            if not all(_is_int(v) for v in row):
                raise TypeError(f"grid_thw[{i}] must hold ints, got {row!r}")
            rows.append(tuple(int(v) for v in row))
    else:
        raise TypeError(f"grid_thw must be an int tensor or array [k, 3] or a list of (t, h, w), got {type(grid_thw).__name__}")
    for i, (t, h, w) in enumerate(rows):
        if t <= 0 or h <= 0 or w <= 0:
            raise ValueError(f"grid_thw[{i}] must be positive, got (t={t}, h={h}, w={w})")
        if h % merge_size or w % merge_size:
            raise ValueError(
                f"grid_thw[{i}] h and w must be divisible by the merge size {merge_size}, got (h={h}, w={w})")
    return rows


def check_pixels(pixels, width: int) -> None:
    if not isinstance(pixels, torch.Tensor):
        raise TypeError(f"pixels must be a torch.Tensor, got {type(pixels).__name__}")
    if not (pixels.dtype.is_floating_point or pixels.dtype == torch.uint8):
        raise TypeError(f"pixels must be floating point (normalised rows) or uint8 (rows to normalise), "
                        f"got dtype {pixels.dtype}")
    if pixels.ndim != 2:
        raise ValueError(f"pixels must be 2-D [N, {width}], got shape {list(pixels.shape)}")
    if pixels.shape[1] != width:
        raise ValueError(f"pixels must have {width} values per row (C*T*P*P), got {pixels.shape[1]}")
    if pixels.device.type == "meta":
        raise ValueError("pixels is on the meta device and holds no data")


def check_rows(pixels: torch.Tensor, grids: list[Grid]) -> int:
    tokens = sum(t * h * w for t, h, w in grids)
    if pixels.shape[0] != tokens:
        raise ValueError(f"pixels has {pixels.shape[0]} rows but grid_thw sums to {tokens} (sum of t*h*w)")
    return tokens


def check_out(out, rows: int, width: int, device: torch.device, dtype: torch.dtype) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != (rows, width):
        raise ValueError(f"out must have shape [{rows}, {width}], got {list(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out must be on {device}, got {out.device}")


def check_finite_rows(pixels: torch.Tensor, grids: list[Grid], check: bool) -> None:
    """With ``check`` (``encode``'s and ``submit``'s ``check_finite=True``), refuse float rows
    holding a NaN or an inf, naming the items that hold them. Off by default: such rows are
    encoded, and only their own item's embeddings come back non-finite. The check is one
    reduction on the rows' device and one read back (uint8 rows are always finite)."""
    if not isinstance(check, bool):
        raise TypeError(f"check_finite must be a bool, got {check!r}")
    if not check or pixels.dtype == torch.uint8 or pixels.shape[0] == 0:
        return
    finite = torch.isfinite(pixels).all(dim=1)
    if bool(finite.all()):
        return
    ends = torch.tensor([t * h * w for t, h, w in grids]).cumsum(0)
    items = torch.searchsorted(ends, (~finite).nonzero().flatten().cpu(), right=True).unique().tolist()
    shown = ", ".join(f"{i} (grid_thw[{i}] = {grids[i]})" for i in items[:5])
    more = f" and {len(items) - 5} more" if len(items) > 5 else ""
    raise ValueError(f"pixels hold NaN or inf in item(s) {shown}{more}; check_finite=True refuses the call")
