"""Vision towers, one family per file, each against the engine's contract
(:mod:`vitgraph.engine.contract`). The registry maps a checkpoint's ``model_type`` to its family."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace
from typing import Callable

from ..config import QWEN2_VL_2B, TINY, VisionConfig
from ..preprocess import QWEN2_VL_PROCESSOR, QWEN3_VL_PROCESSOR, ProcessorConfig
from . import qwen2_5_vl, qwen3_vl
from .qwen2_5_vl import Qwen25VisionConfig, Qwen25VisionTower
from .qwen3_vl import Qwen35VisionConfig, Qwen3VisionConfig, Qwen3VisionTower
from .qwen2_vl import Qwen2VisionTower, VisionBatch, expected_shapes


@dataclass(frozen=True)
class Family:
    """What loading needs to know of a family."""

    name: str
    model_types: tuple[str, ...]  # config.json's model_type values it serves
    config: type  # parses the vision_config block
    tower: type  # the nn.Module, built on the meta device and loaded with assign=True
    expected_shapes: Callable[[VisionConfig], dict[str, tuple[int, ...]]]  # checkpoint names and shapes
    processor: ProcessorConfig = QWEN2_VL_PROCESSOR  # image preprocessing where a checkpoint has no config of its own
    video_processor: ProcessorConfig | None = None  # video preprocessing defaults; None: the image processor's


# Qwen3-VL's (and Qwen3.5's, Qwen3.6's) published video_preprocessor_config.json: size
# {shortest_edge: 4096, longest_edge: 25165824}, patch 16, temporal 2, merge 2, mean/std 0.5.
QWEN3_VL_VIDEO_PROCESSOR = replace(QWEN3_VL_PROCESSOR, min_pixels=4096, max_pixels=25165824)

FAMILIES = (Family("qwen2_vl", ("qwen2_vl",), VisionConfig, Qwen2VisionTower, expected_shapes),
            Family("qwen2_5_vl", ("qwen2_5_vl",), Qwen25VisionConfig, Qwen25VisionTower,
                   qwen2_5_vl.expected_shapes),
            Family("qwen3_vl", ("qwen3_vl", "qwen3_vl_moe"), Qwen3VisionConfig, Qwen3VisionTower,
                   qwen3_vl.expected_shapes, QWEN3_VL_PROCESSOR, QWEN3_VL_VIDEO_PROCESSOR),
            # Qwen3-VL's tower with no deepstack mergers: the same module, an empty deepstack list.
            Family("qwen3_5", ("qwen3_5", "qwen3_5_moe", "qwen4_exp"), Qwen35VisionConfig, Qwen3VisionTower,
                   qwen3_vl.expected_shapes, QWEN3_VL_PROCESSOR, QWEN3_VL_VIDEO_PROCESSOR))


def _qwen25(out_hidden_size: int) -> Qwen25VisionConfig:
    return Qwen25VisionConfig(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420,
                              out_hidden_size=out_hidden_size, window_size=112, fullatt_block_indexes=(7, 15, 23, 31))


# Random-weight towers of the released shapes (the 2.5 sizes share one tower and differ in
# the merger's output width), for demos and benchmarks.
PRESETS = {"qwen2-vl-2b": QWEN2_VL_2B, "tiny": TINY,
           "qwen2.5-vl-3b": _qwen25(2048), "qwen2.5-vl-7b": _qwen25(3584), "qwen2.5-vl-32b": _qwen25(5120),
           "qwen2.5-vl-72b": _qwen25(8192),
           "qwen3-vl-2b": Qwen3VisionConfig(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096,
                                            out_hidden_size=2048, deepstack_visual_indexes=(5, 11, 17)),
           "qwen3-vl-8b": Qwen3VisionConfig(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                                            out_hidden_size=4096, deepstack_visual_indexes=(8, 16, 24)),
           "qwen3-vl-32b": Qwen3VisionConfig(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                                             out_hidden_size=5120, deepstack_visual_indexes=(8, 16, 24)),
           # Qwen/Qwen3.6-27B's published config.json (model_type qwen3_5): vision_config depth 27,
           # width 1152, MLP 4304, 16 heads, out_hidden_size 5120, deepstack_visual_indexes [].
           "qwen3.6-27b": Qwen35VisionConfig(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                                             out_hidden_size=5120)}


def family_of(config) -> Family:
    """The family whose config class ``config`` is (its own class first: Qwen3.5's derives from Qwen3-VL's)."""
    for family in FAMILIES:
        if type(config) is family.config:
            return family
    for family in FAMILIES:
        if isinstance(config, family.config):
            return family
    raise TypeError(f"config must be one of {[f.config.__name__ for f in FAMILIES]}, got {type(config).__name__}")


def family_for(model_type: str | None) -> Family:
    """The family serving ``model_type`` (None, a config with no model_type: Qwen2-VL)."""
    if model_type is None:
        return FAMILIES[0]
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {known}")


__all__ = ["FAMILIES", "PRESETS", "Family", "Qwen25VisionConfig", "Qwen25VisionTower", "Qwen35VisionConfig",
           "Qwen3VisionConfig",
           "Qwen3VisionTower", "Qwen2VisionTower", "VisionBatch",
           "family_for", "family_of"]
