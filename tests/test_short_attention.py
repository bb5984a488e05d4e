"""The short-frame attention kernel against plain rotary + per-segment SDPA.

Runs compiled on a GPU and under Triton's interpreter on CPU (conftest).
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

from vitgraph import kernels
from vitgraph.models.qwen2_vl import apply_rotary
from vitgraph.short_attention import head_dim_parts, short_attention

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter multiplies bf16 tiles as raw bits (numpy has no bf16): fp16 on CPU.
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def reference(qkv, cos, sin, lengths, heads):
    """Rotary in fp32 (rounded back), then exact attention inside each segment, in fp32."""
    rows = qkv.shape[0]
    q, k, v = qkv.view(rows, 3, heads, -1).unbind(1)
    if cos is not None:
        q, k = apply_rotary(q, k, cos, sin)
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def packed_inputs(lengths, rows, heads=2, head_dim=80, seed=0, poison=True):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, 3 * heads * head_dim, generator=g)
    angles = torch.rand(rows, head_dim // 2, generator=g) * 6
    if poison:
        qkv[sum(lengths):] = float("nan")  # padding rows: never read
    return qkv.to(DEVICE, DTYPE), angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("lengths, rows, slots, tiles", [
    ([7, 40, 1, 70], 128, 6, (16, 16, 4, 1)),  # several query and key tiles, a 1-token segment, empty slots
    ([33], 48, 1, (32, 16, 4, 1)),
    ([20, 12], 32, 2, None),  # the default tiles
])
def test_matches_rotary_then_attention_per_segment(rope, lengths, rows, slots, tiles):
    heads = 2
    qkv, cos, sin = packed_inputs(lengths, rows, heads)
    cu = torch.zeros(slots + 1, dtype=torch.int32)
    cu[1:len(lengths) + 1] = torch.tensor(lengths).cumsum(0)
    cu[len(lengths) + 1:] = sum(lengths)
    out = torch.full((rows, heads, 80), 7.0, device=DEVICE, dtype=DTYPE)
    got = short_attention(qkv, cu.to(DEVICE), heads, max(lengths), *((cos, sin) if rope else (None, None)),
                          out=out, tiles=tiles)
    real = sum(lengths)
    want = reference(qkv, cos if rope else None, sin if rope else None, lengths, heads)
    assert got is out and rel_err(got[:real], want) <= 1e-2
    assert torch.equal(got[real:], torch.full_like(got[real:], 7.0))  # padding rows unwritten


def test_a_segment_gives_the_same_bits_wherever_it_sits():
    """Tiles start at their segment's start: a frame's output does not depend on the frames
    before it or on the padding after it (what lets a padded replay equal an exact run)."""
    heads, n = 2, 37
    qkv, cos, sin = packed_inputs([n], 64, heads, poison=False)
    alone = short_attention(qkv[:n].contiguous(), torch.tensor([0, n], dtype=torch.int32, device=DEVICE), heads, n,
                            cos[:n].contiguous(), sin[:n].contiguous(), tiles=(16, 16, 4, 1))
    shifted = torch.cat([qkv[n:n + 5], qkv[:n], qkv[n + 5:]])
    cos2, sin2 = (torch.cat([t[n:n + 5], t[:n], t[n + 5:]]) for t in (cos, sin))
    cu = torch.tensor([0, 5, 5 + n, 64, 64], dtype=torch.int32, device=DEVICE)
    packed = short_attention(shifted, cu, heads, 64, cos2, sin2, tiles=(16, 16, 4, 1))
    assert torch.equal(packed[5:5 + n], alone)


def test_head_dim_parts_and_bad_input():
    assert head_dim_parts(80) == (64, 16) and head_dim_parts(64) == (64, 0) and head_dim_parts(72) is None
    qkv = torch.zeros(8, 3 * 2 * 80, dtype=DTYPE, device=DEVICE)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="fp16/bf16"):
        short_attention(qkv.float(), cu, 2, 8)
    with pytest.raises(ValueError, match="int32"):
        short_attention(qkv, cu.long(), 2, 8)
    with pytest.raises(ValueError, match="cos and sin"):
        short_attention(qkv, cu, 2, 8, cos=torch.zeros(8, 40, device=DEVICE))
