"""Reading a family's ``vision_config`` block: hub spellings, rope parameters, required fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
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
