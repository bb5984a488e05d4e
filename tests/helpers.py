"""Tiny random towers of every family, transformers' reference tower, checkpoints written to
disk in the Hugging Face layout, and the helpers the CUDA suites share (their fixtures, which
take a ``family`` fixture of the test module, are in conftest.py)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vitgraph.models import family_for

TINY_VISION = dict(depth=2, embed_dim=64, num_heads=4, mlp_ratio=4, hidden_size=48, hidden_act="quick_gelu",
                   patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)


@dataclass(frozen=True)
class TinyFamily:
    """A family's (or a released layout's) tiny towers: ``model_type``, its vision_config at
    CUDA size (head_dim 80 as Qwen2-VL's and Qwen2.5-VL's, 72 as Qwen3-VL-8B's: captured in
    seconds), at CPU size where CPU tests use one (milliseconds), and the seed of the random
    weights of transformers' tower the CUDA suites load."""

    model_type: str
    cuda: dict
    cpu: dict | None = None
    seed: int = 3


_QWEN25 = dict(hidden_act="silu", patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
_QWEN3 = dict(hidden_act="gelu_pytorch_tanh", patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
              in_channels=3)
_QWEN25_CUDA = dict(depth=4, hidden_size=320, num_heads=4, intermediate_size=640, out_hidden_size=256,
                    window_size=112, fullatt_block_indexes=[0, 3], **_QWEN25)
_QWEN3_CUDA = dict(depth=3, hidden_size=288, num_heads=4, intermediate_size=576, out_hidden_size=128,
                   num_position_embeddings=64, deepstack_visual_indexes=[0, 2], **_QWEN3)
_QWEN3_CPU = dict(depth=3, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=32,
                  num_position_embeddings=64, deepstack_visual_indexes=[0, 2], **_QWEN3)


def _without_deepstack(vision: dict) -> dict:
    """Qwen3.5's tower: Qwen3-VL's with no deepstack merger (its configs may have no such field)."""
    return {k: v for k, v in vision.items() if k != "deepstack_visual_indexes"}


# Qwen2.5: full attention in the first and last blocks, windows in between (CPU: windows of 4 x 4
# patches); Qwen3: a deepstack merger after the first block and after the last, and an 8 x 8
# position grid. The "released" layouts start with a plain block as released checkpoints do
# (Qwen2.5-VL's full attention at 7, 15, 23, 31; Qwen3-VL's mergers after 8, 16, 24): a
# capture's warm-up must reach the other kind. Qwen3.5: Qwen3-VL's tower with no deepstack merger.
TINY_FAMILIES = {
    "qwen2_vl": TinyFamily("qwen2_vl", dict(TINY_VISION, depth=3, embed_dim=320, hidden_size=256), TINY_VISION,
                           seed=2),
    "qwen2_5_vl": TinyFamily("qwen2_5_vl", _QWEN25_CUDA,
                             dict(depth=3, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=48,
                                  window_size=56, fullatt_block_indexes=[0, 2], **_QWEN25)),
    "qwen3_vl": TinyFamily("qwen3_vl", _QWEN3_CUDA, _QWEN3_CPU),
    "qwen2_5_vl_released": TinyFamily("qwen2_5_vl", dict(_QWEN25_CUDA, fullatt_block_indexes=[3])),
    "qwen3_vl_released": TinyFamily("qwen3_vl", dict(_QWEN3_CUDA, depth=4, deepstack_visual_indexes=[1, 3])),
    "qwen3_5": TinyFamily("qwen3_5", _without_deepstack(_QWEN3_CUDA), _without_deepstack(_QWEN3_CPU)),
}


def reference_classes(model_type: str, reference: tuple[str, str] | None = None):
    """transformers' tower and config classes of ``model_type``'s family: the registry's
    ``reference`` row (the classes vitgraph.models.transformers_tower builds), or ``reference``."""
    return tuple(getattr(importlib.import_module(module), name)
                 for module, name in (ref.split(":") for ref in reference or family_for(model_type).reference))


def hf_tower(model_type: str = "qwen2_vl", vision: dict | None = None, seed: int = 0,
             reference: tuple[str, str] | None = None, **overrides):
    """transformers' own vision tower of ``model_type``'s family (``vision``, default the tiny
    Qwen2-VL, with ``overrides``) with random, non-trivial weights (norms and biases included),
    fp32, sdpa: the one way tests build the reference tower."""
    model_cls, config_cls = reference_classes(model_type, reference)
    cfg = config_cls(**{**(TINY_VISION if vision is None else vision), **overrides})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return randomize_(model_cls(cfg).float().eval())


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
    """transformers' tower's output in vitgraph's layout (Qwen3: main, then each deepstack feature)."""
    grid = torch.as_tensor(grid_thw, dtype=torch.long)
    with torch.no_grad():
        out = model(pixels, grid_thw=grid)
    if getattr(out, "deepstack_features", None):
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
    return getattr(out, "pooler_output", out)


QWEN2_TYPES = ("qwen2_vl", "qwen2_5_vl")  # their hub configs spell patch_size spatial_patch_size


def hub_config(vision: dict | None = None, model_type: str = "qwen2_vl", top: dict | None = None) -> dict:
    """A whole-model config.json as on the Hub: ``model_type``, ``top`` (default for Qwen2-VL its
    architectures and hidden_size) and ``vision`` (default the tiny Qwen2-VL) under vision_config,
    in hub key spellings: in_chans, and Qwen2's spatial_patch_size."""
    v = dict(TINY_VISION if vision is None else vision)
    v["in_chans"] = v.pop("in_channels")
    if model_type in QWEN2_TYPES:
        v["spatial_patch_size"] = v.pop("patch_size")
    if top is None and model_type == "qwen2_vl":
        top = {"architectures": ["Qwen2VLForConditionalGeneration"], "hidden_size": v["hidden_size"]}
    return {"model_type": model_type, **(top or {}), "vision_config": v}


def vision_state(model, prefix: str = "visual.") -> dict[str, torch.Tensor]:
    return {prefix + k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def lm_state(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(32, 48, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(96, 48, generator=g),
            "lm_head.weight": torch.randn(32, 48, generator=g)}


def write_checkpoint(directory: Path, model, *, model_type: str = "qwen2_vl", vision: dict | None = None,
                     prefix: str = "visual.", shards: int = 2, dtype: torch.dtype = torch.float32,
                     lm: dict | None = None, top: dict | None = None, **overrides) -> Path:
    """A hub-layout checkpoint of any family, the one writer the tests use: config.json
    (:func:`hub_config` of ``model_type``, ``vision`` with ``overrides``, ``top``) plus
    safetensors: one file, or ``shards`` files with an index.

    ``model`` is a tower (its state dict goes under ``prefix``, in ``dtype``) or a dict of
    tensors written under their own keys. ``lm`` (default :func:`lm_state`; ``{}`` for none)
    are the language model's keys. With several shards the vision keys are spread over the
    first two and the language-model keys sit in the last shard, as in multi-shard Hub repos
    (with three or more: a shard of their own, which a loader must never open).
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = hub_config({**(TINY_VISION if vision is None else vision), **overrides}, model_type, top)
    (directory / "config.json").write_text(json.dumps(config))
    if isinstance(model, torch.nn.Module):
        vis = {k: v.to(dtype) for k, v in vision_state(model, prefix).items()}
    else:
        vis = {k: v.contiguous() for k, v in model.items()}
    lm = lm_state() if lm is None else lm
    if shards == 1:
        save_file({**vis, **lm}, str(directory / "model.safetensors"))
        return directory
    keys = sorted(vis)
    groups = [dict(), dict()] + [dict() for _ in range(shards - 2)]
    for i, k in enumerate(keys):
        groups[i % 2][k] = vis[k]
    groups[-1].update(lm)
    write_shards(directory, groups, {"metadata": {}})
    return directory


def write_shards(directory: Path, groups: list[dict[str, torch.Tensor]], index: dict | None = None) -> None:
    """Each of ``groups`` as a safetensors shard, and their index (``index``'s fields besides the weight map)."""
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        save_file(group, str(directory / name))
        weight_map.update({k: name for k in group})
    (directory / "model.safetensors.index.json").write_text(json.dumps({**(index or {}), "weight_map": weight_map}))


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


def assert_replays_equal_eager(bank, seed: int = 0) -> None:
    """Each bucket of ``bank`` with random frames loaded: its replay equals the eager forward on
    the same buffers, bit for bit."""
    import random

    rng = random.Random(seed)
    for bucket in bank.buckets:
        _, tokens = load_random_frames(bank, bucket, rng)
        replayed = bank.replay(bucket)[:tokens // 4].clone()
        assert torch.equal(replayed, run_eager(bank, bucket)[:tokens // 4]), bucket.name


def assert_nan_item_keeps_to_its_rows(enc, grids, item: int, seed: int) -> torch.Tensor:
    """``enc.encode`` of ``grids`` with item ``item``'s pixels NaN: every other item's rows bitwise
    as with clean pixels. Returns the NaN item's rows."""
    sizes = [t * h * w for t, h, w in grids]
    start, unit = sum(sizes[:item]), enc.tower.merge_unit
    pixels = random_pixels(grids, enc.tower.input_width, seed).to(enc.device)
    clean = enc.encode(pixels, grids)
    pixels[start:start + sizes[item]] = float("nan")
    got = enc.encode(pixels, grids)
    rows = slice(start // unit, (start + sizes[item]) // unit)
    assert torch.equal(got[:rows.start], clean[:rows.start]) and torch.equal(got[rows.stop:], clean[rows.stop:])
    return got[rows]


def write_two_shards(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """``state`` as two safetensors shards (alternate keys) and their index, as multi-shard Hub repos."""
    keys = sorted(state)
    write_shards(directory, [{k: state[k] for k in names} for names in (keys[::2], keys[1::2])])


# The CUDA suites' encoders: a packed and a one-frame (dense) bucket per budget.
BUDGETS = [64, 128, 256, 512, 1024]
MAX_ITEMS = 8


def cuda_backends(names):
    """``names`` as parameters, each skipped with a reason where this machine's GPU lacks it."""
    from vitgraph.ops.attention import available_backends

    here = available_backends("cuda") if torch.cuda.is_available() else ()
    return [pytest.param(b, marks=pytest.mark.skipif(b not in here,
                                                     reason=f"needs the {b} attention backend on a CUDA GPU"))
            for b in names]


PACKED = cuda_backends(("fa4", "cudnn", "varlen"))  # every packed backend


def family_weights(family: str, size: str = "cuda"):
    """(transformers' tower, its state dict under visual., the config) of ``TINY_FAMILIES[family]``."""
    tiny = TINY_FAMILIES[family]
    vision = getattr(tiny, size)
    model = hf_tower(tiny.model_type, vision, seed=tiny.seed)
    return model, vision_state(model), {"model_type": tiny.model_type, "vision_config": vision}


# -- The CPU tests' hub-layout checkpoints of every family -------------------------------------

def _qwen35(module: str, name: str) -> tuple[str, str]:
    """transformers' tower and config classes ``{name}Model`` / ``{name}Config`` of ``module``."""
    package = f"transformers.models.{module}"
    return f"{package}.modeling_{module}:{name}Model", f"{package}.configuration_{module}:{name}Config"


@dataclass(frozen=True)
class TinyCheckpoint:
    """A tiny tower of ``family`` (a key of TINY_FAMILIES) as a hub-layout checkpoint: its
    config.json's ``model_type``, the vision config (default the family's CPU size), the
    tower's key prefix, the shards, what the checkpoint's vision_config says of itself besides
    (``vision_extra``), config.json's other fields (``top``), transformers' classes where not
    the registry's (``reference``), and the seed of the random weights."""

    family: str
    model_type: str
    vision: dict | None = None
    prefix: str = "visual."
    shards: int = 2
    vision_extra: dict = field(default_factory=dict)
    top: dict | None = None
    reference: tuple[str, str] | None = None
    seed: int = 0

    @property
    def config(self) -> dict:
        """The tower's vision config (without ``vision_extra``)."""
        return TINY_FAMILIES[self.family].cpu if self.vision is None else self.vision

    def tower(self):
        return hf_tower(self.model_type, self.config, seed=self.seed, reference=self.reference)

    def write(self, directory: Path, model, **options) -> Path:
        """``model`` as this checkpoint in ``directory`` (``options``: :func:`write_checkpoint`'s)."""
        options = {"model_type": self.model_type, "vision": {**self.config, **self.vision_extra},
                   "prefix": self.prefix, "shards": self.shards, "top": self.top, **options}
        return write_checkpoint(directory, model, **options)


# Qwen2.5-VL at CPU size with Qwen2.5's own windows of 8 x 8 patches (4 x 4 merged tokens) and
# full attention in the first and last of four blocks.
QWEN25_CPU_WINDOWS = dict(depth=4, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=48,
                          window_size=112, fullatt_block_indexes=[0, 3], **_QWEN25)
_QWEN35_TEXT = {"text_config": {"hidden_size": 32}}
# Each family as released checkpoints lay it out: Qwen2-VL's tower under visual. with the language
# model's keys in the last shard (the "checkpoint" fixture), Qwen2.5-VL's with them in a shard of
# their own, Qwen3-VL's under model.visual.; Qwen3.5's three kinds (Qwen3.5, Qwen3.6, Qwen4-Exp),
# each with transformers' own class and as its vision_config names itself (the first two in the
# old style: the parent's model_type).
TINY_CHECKPOINTS = {
    "qwen2_vl": TinyCheckpoint("qwen2_vl", "qwen2_vl"),
    "qwen2_5_vl": TinyCheckpoint("qwen2_5_vl", "qwen2_5_vl", QWEN25_CPU_WINDOWS, shards=3),
    "qwen3_vl": TinyCheckpoint("qwen3_vl", "qwen3_vl", prefix="model.visual."),
    "qwen3_5": TinyCheckpoint("qwen3_5", "qwen3_5", prefix="model.visual.", top=_QWEN35_TEXT,
                              vision_extra={"model_type": "qwen3_5", "deepstack_visual_indexes": []},
                              reference=_qwen35("qwen3_5", "Qwen3_5Vision")),
    "qwen3_5_moe": TinyCheckpoint("qwen3_5", "qwen3_5_moe", prefix="visual.", top=_QWEN35_TEXT,
                                  vision_extra={"model_type": "qwen3_vl"},
                                  reference=_qwen35("qwen3_5_moe", "Qwen3_5MoeVision")),
    "qwen4_exp": TinyCheckpoint("qwen3_5", "qwen4_exp", prefix="model.visual.", top=_QWEN35_TEXT,
                                vision_extra={"model_type": "qwen4_exp_vision"},
                                reference=_qwen35("qwen4_exp", "Qwen4ExpVision")),
}
QWEN35_KINDS = [name for name, tiny in TINY_CHECKPOINTS.items() if tiny.family == "qwen3_5"]

# The grids each family's CPU tests encode (Qwen2.5: windows cut by the frames' edges; Qwen3:
# frames smaller and larger than the 8 x 8 position grid).
FAMILY_GRIDS = {
    "qwen2_vl": {
        "one_image": [(1, 4, 6)],
        "images_of_different_aspect": [(1, 4, 6), (1, 8, 2), (1, 2, 10), (1, 6, 6)],
        "video": [(3, 4, 4)],
        "mixed_images_and_video": [(1, 6, 4), (2, 4, 2), (1, 2, 2), (4, 2, 6)],
        "minimal_grid": [(1, 2, 2)],
    },
    "qwen2_5_vl": {
        "edge-cut windows": [(1, 10, 14)],  # 5 x 7 merged tokens: windows of 4 x 4 cut by both edges
        "several images": [(1, 16, 16), (1, 4, 6), (1, 12, 20)],
        "video": [(3, 8, 12)],
        "mixed": [(1, 6, 10), (2, 16, 8), (1, 2, 2)],
        "minimal": [(1, 2, 2)],
    },
    "qwen3_vl": {
        "smaller than the position grid": [(1, 4, 6)],
        "larger than the position grid": [(1, 20, 12)],
        "several images": [(1, 8, 8), (1, 2, 2), (1, 16, 10)],
        "video": [(3, 6, 8)],
        "mixed": [(1, 10, 4), (2, 4, 4), (1, 2, 2)],
        "minimal": [(1, 2, 2)],
    },
    "qwen3_5": {
        "smaller than the position grid": [(1, 4, 6)],
        "larger than the position grid": [(1, 20, 12)],
        "video": [(3, 6, 8)],
        "mixed": [(1, 10, 4), (2, 4, 4), (1, 2, 2)],
        "minimal": [(1, 2, 2)],
    },
}


class TinyCheckpoints:
    """Each TINY_CHECKPOINTS entry's transformers tower, its checkpoint folder under ``root`` and
    a CPU fp32 encoder of that folder, each built on first use and kept (conftest.py's
    session fixture ``tiny_checkpoints``): tests read them and change none of them; a test that
    changes a checkpoint's files writes its own copy (:meth:`write`)."""

    def __init__(self, root: Path):
        self.root = root
        self._models, self._folders, self._encoders = {}, {}, {}

    def model(self, name: str):
        if name not in self._models:
            self._models[name] = TINY_CHECKPOINTS[name].tower()
        return self._models[name]

    def checkpoint(self, name: str) -> Path:
        if name not in self._folders:
            self._folders[name] = self.write(name, self.root / name)
        return self._folders[name]

    def encoder(self, name: str):
        from vitgraph import GraphedVisionEncoder

        if name not in self._encoders:
            self._encoders[name] = GraphedVisionEncoder.from_pretrained(self.checkpoint(name), device="cpu",
                                                                        dtype=torch.float32)
        return self._encoders[name]

    def write(self, name: str, directory: Path, **options) -> Path:
        """A new copy of ``name``'s checkpoint (of its shared tower) in ``directory``."""
        return TINY_CHECKPOINTS[name].write(directory, self.model(name), **options)


def make(weights, **options):
    """An encoder of ``weights`` (:func:`family_weights`), by default on CUDA in bf16 with the
    suites' buckets. One-frame buckets on every backend (FA4's defaults capture none), so their
    path stays tested. No routing to a faster next bucket unless asked: these small models
    replay in microseconds, where timing noise would pick the buckets the tests expect."""
    from vitgraph import GraphedVisionEncoder

    _, state, config = weights
    tuning = {"buckets.dense_max_tokens": BUDGETS[-1], "routing.faster_buckets": False, **(options.pop("tuning", None) or {})}
    options = {"device": "cuda", "dtype": torch.bfloat16, "budgets": BUDGETS, "max_items": MAX_ITEMS,
               "progress": False, "tuning": tuning, **options}
    return GraphedVisionEncoder.from_state_dict(state, config, **options)


def random_grids(rng, n, max_frames=3, max_side=16):
    """Even sides of 2..max_side patches: most are no multiple of Qwen2.5's 8-patch window, so
    windows are cut by the frame's edge."""
    return [(rng.choice([1] * 4 + list(range(2, max_frames + 1))), 2 * rng.randint(1, max_side // 2),
             2 * rng.randint(1, max_side // 2)) for _ in range(n)]


def pixels_for(enc, grids, seed, device=None, dtype=torch.float32) -> torch.Tensor:
    """Random pixel rows of ``grids`` at ``enc``'s patch width (drawn on the CPU from ``seed``), on
    ``device`` (default ``enc``'s)."""
    return random_pixels(grids, enc.tower.input_width, seed).to(enc.device if device is None else device, dtype)


def load_random_frames(bank, bucket, rng):
    """Load random frames filling about 3/4 of ``bucket`` into its buffers; returns (grids, tokens)."""
    grids = []
    while True:
        g = random_grids(rng, 1, max_frames=1, max_side=min(16, int(bucket.tokens ** 0.5)))[0]
        if (sum(t * h * w for t, h, w in grids) + g[1] * g[2] > 0.75 * bucket.tokens
                or len(grids) == bucket.max_segments):
            break
        grids.append(g)
    return load_frames(bank, bucket, grids or [(1, 2, 2)])


def load_frames(bank, bucket, grids):
    """Load random pixels of ``grids`` into ``bucket``'s buffers; returns (grids, tokens)."""
    from vitgraph.engine.planner import padded_batch

    tokens = sum(t * h * w for t, h, w in grids)
    pixels = random_pixels(grids, width=bank.static_pixels.shape[1], seed=bucket.tokens).cuda().bfloat16()
    bank.load(bucket, pixels, bank.stage(padded_batch(bank.model, bucket, grids)))
    return grids, tokens


def png_bytes(size, color) -> bytes:
    """An encoded PNG of ``size`` (width, height) in one ``color``."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


# -- A Ray Serve instance for the modules that deploy on a real cluster (conftest's serve_cluster) --

SERVE_REQUEST_TIMEOUT_S = 20  # the proxy answers any request within this (408), whatever happens to its replica


class ServeCluster:
    """A local Ray instance (2 CPUs) with Serve's HTTP proxy on 127.0.0.1:``port``, requests
    timing out after ``request_timeout_s``."""

    def __init__(self, request_timeout_s: float = SERVE_REQUEST_TIMEOUT_S):
        import socket

        import ray
        from ray import serve

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.request_timeout_s = f"http://127.0.0.1:{self.port}", request_timeout_s
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": self.port,
                                      "request_timeout_s": request_timeout_s})
        except BaseException:
            ray.shutdown()
            raise
        self.up = True

    def close(self):
        if self.up:
            import ray
            from ray import serve

            self.up = False
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
