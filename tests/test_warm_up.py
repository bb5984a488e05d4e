"""A capture's warm-up (``tower.warm_up``) reaches every kind of block and merger a forward
runs, in the released layouts where block 0 is no sample of the others: Qwen2.5-VL's full
attention at 7, 15, 23, 31 (block 0 windowed), Qwen3-VL's deepstack mergers after 8, 16, 24
(none after block 0). Recorded on the modules that run and the attention layouts they ask for."""

import dataclasses
import re

import pytest
import torch

import vitgraph.models.qwen3_vl
import vitgraph.models.fused_loop
import vitgraph.models.tower_base
from vitgraph.models import PRESETS
from vitgraph.models import Qwen25VisionConfig, Qwen35VisionConfig, Qwen3VisionConfig
from vitgraph.models.qwen2_5_vl import Qwen25VisionTower
from vitgraph.models.qwen2_vl import Qwen2VisionTower
from vitgraph.models.qwen3_vl import Qwen3VisionTower

pytestmark = pytest.mark.slow  # every tiny family built and warmed up: a minute on 2 cores

SMALL = dict(hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=16)
TOWERS = {
    "qwen2_vl": lambda: Qwen2VisionTower(PRESETS["tiny"]),
    "qwen2_5_vl released": lambda: Qwen25VisionTower(Qwen25VisionConfig(
        depth=32, window_size=112, fullatt_block_indexes=(7, 15, 23, 31), **SMALL)),
    "qwen3_vl released": lambda: Qwen3VisionTower(Qwen3VisionConfig(
        depth=27, num_position_embeddings=64, deepstack_visual_indexes=(8, 16, 24), **SMALL)),
    "qwen3_5": lambda: Qwen3VisionTower(Qwen35VisionConfig(depth=27, num_position_embeddings=64, **SMALL)),
}
GRIDS = [(1, 10, 14), (2, 4, 6), (1, 2, 2)]  # windows cut by a frame's edge, a video, the minimal grid


def kind(cfg, i: int) -> str:
    """A block's kind from its config alone: what the forward does differently for it."""
    if i in getattr(cfg, "fullatt_block_indexes", ()):
        return "full attention"
    if hasattr(cfg, "fullatt_block_indexes"):
        return "window attention"
    return "deepstack tap" if i in getattr(cfg, "deepstack_visual_indexes", ()) else "plain"


def record(tower, monkeypatch):
    """Run-time record: block indexes (the reference path) and mergers that ran, attention
    layouts asked for (every path), deepstack mergers the fused path ran."""
    seen = {"blocks": [], "mergers": set(), "layouts": set()}
    reference_block = tower.reference_block

    def block_ran(block, *args):
        seen["blocks"].append(next(i for i, b in enumerate(tower.blocks) if b is block))
        return reference_block(block, *args)

    monkeypatch.setattr(tower, "reference_block", block_ran)
    for name, module in tower.named_modules():
        if name == "merger" or re.fullmatch(r"deepstack_merger_list\.\d+", name):
            module.register_forward_hook(lambda *_, name=name: seen["mergers"].add(name))

    def recording(attend):
        def wrapped(backend, q, k, v, segments, **kwargs):
            seen["layouts"].add((segments.max_seqlen, tuple(segments.cu_seqlens.tolist())))
            return attend(backend, q, k, v, segments, **kwargs)
        return wrapped

    for module in (vitgraph.models.tower_base, vitgraph.models.fused_loop):
        monkeypatch.setattr(module, "attend", recording(module.attend))
    merge_fused = vitgraph.models.qwen3_vl._merge_fused

    def merge(merger, x, tuning, offset=None):
        seen["mergers"].add(next(n for n, m in tower.named_modules() if m is merger))
        return merge_fused(merger, x, tuning, offset)

    monkeypatch.setattr(vitgraph.models.qwen3_vl, "_merge_fused", merge)
    return seen


def run(tower, monkeypatch, warm_up: bool):
    torch.manual_seed(0)
    batch = tower.build_batch(GRIDS, num_tokens=256, num_segments=6)  # padded, as a bucket's
    pixels = torch.randn(256, tower.input_width)
    seen = record(tower, monkeypatch)
    with torch.inference_mode():
        (tower.warm_up if warm_up else tower)(pixels, batch)
    monkeypatch.undo()
    for module in tower.modules():
        module._forward_hooks.clear()
    return seen


