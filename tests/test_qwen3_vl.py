"""Qwen3-VL: the concatenated output layout and its split, the position interpolation taps
against transformers' own helper, Qwen3-VL-MoE and the presets (fp32 parity of the main output
and every deepstack feature, the padded layout and the fused forward, as every family's:
tests/test_families.py)."""

import pytest
import torch
from helpers import FAMILY_GRIDS, pixels_for

# The tower (TINY_FAMILIES' CPU size): a position grid of 8 x 8 (not the released 48 x 48), a deepstack
# merger fed by the first block.
GRIDS = FAMILY_GRIDS["qwen3_vl"]


@pytest.fixture(scope="module")
def encoder(tiny_checkpoints):
    """Released Qwen3-VL repos keep the tower under model.visual., with hub spellings, in shards."""
    return tiny_checkpoints.encoder("qwen3_vl")


def test_split_round_trips_as_views(encoder):
    grids = GRIDS["mixed"]
    out = encoder.encode(pixels_for(encoder, grids, seed=2), grids)
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


def test_qwen3_vl_moe_and_presets():
    from vitgraph.models import PRESETS, family_for

    assert family_for("qwen3_vl_moe") is family_for("qwen3_vl")
    assert PRESETS["qwen3-vl-8b"].head_dim == 72 and PRESETS["qwen3-vl-2b"].head_dim == 64
    assert PRESETS["qwen3-vl-8b"].patch_width == 1536
