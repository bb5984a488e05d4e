"""Qwen3-VL: fp32 parity of the main output and every deepstack feature with transformers'
``Qwen3VLVisionModel`` from a hub-layout checkpoint, and the concatenated output layout."""

import json

import pytest
import torch
from helpers import TINY_FAMILIES, diff_report, hf_tower, rel_err, write_two_shards

from vitgraph import GraphedVisionEncoder

# A position grid of 8 x 8 (not the released 48 x 48), a deepstack merger fed by the first block.
TINY = TINY_FAMILIES["qwen3_vl"].cpu
GRIDS = {
    "smaller than the position grid": [(1, 4, 6)],
    "larger than the position grid": [(1, 20, 12)],
    "several images": [(1, 8, 8), (1, 2, 2), (1, 16, 10)],
    "video": [(3, 6, 8)],
    "mixed": [(1, 10, 4), (2, 4, 4), (1, 2, 2)],
    "minimal": [(1, 2, 2)],
}


def pixels_for(grids, seed):
    return torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(seed))


def hf_out(model, pixels, grids):
    with torch.no_grad():
        out = model(pixels, grid_thw=torch.tensor(grids))
    return out.pooler_output, out.deepstack_features


@pytest.fixture(scope="module")
def hf_model():
    return hf_tower("qwen3_vl", TINY)


@pytest.fixture(scope="module")
def encoder(hf_model, tmp_path_factory):
    """Released Qwen3-VL repos keep the tower under model.visual., with hub spellings, in shards."""
    directory = tmp_path_factory.mktemp("q3")
    vision = dict(TINY)
    vision["in_chans"] = vision.pop("in_channels")
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": vision}))
    state = {"model.visual." + k: v.detach().clone().contiguous() for k, v in hf_model.state_dict().items()}
    write_two_shards(directory, state)
    return GraphedVisionEncoder.from_pretrained(directory, device="cpu")


@pytest.mark.parametrize("case", list(GRIDS))
def test_main_output_and_every_deepstack_feature_match_transformers(encoder, hf_model, case):
    grids = GRIDS[case]
    pixels = pixels_for(grids, seed=len(case))
    out = encoder.encode(pixels, grids)
    assert out.shape == (pixels.shape[0] // 4, 32 * 3) and encoder.output_width == 96
    main, deepstack = encoder.split(out)
    ref_main, ref_deepstack = hf_out(hf_model, pixels, grids)
    assert rel_err(main, ref_main) <= 1e-5, diff_report(main, ref_main)
    assert len(deepstack) == len(ref_deepstack) == 2
    for got, ref in zip(deepstack, ref_deepstack):
        assert rel_err(got, ref) <= 1e-5, diff_report(got, ref)


def test_split_round_trips_as_views(encoder):
    grids = GRIDS["mixed"]
    out = encoder.encode(pixels_for(grids, seed=2), grids)
    main, deepstack = encoder.split(out)
    assert all(t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for t in [main, *deepstack])
    assert torch.equal(torch.cat([main, *deepstack], dim=1), out)
    with pytest.raises(ValueError, match=r"\[rows, 96\]"):
        encoder.split(main)


def test_interpolation_taps_equal_transformers(encoder):
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    grids = GRIDS["several images"] + GRIDS["video"] + GRIDS["larger than the position grid"]
    batch = encoder.tower.build_batch(grids)
    index, weight = get_vision_interpolation_indices_and_weights(torch.tensor(grids), num_grid_per_side=8,
                                                                mode="bilinear", align_corners=True,
                                                                spatial_merge_size=2)
    assert torch.equal(batch.pos_index.long(), index)
    assert torch.equal(batch.pos_weight_bits.view(torch.float32), weight)


def test_padded_layout_equals_the_exact_one(encoder):
    tower, grids = encoder.tower, GRIDS["several images"]
    pixels = pixels_for(grids, seed=6)
    exact = tower(pixels, tower.build_batch(grids))
    real = pixels.shape[0]
    padded = torch.cat([pixels, torch.full((32, pixels.shape[1]), float("nan"))])
    got = tower(padded, tower.build_batch(grids, num_tokens=real + 32, num_segments=6, max_seqlen=256))
    assert torch.isfinite(got[:real // 4]).all() and rel_err(got[:real // 4], exact) <= 1e-5


def test_qwen3_vl_moe_and_presets():
    from vitgraph.models import PRESETS, family_for

    assert family_for("qwen3_vl_moe") is family_for("qwen3_vl")
    assert PRESETS["qwen3-vl-8b"].head_dim == 72 and PRESETS["qwen3-vl-2b"].head_dim == 64
    assert PRESETS["qwen3-vl-8b"].patch_width == 1536


@pytest.mark.slow
def test_fused_forward_matches_transformers(hf_model):
    """The fused forward (Triton's interpreter on a CPU: add+LayerNorm, rotary in place, GELU-tanh
    in place, the deepstack mergers reading the stream) against transformers in fp32, every
    output, exact and padded with NaN in the padding rows."""
    state = {"model.visual." + k: v for k, v in hf_model.state_dict().items()}
    fused = GraphedVisionEncoder.from_state_dict(state, {"model_type": "qwen3_vl", "vision_config": TINY},
                                                 device="cpu", fuse=True)
    assert fused.tower.fused
    for name in ("mixed", "larger than the position grid", "video"):
        grids = GRIDS[name]
        pixels = pixels_for(grids, seed=9)
        main, deepstack = hf_out(hf_model, pixels, grids)
        got_main, got_deepstack = fused.split(fused.encode(pixels, grids))
        for got, ref in zip([got_main, *got_deepstack], [main, *deepstack]):
            assert rel_err(got, ref) <= 1e-5, (name, diff_report(got, ref))
    tower, grids = fused.tower, GRIDS["several images"]
    pixels = pixels_for(grids, seed=4)
    real = pixels.shape[0]
    padded = tower(torch.cat([pixels, torch.full((64, pixels.shape[1]), float("nan"))]),
                   tower.build_batch(grids, num_tokens=real + 64, num_segments=8, max_seqlen=512))
    main, deepstack = hf_out(hf_model, pixels, grids)
    ref = torch.cat([main, *deepstack], dim=1)
    assert torch.isfinite(padded[:real // 4]).all() and rel_err(padded[:real // 4], ref) <= 1e-5
