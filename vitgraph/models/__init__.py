"""Vision towers, one family per file, each against the engine's contract
(:mod:`vitgraph.engine.contract`). The registry maps a checkpoint's ``model_type`` to its family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..images.preprocess import ProcessorConfig
from . import qwen2_5_vl, qwen3_vl
from .qwen2_5_vl import Qwen25VisionConfig, Qwen25VisionTower
from .qwen3_vl import QWEN3_VL_VIDEO_PROCESSOR, Qwen35VisionConfig, Qwen3VisionConfig, Qwen3VisionTower
from .qwen2_vl import Qwen2VisionTower, VisionBatch, VisionConfig, expected_shapes
from .tower_base import one_block_recipe, tower_dims


@dataclass(frozen=True)
class Family:
    """Everything the rest of vitgraph knows of a family: one row of :data:`FAMILIES`."""

    model_types: tuple[str, ...]  # config.json's model_type values it serves
    config: type  # parses the vision_config block; names the family and its default preprocessing
    tower: type  # the nn.Module, built on the meta device and loaded with assign=True
    expected_shapes: Callable[[VisionConfig], dict[str, tuple[int, ...]]]  # checkpoint names and shapes
    # transformers' tower and its config class ("module:Class"): the numerical oracle of tests and benchmarks
    reference: tuple[str, str]
    prefixes: tuple[str, ...] = ("model.visual.", "visual.")  # where checkpoints keep the tower's weights, longest first

    @property
    def name(self) -> str:
        return self.config.FAMILY

    @property
    def processor(self) -> ProcessorConfig:
        """Image preprocessing where a checkpoint has no config of its own."""
        return self.config.PROCESSOR

    @property
    def video_processor(self) -> ProcessorConfig | None:
        """Video preprocessing defaults; None: the image processor's."""
        return self.config.VIDEO_PROCESSOR


_HF = "transformers.models."
FAMILIES = (Family(("qwen2_vl",), VisionConfig, Qwen2VisionTower, expected_shapes,
                   (_HF + "qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel",
                    _HF + "qwen2_vl.configuration_qwen2_vl:Qwen2VLVisionConfig")),
            Family(("qwen2_5_vl",), Qwen25VisionConfig, Qwen25VisionTower, qwen2_5_vl.expected_shapes,
                   (_HF + "qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
                    _HF + "qwen2_5_vl.configuration_qwen2_5_vl:Qwen2_5_VLVisionConfig")),
            Family(("qwen3_vl", "qwen3_vl_moe"), Qwen3VisionConfig, Qwen3VisionTower,
                   qwen3_vl.expected_shapes, (_HF + "qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
                                              _HF + "qwen3_vl.configuration_qwen3_vl:Qwen3VLVisionConfig")),
            # Qwen3-VL's tower with no deepstack mergers: the same module, an empty deepstack list.
            Family(("qwen3_5", "qwen3_5_moe", "qwen4_exp"), Qwen35VisionConfig, Qwen3VisionTower,
                   qwen3_vl.expected_shapes, (_HF + "qwen3_5.modeling_qwen3_5:Qwen3_5VisionModel",
                                              _HF + "qwen3_5.configuration_qwen3_5:Qwen3_5VisionConfig")))
# Where checkpoints keep a tower's weights, every family's spelling, longest first.
VISION_PREFIXES = tuple(sorted({p for f in FAMILIES for p in f.prefixes}, key=len, reverse=True))


def _qwen25(out_hidden_size: int) -> Qwen25VisionConfig:
    return Qwen25VisionConfig(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420,
                              out_hidden_size=out_hidden_size, window_size=112, fullatt_block_indexes=(7, 15, 23, 31))


# The Qwen3.5 tower of each width (SPEC): 768 wide: 12 blocks of 12 heads, MLP 3072; 1024: 24 of
# 16, MLP 4096; 1152: 27 of 16, MLP 4304. No deepstack mergers.
_QWEN35_TOWERS = {768: (12, 12, 3072), 1024: (24, 16, 4096), 1152: (27, 16, 4304)}


