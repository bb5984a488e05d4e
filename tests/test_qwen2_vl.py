"""Qwen2-VL: the metadata and the rotary angles against transformers' own helpers, qkv's
interleaved layout, the state dict's order, the padded metadata (fp32 parity with transformers,
as every family's: tests/test_families.py)."""

import pytest
import torch
from helpers import random_pixels

from vitgraph.models.qwen2_vl import Qwen2VisionTower
from vitgraph.models.tower_base import interleave_order


@pytest.fixture(scope="module")
def encoder(tiny_checkpoints):
    return tiny_checkpoints.encoder("qwen2_vl")


def test_grid_as_tensor_equals_list(encoder):
    grid = [(1, 4, 6), (2, 2, 2)]
    pixels = random_pixels(grid)
    a = encoder.encode(pixels, grid)
    b = encoder.encode(pixels, torch.tensor(grid, dtype=torch.int32))
    assert torch.equal(a, b)


def test_metadata_matches_transformers_helpers(encoder):
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    grid = [(1, 4, 6), (3, 2, 4), (1, 8, 2)]
    batch = encoder.tower.build_batch(grid)
    ref_pos = get_vision_position_ids(torch.tensor(grid), 2)
    ref_cu = get_vision_cu_seqlens(torch.tensor(grid))
    assert torch.equal(batch.positions.long(), ref_pos.long())
    assert torch.equal(batch.cu_seqlens, ref_cu.to(torch.int32))
    assert batch.max_seqlen == int((ref_cu[1:] - ref_cu[:-1]).max())
    # The first tokens of an image walk the first 2x2 merge block.
    assert batch.positions[:5].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2]]


def test_rotary_matches_transformers(encoder, hf_model):
    grid = [(1, 6, 4), (2, 2, 2)]
    batch = encoder.tower.build_batch(grid)
    cos, sin = encoder.tower.rotary(batch.positions)  # one angle per rotated pair
    ref_cos, ref_sin = hf_model.rotary_pos_emb(torch.zeros(1), batch.positions.long())
    assert cos.dtype == torch.float32
    half = cos.shape[-1]
    assert ref_cos.shape[-1] == 2 * half  # transformers repeats the angles to span the head
    for ref in (ref_cos, ref_sin):
        assert torch.equal(ref[..., :half], ref[..., half:])
    torch.testing.assert_close(cos, ref_cos[..., :half].float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin[..., :half].float(), rtol=0, atol=1e-6)


def test_interleaved_qkv_layout():
    """q's and k's head dims are kept pairwise (d, d + D/2) side by side; v untouched."""
    assert interleave_order(1, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7, 8, 9, 10, 11]
    assert interleave_order(2, 2).tolist() == list(range(12))  # D = 2: the pair is already adjacent


def test_state_dict_keeps_the_checkpoint_order(encoder, hf_model):
    """The tower stores qkv interleaved, but its state dict is the checkpoint's, and loading
    that state dict again reproduces the same parameters."""
    ref = hf_model.state_dict()
    state = encoder.tower.state_dict()
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.bias", "blocks.0.attn.proj.weight"):
        assert torch.equal(state[name], ref[name].float()), name
    twin = Qwen2VisionTower(encoder.tower.config)
    twin.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), encoder.tower.parameters()))


def test_rope_columns_give_the_rotary_angles(encoder):
    """Per-column frequencies times per-row positions (what qkv's epilogue computes) give each
    rotated pair exactly the angle of :meth:`rotary`; v's columns get angle 0."""
    tower = encoder.tower
    cfg = tower.config
    batch = tower.build_batch([(1, 6, 4), (2, 8, 2)])
    pos = batch.positions.float()
    freq_h, freq_w = tower.rope_columns()
    angles = pos[:, :1] * freq_h + pos[:, 1:] * freq_w  # [T, 3 * embed_dim]
    expect = (pos[..., None] * tower.inv_freq).flatten(1)  # [T, head_dim / 2], as rotary() takes them
    qk = angles[:, :2 * cfg.embed_dim].view(-1, 2 * cfg.num_heads, cfg.head_dim // 2, 2)
    assert torch.equal(qk[..., 0], qk[..., 1])  # both dims of a pair share the angle
    assert torch.equal(qk[..., 0], expect[:, None].expand_as(qk[..., 0]))
    assert torch.equal(angles[:, 2 * cfg.embed_dim:], torch.zeros(pos.shape[0], cfg.embed_dim))


def test_padded_metadata_repeats_last_offset(encoder):
    batch = encoder.tower.build_batch([(2, 2, 2), (1, 2, 4)], num_tokens=40, num_segments=6, max_seqlen=40)
    assert batch.cu_seqlens.tolist() == [0, 4, 8, 16, 16, 16, 16]
    assert batch.segment_ids.tolist()[:16] == [0] * 4 + [1] * 4 + [2] * 8
    assert batch.segment_ids.tolist()[16:] == [-1] * 24
    assert batch.max_seqlen == 40 and not batch.dense and batch.padded and batch.segment_lengths is None
    exact = encoder.tower.build_batch([(2, 2, 2), (1, 2, 4)])  # unpadded: exact lengths on the host
    assert not exact.padded and exact.segment_lengths == (4, 4, 8) and not exact.dense
    one = encoder.tower.build_batch([(1, 4, 4)], num_tokens=20, num_segments=1)  # a dense bucket's layout
    assert one.dense and one.padded
    assert encoder.tower.build_batch([(1, 4, 4)]).dense and not encoder.tower.build_batch([(1, 4, 4)]).padded
    with pytest.raises(ValueError, match="cannot hold"):
        encoder.tower.build_batch([(1, 4, 4)], num_tokens=8)
    with pytest.raises(ValueError, match="max_seqlen"):
        encoder.tower.build_batch([(1, 4, 4)], max_seqlen=8)