@pytest.mark.parametrize("name", list(TOWERS))
def test_warm_up_runs_one_block_of_each_kind_and_every_kind_of_merger(name, monkeypatch):
    tower = TOWERS[name]().eval()
    cfg = tower.config
    kinds = {kind(cfg, i) for i in range(cfg.depth)}
    forward, warm = run(tower, monkeypatch, False), run(tower, monkeypatch, True)
    assert forward["blocks"] == list(range(cfg.depth))
    assert sorted({kind(cfg, i) for i in warm["blocks"]}) == sorted(kinds)
    assert len(warm["blocks"]) == len(kinds)  # one each: a warm-up, not a forward
    merger_kinds = {"merger"} | ({"deepstack"} if getattr(cfg, "deepstack_visual_indexes", ()) else set())
    assert {"deepstack" if "deepstack" in m else "merger" for m in warm["mergers"]} == merger_kinds
    assert warm["layouts"] == forward["layouts"]  # every attention layout the forward asks for
    if name.startswith("qwen2_5"):
        assert kind(cfg, 0) == "window attention" and len(forward["layouts"]) == 2
    if name.startswith("qwen3_vl"):
        assert kind(cfg, 0) == "plain"


@pytest.mark.parametrize("config", [
    Qwen25VisionConfig(depth=4, window_size=112, fullatt_block_indexes=(3,), **SMALL),
    Qwen3VisionConfig(depth=4, num_position_embeddings=64, deepstack_visual_indexes=(1, 3), **SMALL)],
    ids=["qwen2_5_vl", "qwen3_vl"])
def test_fused_warm_up_reaches_the_same_layouts_and_mergers_as_the_forward(config, monkeypatch):
    """The fused path (Triton's interpreter on a CPU) with block 0 plain: every attention
    layout and deepstack merger of the forward, and an output equal to the forward of a tower
    of the warmed-up blocks alone."""
    tower = (Qwen25VisionTower if isinstance(config, Qwen25VisionConfig) else Qwen3VisionTower)(config).eval()
    tower.load_state_dict(tower.state_dict())  # zero Qwen2.5's MLP padding, as a checkpoint's load does
    tower.fuse(True)
    forward, warm = run(tower, monkeypatch, False), run(tower, monkeypatch, True)
    def merger_kinds(seen):
        return {re.sub(r"\.\d+$", "", name) for name in seen["mergers"]}

    assert warm["layouts"] == forward["layouts"] and merger_kinds(warm) == merger_kinds(forward)
    assert merger_kinds(forward) == ({"deepstack_merger_list"} if hasattr(config, "deepstack_visual_indexes") else set())
    picked = tower.warm_up_blocks()
    assert 0 in picked and len(picked) == 2
    sub_cfg = dataclasses.replace(config, depth=len(picked), **(
        {"fullatt_block_indexes": tuple(k for k, i in enumerate(picked) if i in config.fullatt_block_indexes)}
        if isinstance(config, Qwen25VisionConfig) else
        {"deepstack_visual_indexes": tuple(k for k, i in enumerate(picked) if i in config.deepstack_visual_indexes)}))
    sub = type(tower)(sub_cfg).eval()
    state = tower.state_dict()
    for k, i in enumerate(picked):
        state.update({key.replace(f"blocks.{i}.", f"blocks.{k}.", 1): v for key, v in tower.state_dict().items()
                      if key.startswith(f"blocks.{i}.")})
    if hasattr(sub, "deepstack_merger_list"):  # the picked tap's merger is the tower's first
        first = config.deepstack_visual_indexes.index(next(i for i in picked if i in config.deepstack_visual_indexes))
        state.update({key.replace(f"deepstack_merger_list.{first}.", "deepstack_merger_list.0.", 1): v
                      for key, v in tower.state_dict().items() if key.startswith(f"deepstack_merger_list.{first}.")})
    sub.load_state_dict({k: v for k, v in state.items() if k in sub.state_dict()})
    sub.fuse(True)
    batch = tower.build_batch(GRIDS, num_tokens=256, num_segments=6)
    pixels = torch.randn(256, tower.input_width)
    with torch.inference_mode():
        assert torch.equal(tower.warm_up(pixels, batch), sub(pixels, batch))
