"""Tiny random Qwen2-VL towers, written to disk as real checkpoints in the Hugging Face layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_VISION = dict(depth=2, embed_dim=64, num_heads=4, mlp_ratio=4, hidden_size=48, hidden_act="quick_gelu",
                   patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)


def hf_tower(seed: int = 0, **overrides):
    """transformers' own vision tower with random, non-trivial weights (norms and biases included), fp32."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    cfg = Qwen2VLVisionConfig(**{**TINY_VISION, **overrides})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return randomize_(Qwen2VisionTransformerPretrainedModel(cfg).float().eval())


def randomize_(model):
    """Random, non-trivial weights in place (norm scales near 1, small biases), from torch's RNG."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.ndim == 1:  # norm scales
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
    return model


def hf_forward(model, pixels: torch.Tensor, grid_thw) -> torch.Tensor:
    grid = torch.as_tensor(grid_thw, dtype=torch.long)
    with torch.no_grad():
        out = model(pixels, grid_thw=grid)
    return getattr(out, "pooler_output", out)


def hub_config(vision: dict | None = None) -> dict:
    """A whole-model config.json as on the Hub: hub key spellings (in_chans, spatial_patch_size)."""
    v = dict(vision or TINY_VISION)
    v["in_chans"] = v.pop("in_channels")
    v["spatial_patch_size"] = v.pop("patch_size")
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
            "hidden_size": v["hidden_size"], "vision_config": v}


def vision_state(model, prefix: str = "visual.") -> dict[str, torch.Tensor]:
    return {prefix + k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def lm_state(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(32, 48, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(96, 48, generator=g),
            "lm_head.weight": torch.randn(32, 48, generator=g)}


def write_checkpoint(directory: Path, model, *, shards: int = 2, prefix: str = "visual.",
                     dtype: torch.dtype = torch.float32, vision: dict | None = None) -> Path:
    """Write config.json plus safetensors: one file, or ``shards`` files with an index.

    With several shards the vision keys are spread over the first two and the
    language-model keys sit in their own last shard, as in multi-shard Hub repos.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hub_config(vision)))
    vis = {k: v.to(dtype) for k, v in vision_state(model, prefix).items()}
    lm = lm_state()
    if shards == 1:
        save_file({**vis, **lm}, str(directory / "model.safetensors"))
        return directory
    keys = sorted(vis)
    groups = [dict(), dict()] + [dict() for _ in range(shards - 2)]
    for i, k in enumerate(keys):
        groups[i % 2][k] = vis[k]
    groups[-1].update(lm)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for name, group in zip(names, groups):
        save_file(group, str(directory / name))
        weight_map.update({k: name for k in group})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def random_pixels(grid_thw, width: int = 1176, seed: int = 0) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grid_thw)
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def diff_report(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.double() - b.double()).abs()
    return f"max abs diff {d.max().item():.3e}, mean {d.mean().item():.3e}, rel {rel_err(a, b):.3e}"


def run_eager(bank, bucket):
    """The forward a bucket's graph holds, run eagerly on the bank's static buffers."""
    with torch.inference_mode():
        return bank.model(bank.pixels_view(bucket), bank.batch_view(bucket))


def write_two_shards(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """``state`` as two safetensors shards (alternate keys) and their index, as multi-shard Hub repos."""
    keys = sorted(state)
    weight_map = {}
    for i, names in enumerate((keys[::2], keys[1::2])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in names}, str(directory / name))
        weight_map.update({k: name for k in names})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
