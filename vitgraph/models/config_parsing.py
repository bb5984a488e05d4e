"""Reading a family's ``vision_config`` block: hub spellings, rope parameters, required fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from ..checkpoints.files import read_regular_file
from ..images.preprocess import QWEN2_VL_PROCESSOR, ProcessorConfig

_ALIASES = {"in_chans": "in_channels", "spatial_patch_size": "patch_size"}


def vision_values(raw: dict[str, Any], known: set[str], required: tuple[str, ...],
                  tuple_fields: tuple[str, ...] = ()) -> dict[str, Any]:
    """The known fields of ``raw``'s ``vision_config`` (or of ``raw`` itself), under their
    transformers names; lists become tuples for ``tuple_fields``."""
    if not isinstance(raw, dict):
        raise TypeError(f"config must be a dict (a config.json object), got {type(raw).__name__}")
    block = raw.get("vision_config", raw)
    if not isinstance(block, dict):
        raise ValueError(f"config.vision_config must be a JSON object, got {type(block).__name__}")
    values: dict[str, Any] = {}
    for key, value in block.items():
        name = _ALIASES.get(key, key) if isinstance(key, str) else key
        if name in values and values[name] != value:
            raise ValueError(f"vision_config sets both {key!r} and {name!r} with different values")
        values[name] = value
    rope = values.pop("rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        values.setdefault("rope_theta", rope["rope_theta"])
    missing = [name for name in required if name not in values]
    if missing:
        raise ValueError(f"vision_config is missing required field(s): {', '.join(missing)}")
    for name in tuple_fields:
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    return {k: v for k, v in values.items() if k in known}


MAX_JSON_BYTES = 16 << 20  # configs are KBs and shard indexes ~100 KB: far above any real one


def read_json(path: str | Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A JSON file's value; a ValueError naming the file for anything else than a regular file
    of at most ``max_bytes`` (:func:`vitgraph.checkpoints.files.read_regular_file`) holding JSON that Python
    can hold (no deep nesting, no huge ints)."""
    path = Path(path)
    data = read_regular_file(path, max_bytes, "a JSON config")
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON: nested too deeply") from None
    except ValueError as err:  # bad JSON, bad UTF-8, an integer of thousands of digits
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def check_ints(config, ceilings: dict[str, int]) -> None:
    for name, ceiling in ceilings.items():
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= ceiling:
            raise ValueError(f"vision_config.{name} must be an int in [1, {ceiling}], got {value!r}")


def check_positive_number(name: str, value) -> None:
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"vision_config.{name} must be a positive finite number, got {value!r}")


def check_block_indexes(name: str, blocks, depth: int) -> None:
    if (not isinstance(blocks, tuple) or any(isinstance(i, bool) or not isinstance(i, int) for i in blocks)
            or any(not 0 <= i < depth for i in blocks) or len(set(blocks)) != len(blocks)):
        raise ValueError(f"vision_config.{name} must be distinct block indexes in [0, {depth}), got {blocks!r}")


class TowerShape:
    """What every family's config derives from its fields (``embed_dim``: the tower's width)."""

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_width(self) -> int:
        """Values per input row: C * T * P * P (1176 for patch 14, 1536 for patch 16)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patch tokens per merged output row (4)."""
        return self.spatial_merge_size ** 2


class FamilyConfig:
    """What the families' frozen config dataclasses share: the common checks (on ``embed_dim``,
    the tower's width: ``hidden_size`` unless a family names it otherwise) and reading from
    ``config.json``. Subclasses set ``CEILINGS``, ``REQUIRED`` and ``TUPLES`` and add their own
    checks in ``check``."""

    FAMILY: ClassVar[str]  # its family's name (vitgraph.models.FAMILIES)
    # The preprocessing where a checkpoint has no config of its own (video: None, the image one's).
    PROCESSOR: ClassVar[ProcessorConfig] = QWEN2_VL_PROCESSOR
    VIDEO_PROCESSOR: ClassVar[ProcessorConfig | None] = None

    CEILINGS: dict[str, int] = {}
    REQUIRED: tuple[str, ...] = ()
    TUPLES: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from ..ops.activations import ACTIVATIONS

        check_ints(self, self.CEILINGS)
        check_positive_number("rope_theta", self.rope_theta)
        width = "embed_dim" if "embed_dim" in self.__dataclass_fields__ else "hidden_size"
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            # 2-D rotary splits each head into h and w halves, each rotated in pairs.
            raise ValueError(f"vision_config.{width} ({self.embed_dim}) must split into num_heads "
                             f"({self.num_heads}) heads whose width is divisible by 4")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}")
        self.check()

    def check(self) -> None:
        """A family's own checks."""

    @property
    def embed_dim(self) -> int:
        return self.hidden_size

    def transformers_fields(self) -> dict[str, Any]:
        """The fields of transformers' vision config class for this family (its reference)."""
        from dataclasses import asdict

        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k != "rope_theta"}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]):
        from dataclasses import fields

        return cls(**vision_values(raw, {f.name for f in fields(cls)}, cls.REQUIRED, cls.TUPLES))

    @classmethod
    def from_json_file(cls, path: str | Path):
        try:
            return cls.from_dict(read_json(path))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None
