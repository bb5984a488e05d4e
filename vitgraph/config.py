"""The vision-tower configuration, read from a checkpoint's ``config.json``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# Hub configs and transformers' own config spell two fields differently; accept both.
_ALIASES = {"in_chans": "in_channels", "spatial_patch_size": "patch_size"}
_SUPPORTED_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu")
# Ceilings far above every released tower (depth 24-32, widths 1024-1280), so that a broken
# or hostile config fails here and not deep inside torch (or after minutes of building).
_CEILINGS = {"depth": 1024, "embed_dim": 65536, "num_heads": 1024, "hidden_size": 65536, "patch_size": 64,
             "temporal_patch_size": 16, "spatial_merge_size": 8, "in_channels": 16}
MAX_MLP_DIM = 1 << 18


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


@dataclass(frozen=True)
class VisionConfig(TowerShape):
    """Shape of a Qwen2-VL vision tower (the ``vision_config`` block)."""

    depth: int = 32
    embed_dim: int = 1280
    num_heads: int = 16
    mlp_ratio: float = 4.0
    hidden_size: int = 1536  # merger output width = the LLM's width
    hidden_act: str = "quick_gelu"
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name, ceiling in _CEILINGS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= ceiling:
                raise ValueError(f"vision_config.{name} must be an int in [1, {ceiling}], got {value!r}")
        for name in ("mlp_ratio", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"vision_config.{name} must be a positive finite number, got {value!r}")
        if not 0 < self.mlp_dim <= MAX_MLP_DIM:
            raise ValueError(f"vision_config: embed_dim * mlp_ratio (the MLP width) must be in [1, {MAX_MLP_DIM}], "
                             f"got {self.embed_dim} * {self.mlp_ratio}")
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"vision_config.embed_dim ({self.embed_dim}) must be divisible by "
                f"vision_config.num_heads ({self.num_heads})")
        if self.head_dim % 4:
            # 2-D rotary splits each head into h and w halves, each rotated in pairs.
            raise ValueError(f"vision_config head_dim (embed_dim/num_heads = {self.head_dim}) must be divisible by 4")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in _SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"vision_config.hidden_act must be one of {_SUPPORTED_ACTIVATIONS}, got {self.hidden_act!r}")

    @property
    def mlp_dim(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "VisionConfig":
        """Build from a ``vision_config`` dict, or a whole ``config.json`` dict that holds one."""
        if not isinstance(raw, dict):
            raise TypeError(f"config must be a dict (a config.json object), got {type(raw).__name__}")
        block = raw.get("vision_config", raw)
        if not isinstance(block, dict):
            raise ValueError(f"config.vision_config must be a JSON object, got {type(block).__name__}")
        values: dict[str, Any] = {}
        for key, value in block.items():
            if not isinstance(key, str):
                raise ValueError(f"vision_config keys must be strings, got {key!r}")
            name = _ALIASES.get(key, key)
            if name in values and values[name] != value:
                raise ValueError(f"vision_config sets both {key!r} and {name!r} with different values")
            values[name] = value
        rope = values.pop("rope_parameters", None)
        if isinstance(rope, dict) and "rope_theta" in rope:
            values.setdefault("rope_theta", rope["rope_theta"])
        required = ("depth", "embed_dim", "num_heads", "hidden_size")
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"vision_config is missing required field(s): {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_json_file(cls, path: str | Path) -> "VisionConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None


# The real Qwen2-VL-2B tower, for random-weight demos and benchmarks.
QWEN2_VL_2B = VisionConfig(hidden_size=1536)
# A tiny tower that runs in milliseconds on a CPU.
TINY = VisionConfig(depth=2, embed_dim=64, num_heads=4, hidden_size=48)
PRESETS = {"qwen2-vl-2b": QWEN2_VL_2B, "tiny": TINY}
