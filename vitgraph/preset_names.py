"""The preset names, without importing torch: ``vitgraph --help`` and argument errors list them
instantly. tests/test_cli_errors.py checks they equal ``vitgraph.models.PRESETS``' keys."""

PRESET_NAMES = ("qwen2-vl-2b", "qwen2.5-vl-32b", "qwen2.5-vl-3b", "qwen2.5-vl-72b", "qwen2.5-vl-7b",
                "qwen3-vl-2b", "qwen3-vl-32b", "qwen3-vl-8b", "qwen3.5-1024", "qwen3.5-1152", "qwen3.5-768",
                "qwen3.6-27b", "qwen4-exp", "tiny")
