"""Qwen2.5-VL: fp32 parity with transformers' tower from a hub-layout checkpoint, the window
metadata against transformers' own helper, and the padded layout against the exact one."""

import json

import pytest
import torch
from helpers import diff_report, hf_tower, random_pixels, rel_err
from safetensors.torch import save_file

from vitgraph import GraphedVisionEncoder
from vitgraph.models.qwen2_5_vl import Qwen25VisionConfig

TINY = dict(depth=4, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=48, window_size=112,
            fullatt_block_indexes=[0, 3], hidden_act="silu", patch_size=14, temporal_patch_size=2,
            spatial_merge_size=2, in_channels=3)
GRIDS = {
    "edge-cut windows": [(1, 10, 14)],  # 5 x 7 merged tokens: windows of 4 x 4 cut by both edges
    "several images": [(1, 16, 16), (1, 4, 6), (1, 12, 20)],
    "video": [(3, 8, 12)],
    "mixed": [(1, 6, 10), (2, 16, 8), (1, 2, 2)],
    "minimal": [(1, 2, 2)],
}


def write_checkpoint(directory, model, prefix="visual.", **overrides):
    """config.json with hub spellings plus two shards and an index, as on the Hub."""
    directory.mkdir(parents=True, exist_ok=True)
    vision = {**TINY, **overrides}
    vision["in_chans"] = vision.pop("in_channels")
    vision["spatial_patch_size"] = vision.pop("patch_size")
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": vision}))
    state = {prefix + k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, str(directory / name))
        weight_map.update({k: name for k in names})
    lm = {"model.language_model.embed_tokens.weight": torch.zeros(8, 8)}
    save_file(lm, str(directory / "model-lm.safetensors"))
    weight_map.update({k: "model-lm.safetensors" for k in lm})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def hf_out(model, pixels, grids):
    with torch.no_grad():
        return model(pixels, grid_thw=torch.tensor(grids)).pooler_output


@pytest.fixture(scope="module")
def hf_model():
    return hf_tower("qwen2_5_vl", TINY)


@pytest.fixture(scope="module")
def encoder(hf_model, tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("q25"), hf_model)
    return GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GRIDS))
def test_fp32_parity_with_transformers(encoder, hf_model, case):
    grids = GRIDS[case]
    pixels = random_pixels(grids, seed=len(case))
    got, ref = encoder.encode(pixels, grids), hf_out(hf_model, pixels, grids)
    assert got.shape == ref.shape == (pixels.shape[0] // 4, 48)
    assert rel_err(got, ref) <= 1e-5, diff_report(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(window_size=56), dict(fullatt_block_indexes=[1]),
                                       dict(window_size=224, fullatt_block_indexes=[0, 1, 2, 3])],
                         ids=["window-56", "one-full-block", "window-224-all-full"])
def test_other_windows_and_full_blocks(tmp_path, overrides):
    model = hf_tower("qwen2_5_vl", TINY, seed=3, **overrides)
    enc = GraphedVisionEncoder.from_pretrained(write_checkpoint(tmp_path, model, prefix="model.visual.",
                                                                **overrides), device="cpu")
    grids = GRIDS["mixed"] + GRIDS["edge-cut windows"]
    pixels = random_pixels(grids, seed=9)
    assert rel_err(enc.encode(pixels, grids), hf_out(model, pixels, grids)) <= 1e-5


@pytest.mark.parametrize("window_size", [112, 56])
def test_window_metadata_equals_transformers(encoder, window_size):
    from transformers.vision_utils import get_vision_window_index

    grids = GRIDS["mixed"] + GRIDS["video"] + GRIDS["edge-cut windows"]
    tower = encoder.tower
    tower.config = Qwen25VisionConfig(**{**tower.config.__dict__, "window_size": window_size})
    try:
        batch = tower.build_batch(grids)
    finally:
        tower.config = Qwen25VisionConfig(**{**tower.config.__dict__, "window_size": 112})
    index, cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=2, window_size=window_size,
                                        patch_size=14)
    assert torch.equal(batch.window_index.long(), index)
    assert torch.equal(batch.window_cu, cu)
    assert torch.equal(batch.window_index[batch.reverse_index.long()].long(), torch.arange(index.numel()))


