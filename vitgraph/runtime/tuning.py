"""Tuning as data: every threshold, tile and switch an encoder runs by, derived from its device
and its tower's widths (:func:`derive_tuning`), changed by name where a caller asks
(``EngineOptions(tuning={"gemm.split_k_max_rows": 0})``) and held by the encoder
(``encoder.tuning``). Two encoders in one process may differ; nothing here is a module global."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..engine.routing import RoutingTuning
from ..ops.attention import AttentionTuning, attention_tuning
from ..ops.gemm import GemmTuning, Tile, gemm_tuning
from ..ops.kernels import NormTuning, norm_tuning
from ..ops.tuning import KernelTuning


@dataclass(frozen=True)
class BucketTuning:
    """Which buckets beside each budget's packed one an encoder captures."""

    dense: bool = True  # one-frame buckets: a single frame replays with dense attention
    # The largest dense bucket. None: up to EngineOptions.exact_eager_above, and none with fa4,
    # whose packed buckets win for single frames.
    dense_max_tokens: int | None = None
    short_frames: bool = True  # fa4 on Hopper: a packed bucket per budget for short frames (128-row tiles)


@dataclass(frozen=True)
class PlanTuning:
    """How the encoder plans calls and caches the plans."""

    cache_entries: int = 4096  # plans kept, keyed by the call's grids
    cache_bytes: int = 64 << 20  # their staged metadata (12 bytes per token)


@dataclass(frozen=True)
class Tuning:
    gemm: GemmTuning = field(default_factory=GemmTuning)
    norms: NormTuning = field(default_factory=NormTuning)
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    buckets: BucketTuning = field(default_factory=BucketTuning)
    routing: RoutingTuning = field(default_factory=RoutingTuning)
    plans: PlanTuning = field(default_factory=PlanTuning)

    @property
    def kernels(self) -> KernelTuning:
        """What the tower's kernels read."""
        return KernelTuning(self.gemm, self.norms, self.attention)


def device_arch(device: torch.device) -> tuple[int | None, int | None]:
    """A CUDA device's compute capability major and SM count; (None, None) elsewhere."""
    if device.type != "cuda":
        return None, None
    from ..ops.attention import arch_and_sm_count

    return arch_and_sm_count(device)


def derive_tuning(shape, device: torch.device, overrides: Mapping[str, Any] | None = None,
                  tower=None) -> Tuning:
    """The tuning for a tower of ``shape``'s widths (its contract's ``TowerDims``) on ``device``,
    with ``overrides`` applied (see :func:`apply_overrides`). The GEMM backend is cuBLAS until
    the encoder resolves its own. ``tower``: the kernel settings it does not read (its ``tuning_reads``) keep their defaults,
    and changing one is a ``ValueError``."""
    reads = getattr(tower, "tuning_reads", None)
    return tuning_for(shape, *device_arch(device), overrides, reads=reads, owner=_owner(tower))


def check_reads(overrides: Mapping[str, Any] | None, tower) -> None:
    """Refuse, naming them, overrides of kernel settings ``tower`` (a tower or its class) never
    reads; before any weight is loaded."""
    reads = getattr(tower, "tuning_reads", None)
    if reads is not None:
        _refuse_unread(overrides or {}, reads, _owner(tower))


def _refuse_unread(overrides: Mapping[str, Any], reads: frozenset[str], owner: str) -> None:
    unread = sorted(str(name) for name in overrides if not _read(str(name), reads))
    if unread:
        raise ValueError(f"tuning: the {owner} does not read {', '.join(map(repr, unread))}; "
                         f"of the kernel settings it reads {', '.join(sorted(reads))}")


def _owner(tower) -> str:
    return tower.__name__ if isinstance(tower, type) else type(tower).__name__


def tuning_for(shape, arch: int | None, sm_count: int | None, overrides: Mapping[str, Any] | None = None,
               reads: frozenset[str] | None = None, owner: str = "the tower") -> Tuning:
    """:func:`derive_tuning` for a GPU of compute capability major ``arch`` with ``sm_count``
    SMs (None, None: not a GPU), whichever device this process has; ``reads`` as a tower's
    ``tuning_reads`` (None: every setting)."""
    tuning = Tuning(gemm=gemm_tuning("cublas", arch, sm_count, shape.embed_dim, shape.mlp_width),
                    norms=norm_tuning(arch), attention=attention_tuning(arch, sm_count, shape.head_dim))
    overrides = overrides or {}
    tuning = apply_overrides(tuning, overrides)  # unknown names and bad values first
    if reads is not None:
        _refuse_unread(overrides, reads, owner)  # so resetting the unread settings undoes no override
        tuning = _unread_to_defaults(tuning, reads)
    return tuning


KERNEL_GROUPS = ("gemm", "norms", "attention")  # what a tower reads; the other groups the engine reads


