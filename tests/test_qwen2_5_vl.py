"""Qwen2.5-VL: other windows and full-attention blocks against transformers, the window
metadata against transformers' own helper, the window capacity, and the padded layout's window
slots (fp32 parity, the padded layout, the fused forward and bad config fields, as every
family's: tests/test_families.py)."""

import pytest
import torch
from helpers import (FAMILY_GRIDS, TINY_CHECKPOINTS, diff_report, hf_forward, hf_tower, random_pixels, rel_err,
                     vision_state)

from vitgraph import GraphedVisionEncoder
from vitgraph.models.qwen2_5_vl import Qwen25VisionConfig

# Windows of 8 x 8 patches (4 x 4 merged tokens), full attention in the first and last of four blocks.
TINY = TINY_CHECKPOINTS["qwen2_5_vl"].config
GRIDS = FAMILY_GRIDS["qwen2_5_vl"]


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoints):
    return tiny_checkpoints.model("qwen2_5_vl")


@pytest.fixture(scope="module")
def encoder(tiny_checkpoints):
    return tiny_checkpoints.encoder("qwen2_5_vl")


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(window_size=56), dict(fullatt_block_indexes=[1]),
                                       dict(window_size=224, fullatt_block_indexes=[0, 1, 2, 3])],
                         ids=["window-56", "one-full-block", "window-224-all-full"])
def test_other_windows_and_full_blocks(tmp_path, overrides):
    model = hf_tower("qwen2_5_vl", TINY, seed=3, **overrides)
    ckpt = TINY_CHECKPOINTS["qwen2_5_vl"].write(tmp_path, model, prefix="model.visual.", **overrides)
    enc = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
    grids = GRIDS["mixed"] + GRIDS["edge-cut windows"]
    pixels = random_pixels(grids, seed=9)
    assert rel_err(enc.encode(pixels, grids), hf_forward(model, pixels, grids)) <= 1e-5


@pytest.mark.parametrize("window_size", [112, 56])
def test_window_metadata_equals_transformers(encoder, window_size):
    from transformers.vision_utils import get_vision_window_index

    grids = GRIDS["mixed"] + GRIDS["video"] + GRIDS["edge-cut windows"]
    tower = encoder.tower
    config = tower.config  # the session's encoder: its own config put back
    tower.config = Qwen25VisionConfig(**{**config.__dict__, "window_size": window_size})
    try:
        batch = tower.build_batch(grids)
    finally:
        tower.config = config
    index, cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=2, window_size=window_size,
                                        patch_size=14)
    assert torch.equal(batch.window_index.long(), index)
    assert torch.equal(batch.window_cu, cu)
    assert torch.equal(batch.window_index[batch.reverse_index.long()].long(), torch.arange(index.numel()))


@pytest.mark.parametrize("side", [1, 2, 3, 4, 6])
def test_window_capacity_bounds_every_frame_shape(side):
    """No frame shape forms more windows than window_capacity allows: every a x b frame of merged
    tokens (up to 40 a side), and the worst layouts (one-token-high strips) reach the bound."""
    from vitgraph.models.qwen2_5_vl import frame_windows, window_capacity

    for a in range(1, 41):
        for b in range(1, 41):
            windows = len(frame_windows(2 * a, 2 * b, 2, side)[1])
            assert windows <= window_capacity(a * b, 1, side), (a, b, side, windows)
    strips = [len(frame_windows(2, 2 * n, 2, side)[1]) for n in (1, side + 1, 3 * side)]
    assert sum(strips) == window_capacity(1 + side + 1 + 3 * side, 3, side)


def test_padded_layout_fixes_the_window_capacity_and_seqlen(encoder):
    """A bucket's layout has the same window slots and window max_seqlen whatever it holds (a graph
    bakes them in), and more windows than an explicit capacity are refused before any replay."""
    from vitgraph.models.qwen2_5_vl import window_capacity

    tower = encoder.tower
    layouts = [tower.build_batch(grids, num_tokens=1024, num_segments=8, max_seqlen=1024)
               for grids in (GRIDS["minimal"], GRIDS["mixed"], GRIDS["edge-cut windows"], [(1, 2, 2)] * 8)]
    assert {b.window_cu.shape[0] - 1 for b in layouts} == {window_capacity(256, 8, 4)}
    assert {b.max_window_seqlen for b in layouts} == {64} and {b.max_frame_seqlen for b in layouts} == {1024}
    with pytest.raises(ValueError, match="windows"):
        tower.build_batch([(1, 2, 2)] * 8, num_tokens=1024, num_segments=8, num_windows=7)


def test_presets():
    from vitgraph.models import PRESETS

    assert {PRESETS[f"qwen2.5-vl-{s}"].out_hidden_size for s in ("3b", "7b", "32b", "72b")} == {2048, 3584, 5120, 8192}
    assert {PRESETS[f"qwen2.5-vl-{s}"].intermediate_size for s in ("3b", "7b", "32b", "72b")} == {3420}


@pytest.mark.cuda
def test_on_cuda_every_backend_agrees_eagerly(hf_model):
    """Eager on CUDA in bf16, each attention backend against the fp32 reference (the graphs:
    tests/test_cuda_families.py)."""
    from vitgraph.ops.attention import available_backends

    state = vision_state(hf_model)
    config = {"model_type": "qwen2_5_vl", "vision_config": TINY}
    grids = GRIDS["mixed"] + GRIDS["edge-cut windows"]
    pixels = random_pixels(grids, seed=11)
    ref = hf_forward(hf_model, pixels, grids)
    for backend in available_backends("cuda"):
        enc = GraphedVisionEncoder.from_state_dict(state, config, device="cuda", attention=backend, mode="eager")
        got = enc.encode(pixels.cuda(), grids).float().cpu()
        print(f"\n[qwen2.5 cuda eager] attention={enc.attention} dtype={enc.dtype}: {diff_report(got, ref)}")
        assert torch.isfinite(got).all() and rel_err(got, ref) <= 3e-2, (backend, diff_report(got, ref))


def test_random_weights_compute_what_their_state_dict_holds():
    """A tower built with random weights (presets, benchmarks) keeps its SwiGLU padding zero, so
    it computes what transformers computes from its state dict (which drops the padding)."""
    from dataclasses import replace

    from vitgraph import GraphedVisionEncoder
    from vitgraph.models import PRESETS, transformers_tower

    cfg = replace(PRESETS["qwen2.5-vl-3b"], depth=2, hidden_size=64, num_heads=4, intermediate_size=90,
                  out_hidden_size=32, fullatt_block_indexes=(1,))  # 90: padded to 128
    enc = GraphedVisionEncoder.from_config(cfg, device="cpu", dtype=torch.float32, seed=3)
    hf = transformers_tower(cfg, enc.tower.state_dict(), enc.tower.inv_freq)
    grids = [(1, 8, 12), (2, 4, 4)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(pixels, grid_thw=torch.tensor(grids)).pooler_output
    got = enc.encode(pixels, grids)
    assert (got - want).abs().max().item() <= 1e-5, (got - want).abs().max().item()
