"""A checkpoint's preprocessing files, checked against its tower.

Found and read as transformers finds and reads them: a processor nested in
``processor_config.json`` (as transformers 5 saves it) first; else ``preprocessor_config.json``
for images, and ``video_preprocessor_config.json``, then ``preprocessor_config.json``, for
videos. What a file leaves out takes the default of the transformers class that reads it; a
checkpoint without a file gets the family's published settings."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..checkpoints.loading import CheckpointFiles
from ..models import family_of
from ..models.config_parsing import read_json
from .preprocess import ProcessorConfig


# Processor fields the tower defines too, under the tower's name: they must agree.
SHARED_FIELDS = {"patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
                 "merge_size": "spatial_merge_size"}


def read_processor(files: CheckpointFiles, config) -> ProcessorConfig:
    """The checkpoint's image preprocessing over the family's defaults, with the fields the tower
    defines too taken from the tower; a file that sets one of those to another value than
    ``config.json`` is refused, naming both files."""
    source = _nested(files.processors, "image_processor") or _whole(files.processor)
    defaults = family_of(config).processor if source is None else IMAGE_CLASS
    return _processor(source, defaults, files.config, config)


def read_video_processor(files: CheckpointFiles, config) -> ProcessorConfig:
    """The checkpoint's video preprocessing over the family's video defaults (its image ones
    where it has none: Qwen2-VL, Qwen2.5-VL); checked as :func:`read_processor`. Where the file
    names the other kind of Qwen video processor (per frame or per clip), the checkpoint loads
    and its videos are refused (``refused``: the message), its images served."""
    family = family_of(config)
    published = family.video_processor or family.processor
    source = (_nested(files.processors, "video_processor") or _whole(files.video_processor)
              or _whole(files.processor))
    if source is None:
        return _processor(None, published, files.config, config)
    kind = next(name for name, cls in VIDEO_CLASSES.items() if cls.clip_pixels == published.clip_pixels)
    if isinstance(source[1], dict):
        check_sampling(*source)
    refusal = _video_class_refusal(source, kind) if isinstance(source[1], dict) else None
    if refusal is not None:  # the images load; a call given a video is refused with this message
        return replace(_processor(None, published, files.config, config), refused=refusal)
    return _processor(source, VIDEO_CLASSES[kind], files.config, config)


# The defaults of the transformers classes that read the files (patch sizes come from the tower):
# Qwen2VLImageProcessor for every family's images, and the two Qwen video processors.
IMAGE_CLASS = ProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
VIDEO_CLASSES = {
    "Qwen2VLVideoProcessor": ProcessorConfig(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768),
    "Qwen3VLVideoProcessor": ProcessorConfig(min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768,
                                             image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                                             clip_pixels=True, max_video_tokens=768),
}


# Frame sampling. transformers' video processors pick frames from a clip where do_sample_frames
# is set (Qwen3VLVideoProcessor's default: 2 of each 24 frames, 4 to 768 frames; Qwen2-VL's: off).
# vitgraph encodes every frame it is given: a caller samples first. These fields are not
# followed, but a hostile value is refused by name, as transformers would fail on it.
SAMPLING_COUNTS = ("num_frames", "min_frames", "max_frames")


def check_sampling(name: str, raw: dict) -> None:
    """A video processor file's ``do_sample_frames``, ``fps`` and frame counts: each absent,
    null or of its kind (a bool; a positive finite number; positive ints, min <= max)."""
    value = raw.get("do_sample_frames")
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}: do_sample_frames must be true, false or null, got {value!r}")
    value = raw.get("fps")
    if value is not None and not _positive_finite(value):
        raise ValueError(f"{name}: fps must be a positive finite number or null, got {value!r}")
    for field in SAMPLING_COUNTS:
        value = raw.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: {field} must be a positive int or null, got {value!r}")
    low, high = raw.get("min_frames"), raw.get("max_frames")
    if low is not None and high is not None and low > high:
        raise ValueError(f"{name}: min_frames ({low}) must not exceed max_frames ({high})")


def _positive_finite(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value > 0 and (isinstance(value, int) or math.isfinite(value))


def _video_class_refusal(source: tuple[str, dict], kind: str) -> str | None:
    """Why vitgraph must not read this checkpoint's videos, or None: transformers reads videos
    with the class a file names (``video_processor_type``, else its ``image_processor_type``
    with Image -> Video where such a class exists; else the model's)."""
    name, raw = source
    named = raw.get("video_processor_type") or str(raw.get("image_processor_type") or "").replace(
        "ImageProcessor", "VideoProcessor")
    if named in VIDEO_CLASSES and named != kind:
        return (f"{name}: transformers would read this checkpoint's videos with {named}, which sizes "
                f"{'whole clips' if VIDEO_CLASSES[named].clip_pixels else 'each frame'}; vitgraph reads "
                f"this family's videos with {kind}. Add a video_preprocessor_config.json for {kind}")
    return None


def _nested(path: Path | None, key: str) -> tuple[str, Any] | None:
    """``(name, value)`` of ``key`` in ``processor_config.json``, where it is there."""
    if path is None:
        return None
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a processor config must be a JSON object, got {type(raw).__name__}")
    return (f"{path} ({key})", raw[key]) if key in raw else None


def _whole(path: Path | None) -> tuple[str, Any] | None:
    return None if path is None else (str(path), read_json(path))


def _processor(source: tuple[str, Any] | None, defaults: ProcessorConfig, config_path: Path,
               config) -> ProcessorConfig:
    tower = {name: getattr(config, field) for name, field in SHARED_FIELDS.items()}
    base = replace(defaults, **tower)
    if source is None:
        return base
    name, raw = source
    try:
        processor = ProcessorConfig.from_dict(raw, base=base)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name}: {err}") from None
    for field_name, field in SHARED_FIELDS.items():
        if getattr(processor, field_name) != tower[field_name]:
            raise ValueError(f"{name} sets {field_name} = {getattr(processor, field_name)!r} but {config_path} "
                             f"sets the tower's {field} = {tower[field_name]!r}; they must agree")
    return processor
