"""Vision towers. Each exposes the small contract the graph engine relies on (see Qwen2VisionTower)."""

from .qwen2_vl import Qwen2VisionTower, VisionBatch

__all__ = ["Qwen2VisionTower", "VisionBatch"]