def _qwen35(width: int, out_hidden_size: int) -> Qwen35VisionConfig:
    depth, heads, mlp = _QWEN35_TOWERS[width]
    return Qwen35VisionConfig(depth=depth, hidden_size=width, num_heads=heads, intermediate_size=mlp,
                              out_hidden_size=out_hidden_size)


# Random-weight towers of the released shapes (the 2.5 sizes share one tower and differ in
# the merger's output width), for demos and benchmarks.
PRESETS = {"qwen2-vl-2b": VisionConfig(hidden_size=1536),  # the real Qwen2-VL-2B tower
           "tiny": VisionConfig(depth=2, embed_dim=64, num_heads=4, hidden_size=48),  # milliseconds on a CPU
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
           "qwen3.6-27b": _qwen35(1152, 5120),
           # The Qwen3.5 tower's three widths (SPEC, "The Qwen3 tower's three widths"), named by width:
           # the merger's output width differs by model and a checkpoint sets its own.
           "qwen3.5-768": _qwen35(768, 1024),  # Qwen3.5-0.8B's tower
           "qwen3.5-1024": _qwen35(1024, 2048),  # Qwen3.5-2B/4B's tower (4B: out 2560)
           "qwen3.5-1152": _qwen35(1152, 5120),  # Qwen3.5-27B's tower
           # transformers' Qwen4ExpVisionConfig defaults: the 1152-wide tower, out 3584.
           "qwen4-exp": _qwen35(1152, 3584)}


def family_of(config) -> Family:
    """The family whose config class ``config`` is (its own class first: Qwen3.5's derives from Qwen3-VL's)."""
    for family in FAMILIES:
        if type(config) is family.config:
            return family
    for family in FAMILIES:
        if isinstance(config, family.config):
            return family
    raise TypeError(f"config must be one of {[f.config.__name__ for f in FAMILIES]}, got {type(config).__name__}")


def one_block_tower(family: str, config: dict, device, dtype):
    """The tower :func:`one_block_recipe` (:mod:`vitgraph.models.tower_base`) describes, with
    random weights, on ``device``."""
    import torch

    family = next(f for f in FAMILIES if f.name == family)
    with torch.device(device):
        tower = family.tower(family.config.from_dict(config))
    return tower.to(dtype=dtype).eval().requires_grad_(False)


def transformers_tower(config, state_dict, inv_freq=None):
    """transformers' tower of ``config``'s family (sdpa) holding ``state_dict`` (the tower's
    own names), or None without transformers: the one way tests and benchmarks build the oracle."""
    import importlib

    import torch

    family = family_of(config)
    try:
        model_cls, config_cls = (getattr(importlib.import_module(ref.split(":")[0]), ref.split(":")[1])
                                 for ref in family.reference)
    except ImportError:
        return None
    hf_config = config_cls(**config.transformers_fields())
    hf_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = model_cls(hf_config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    if inv_freq is not None:  # vitgraph keeps the rotary frequencies in fp32 whatever the dtype
        model.rotary_pos_emb.inv_freq = inv_freq.clone()
    return model.eval().requires_grad_(False)


def family_for(model_type: str | None) -> Family:
    """The family serving ``model_type`` (None, a config with no model_type: Qwen2-VL)."""
    if model_type is None:
        return FAMILIES[0]
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {known}")


__all__ = ["FAMILIES", "PRESETS", "VISION_PREFIXES", "Family", "Qwen25VisionConfig", "Qwen25VisionTower", "Qwen35VisionConfig",
           "Qwen3VisionConfig", "Qwen3VisionTower", "Qwen2VisionTower", "VisionBatch", "VisionConfig",
           "family_for", "family_of", "one_block_recipe", "one_block_tower", "tower_dims", "transformers_tower"]
