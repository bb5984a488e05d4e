"""vitgraph: the vision encoders of the Qwen VL families (ViT plus patch merger), replayed from
CUDA graphs. Importing a part costs only that part: the names below load on first use."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {"GraphedVisionEncoder": ".runtime.encoder", "EncoderClosed": ".runtime.coalesce",
            "VisionConfig": ".models.qwen2_vl", "Qwen2VisionTower": ".models.qwen2_vl",
            "VisionBatch": ".models.qwen2_vl",
            "preprocess_images": ".images.preprocess", "preprocess_video": ".images.preprocess",
            "smart_resize": ".images.preprocess"}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'vitgraph' has no attribute {name!r}")
