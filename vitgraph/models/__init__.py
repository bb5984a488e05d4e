"""Vision towers, one family per file, each against the engine's contract
(:mod:`vitgraph.engine.contract`). The registry maps a checkpoint's ``model_type`` to its family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import VisionConfig
from .qwen2_vl import Qwen2VisionTower, VisionBatch, expected_shapes


@dataclass(frozen=True)
class Family:
    """What loading needs to know of a family."""

    name: str
    model_types: tuple[str, ...]  # config.json's model_type values it serves
    config: type  # parses the vision_config block
    tower: type  # the nn.Module, built on the meta device and loaded with assign=True
    expected_shapes: Callable[[VisionConfig], dict[str, tuple[int, ...]]]  # checkpoint names and shapes


FAMILIES = (Family("qwen2_vl", ("qwen2_vl",), VisionConfig, Qwen2VisionTower, expected_shapes),)


def family_for(model_type: str | None) -> Family:
    """The family serving ``model_type`` (None, a config with no model_type: Qwen2-VL)."""
    if model_type is None:
        return FAMILIES[0]
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {known}")


__all__ = ["FAMILIES", "Family", "Qwen2VisionTower", "VisionBatch", "family_for"]
