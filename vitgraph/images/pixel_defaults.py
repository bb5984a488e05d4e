"""The Qwen VL processors' default image area bounds, without torch: ``vitgraph bench-serving
--help`` shows its default before torch is imported. :mod:`vitgraph.images.preprocess` imports them
from here."""

MIN_PIXELS = 56 * 56
MAX_PIXELS = 12845056  # the Hub preprocessor_config.json value for Qwen2-VL
