"""A checkpoint's preprocessing files (``preprocessor_config.json``,
``video_preprocessor_config.json``) over its family's defaults, checked against its tower."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .loading import CheckpointFiles
from .models import family_of
from .models.config_parsing import read_json
from .preprocess import ProcessorConfig


# Processor fields the tower defines too, under the tower's name: they must agree.
SHARED_FIELDS = {"patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
                 "merge_size": "spatial_merge_size"}


def read_processor(files: CheckpointFiles, config) -> ProcessorConfig:
    """The checkpoint's preprocessing: its ``preprocessor_config.json`` over the family's
    defaults, with the fields the tower defines too taken from the tower; a file that sets one
    of those to another value than ``config.json`` is refused, naming both files."""
    return _processor_file(files.processor, family_of(config).processor, files.config, config)


def read_video_processor(files: CheckpointFiles, config, image: ProcessorConfig) -> ProcessorConfig:
    """The checkpoint's video preprocessing: its ``video_preprocessor_config.json`` over the
    family's video defaults, or over ``image`` (its image preprocessing) where the family has
    none; checked against the tower as :func:`read_processor`."""
    return _processor_file(files.video_processor, family_of(config).video_processor or image, files.config, config)


def _processor_file(path: Path | None, defaults: ProcessorConfig, config_path: Path, config) -> ProcessorConfig:
    tower = {name: getattr(config, field) for name, field in SHARED_FIELDS.items()}
    base = replace(defaults, **tower)
    if path is None:
        return base
    raw = read_json(path)
    try:
        processor = ProcessorConfig.from_dict(raw, base=base)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None
    for name, field in SHARED_FIELDS.items():
        if getattr(processor, name) != tower[name]:
            raise ValueError(f"{path} sets {name} = {getattr(processor, name)!r} but {config_path} "
                             f"sets the tower's {field} = {tower[name]!r}; they must agree")
    return processor
