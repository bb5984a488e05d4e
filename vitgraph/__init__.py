"""vitgraph: the vision encoders of the Qwen VL families (ViT + patch merger), replayed from CUDA graphs."""

from .config import VisionConfig
from .encoder import GraphedVisionEncoder
from .models.qwen2_vl import Qwen2VisionTower, VisionBatch
from .preprocess import preprocess_images, preprocess_video, smart_resize

__version__ = "0.1.0"

__all__ = ["GraphedVisionEncoder", "Qwen2VisionTower", "VisionBatch", "VisionConfig", "__version__",
           "preprocess_images", "preprocess_video", "smart_resize"]