def _read(name: str, reads: frozenset[str]) -> bool:
    group = name.partition(".")[0]
    return group not in KERNEL_GROUPS or group in reads or name in reads


def _unread_to_defaults(tuning: Tuning, reads: frozenset[str]) -> Tuning:
    """``tuning`` with each kernel setting a tower does not read at its default, so that the
    encoder shows no threshold derived for a kernel its tower never calls."""
    for group_name in KERNEL_GROUPS:
        group = getattr(tuning, group_name)
        defaults = type(group)()
        kept = {f.name: getattr(group, f.name) for f in dataclasses.fields(group)
                if _read(f"{group_name}.{f.name}", reads) or f"{group_name}.{f.name}" in _FIXED}
        tuning = dataclasses.replace(tuning, **{group_name: dataclasses.replace(defaults, **kept)})
    return tuning


_FIXED = ("gemm.backend",)  # chosen by EngineOptions.gemm, not by name
_OPTIONAL_COUNTS = ("buckets.dense_max_tokens",)  # a positive int or None
_POSITIVE = ("gemm.sm_count", "attention.sm_count")  # the wave models divide by them


def check_overrides(overrides) -> None:
    """Refuse an overrides mapping :func:`apply_overrides` would refuse, before any device is known."""
    if not isinstance(overrides, Mapping):
        raise ValueError(f"tuning must be a mapping of dotted names to values or None, got {overrides!r}")
    apply_overrides(Tuning(), overrides)


def apply_overrides(tuning: Tuning, overrides: Mapping[str, Any]) -> Tuning:
    """``tuning`` with each ``"group.field": value`` of ``overrides`` set (lists read as tuples, as
    they come back from JSON). An unknown name or a value of another kind is a ``ValueError``."""
    for name, value in overrides.items():
        group_name, _, field_name = str(name).partition(".")
        group = getattr(tuning, group_name, None) if group_name in _groups() else None
        if group is None or field_name not in {f.name for f in dataclasses.fields(group)} or name in _FIXED:
            raise ValueError(f"tuning: unknown setting {name!r}; known: {sorted(_names())}")
        value = _coerce(name, getattr(group, field_name), value)
        tuning = dataclasses.replace(tuning, **{group_name: dataclasses.replace(group, **{field_name: value})})
    return tuning


def _groups() -> set[str]:
    return {f.name for f in dataclasses.fields(Tuning)}


def _names() -> list[str]:
    defaults = Tuning()
    return [f"{g}.{f.name}" for g in _groups() for f in dataclasses.fields(getattr(defaults, g))
            if f"{g}.{f.name}" not in _FIXED]


def _coerce(name: str, current, value):
    """``value`` as the kind of setting ``current`` is, or a ``ValueError`` naming ``name``."""
    def bad() -> ValueError:
        return ValueError(f"tuning[{name!r}] must be like {current!r}, got {value!r}")

    if name in _OPTIONAL_COUNTS:
        if value is None or (_number(value) and isinstance(value, int) and value >= 1):
            return value
        raise bad()
    if isinstance(current, bool) or isinstance(value, bool):
        if not (isinstance(current, bool) and isinstance(value, bool)):
            raise bad()
        return value
    if isinstance(current, Tile):
        return _tile(value, bad)
    if isinstance(current, (int, float)):
        if not isinstance(value, (int, float)) or (isinstance(current, int) and not isinstance(value, int)):
            raise bad()
        if name in _POSITIVE and value < 1:
            raise bad()
        return value
    if isinstance(current, str):
        if not isinstance(value, str):
            raise bad()
        return value
    if value is None or isinstance(value, (list, tuple)):  # tuples, optional ones included
        if name.endswith("_tiles"):  # (Tile, µs per wave) pairs, the default tile's first
            pairs = [pair for pair in value or () if isinstance(pair, (list, tuple)) and len(pair) == 2]
            if not pairs or len(pairs) != len(value) or not all(_number(us) for _, us in pairs):
                raise bad()
            return tuple((_tile(tile, bad), float(us)) for tile, us in pairs)
        converted = _tuples(value)
        if not _numbers(converted):
            raise bad()
        return converted
    raise bad()


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _numbers(value) -> bool:
    """Every leaf of a nested tuple is a number, a bool or None (what tuple settings hold)."""
    if isinstance(value, tuple):
        return all(_numbers(v) for v in value)
    return value is None or isinstance(value, (int, float))


def _tile(value, bad) -> Tile:
    """A :class:`Tile` from its fields as a sequence or a mapping: positive ints, a bool ``pingpong``."""
    try:
        if isinstance(value, Mapping):
            tile = Tile(**value)
        elif isinstance(value, (list, tuple)):
            tile = Tile(*value)
        else:
            raise bad()
    except TypeError:
        raise bad() from None
    sizes = [v for k, v in tile._asdict().items() if k != "pingpong"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes) \
            or not isinstance(tile.pingpong, bool):
        raise bad()
    return tile


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