def test_padded_layout_equals_the_exact_one(encoder):
    """Rows padded to a bucket, spare frame and window slots, and NaN in every padding row:
    the real rows come out as from the exact layout."""
    tower, grids = encoder.tower, GRIDS["several images"]
    pixels = random_pixels(grids, seed=4)
    exact = tower(pixels, tower.build_batch(grids))
    real = pixels.shape[0]
    padded_pixels = torch.cat([pixels, torch.full((64, pixels.shape[1]), float("nan"))])
    batch = tower.build_batch(grids, num_tokens=real + 64, num_segments=8, max_seqlen=512, num_windows=80)
    assert batch.frame_lengths is None and int(batch.window_cu[-1]) == real
    got = tower(padded_pixels, batch)
    assert torch.isfinite(got[:real // 4]).all()
    assert rel_err(got[:real // 4], exact) <= 1e-5, diff_report(got[:real // 4], exact)


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


def test_bad_qwen2_5_configs_name_the_field(tmp_path, hf_model):
    ckpt = write_checkpoint(tmp_path, hf_model)
    for field, value in (("intermediate_size", None), ("fullatt_block_indexes", [9]), ("window_size", 10),
                         ("out_hidden_size", 0)):
        config = json.loads((ckpt / "config.json").read_text())
        if value is None:
            del config["vision_config"][field]
        else:
            config["vision_config"][field] = value
        (ckpt / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=field):
            GraphedVisionEncoder.from_pretrained(ckpt, device="cpu")
        write_checkpoint(tmp_path, hf_model)


def test_presets():
    from vitgraph.models import PRESETS

    assert {PRESETS[f"qwen2.5-vl-{s}"].out_hidden_size for s in ("3b", "7b", "32b", "72b")} == {2048, 3584, 5120, 8192}
    assert {PRESETS[f"qwen2.5-vl-{s}"].intermediate_size for s in ("3b", "7b", "32b", "72b")} == {3420}


@pytest.mark.slow
@pytest.mark.parametrize("split_k", [0, 4096], ids=["unsplit", "split-K"])
def test_fused_forward_matches_transformers(hf_model, encoder, split_k):
    """The fused forward (Triton's interpreter on a CPU: add+RMSNorm, rotary in place, SiLU * up)
    against transformers in fp32, exact and padded with NaN in the padding rows; the padded SwiGLU
    width adds exact zeros, and state dicts keep the checkpoint's names and shapes; also with proj
    and down_proj split in K (what a GPU takes at small row counts), summed by add+RMSNorm."""
    state = {"visual." + k: v for k, v in hf_model.state_dict().items()}
    fused = GraphedVisionEncoder.from_state_dict(state, {"model_type": "qwen2_5_vl", "vision_config": TINY},
                                                 device="cpu", fuse=True, tuning={"gemm.split_k_max_rows": split_k})
    assert fused.tower.fused and fused.tower.blocks[0].mlp.padded == 128
    assert {k: v.shape for k, v in fused.tower.state_dict().items()} == {k: v.shape for k, v in hf_model.state_dict().items()}
    for name in ("mixed", "edge-cut windows", "video"):
        grids = GRIDS[name]
        pixels = random_pixels(grids, seed=9)
        ref = hf_out(hf_model, pixels, grids)
        got = fused.encode(pixels, grids)
        assert rel_err(got, ref) <= 1e-5, (name, diff_report(got, ref))
    tower, grids = fused.tower, GRIDS["several images"]
    pixels = random_pixels(grids, seed=4)
    real = pixels.shape[0]
    padded = tower(torch.cat([pixels, torch.full((64, pixels.shape[1]), float("nan"))]),
                   tower.build_batch(grids, num_tokens=real + 64, num_segments=8, max_seqlen=512))
    ref = hf_out(hf_model, pixels, grids)
    assert torch.isfinite(padded[:real // 4]).all() and rel_err(padded[:real // 4], ref) <= 1e-5


@pytest.mark.cuda
def test_on_cuda_every_backend_agrees_eagerly(hf_model):
    """Eager on CUDA in bf16, each attention backend against the fp32 reference (the graphs:
    tests/test_cuda_families.py)."""
    from vitgraph.ops.attention import available_backends

    state = {"visual." + k: v for k, v in hf_model.state_dict().items()}
    config = {"model_type": "qwen2_5_vl", "vision_config": TINY}
    grids = GRIDS["mixed"] + GRIDS["edge-cut windows"]
    pixels = random_pixels(grids, seed=11)
    ref = hf_out(hf_model, pixels, grids)
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
