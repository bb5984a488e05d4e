"""vitgraph's Triton kernels against the plain PyTorch ops they replace.

On a machine without a GPU they run on CPU tensors under Triton's interpreter
(conftest sets ``TRITON_INTERPRET=1``); on a GPU they run compiled.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

from vitgraph.ops import gemm, kernels
from vitgraph.models import PRESETS
from vitgraph.ops.gemm import FC1_SMALL_TILE, ROPE_SMALL_TILE, TILE, Tile, gemm_tuning, rope_in_gemm
from vitgraph.models.qwen2_vl import Qwen2VisionTower
from vitgraph.models.tower_base import apply_rotary
from vitgraph.ops.activations import quick_gelu

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(37, 80), (5, 1280), (600, 80)])  # 600: several rows per program
def test_add_layernorm(dtype, rows, width):
    g = torch.Generator().manual_seed(rows)
    x, y = (torch.randn(rows, width, generator=g).to(DEVICE, dtype) for _ in range(2))
    w, b = (1 + 0.2 * torch.randn(width, generator=g)).to(DEVICE, dtype), (0.1 * torch.randn(width, generator=g)).to(DEVICE, dtype)
    expect_x = x + y
    expect_h = F.layer_norm(expect_x, (width,), w, b, eps=1e-6)
    got_x = x.clone()
    got_h = kernels.add_layernorm(got_x, y, w, b, 1e-6)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(got_x, expect_x)  # the residual stream is rounded exactly like x + y
    else:  # the interpreter's bf16 casts truncate: one ulp
        torch.testing.assert_close(got_x, expect_x, rtol=2 ** -7, atol=0)
    assert rel_err(got_h, expect_h) <= TOL[dtype]
    # Without y: a plain LayerNorm, x untouched.
    before = got_x.clone()
    again = kernels.add_layernorm(got_x, None, w, b, 1e-6)
    assert torch.equal(got_x, before) and rel_err(again, expect_h) <= TOL[dtype]


@pytest.mark.parametrize("launch", [(1, 2), (2, 2), (4, 8), (8, 4)])
def test_add_layernorm_layouts(launch, monkeypatch):
    """Every layout of rows per program and warps normalizes every row, including a last
    program that is only partly filled (37 rows); the layout is ``WIDE_LAYOUT`` from
    ``WIDE_MIN_ROWS`` for widths in ``WIDE_WIDTHS``."""
    rows, width = 37, 80
    g = torch.Generator().manual_seed(6)
    x, y = (torch.randn(rows, width, generator=g).to(DEVICE) for _ in range(2))
    w, b = (1 + 0.2 * torch.randn(width, generator=g)).to(DEVICE), (0.1 * torch.randn(width, generator=g)).to(DEVICE)
    got_x = x.clone()
    got = kernels.add_layernorm(got_x, y, w, b, 1e-6, launch=kernels.LayerNormLaunch(*launch))
    assert torch.equal(got_x, x + y)
    assert rel_err(got, F.layer_norm(x + y, (width,), w, b, eps=1e-6)) <= TOL[torch.float32]
    monkeypatch.setattr(kernels, "WIDE_LAYOUT", launch)
    monkeypatch.setattr(kernels, "WIDE_WIDTHS", (64, 1024))
    tuning, wide = kernels.NormTuning(), kernels.WIDE_MIN_ROWS
    assert kernels.layernorm_launch(wide, width, tuning) == kernels.LayerNormLaunch(*launch)
    assert kernels.layernorm_launch(wide - 1, width, tuning) == kernels.LayerNormLaunch(
        kernels._rows_per_program(wide - 1, width), 8)
    assert kernels.layernorm_launch(tuning.one_row_max_rows, width, tuning) == kernels.LayerNormLaunch(1, 8)
    width_rule = kernels.LayerNormLaunch(kernels._rows_per_program(wide, width), 8)
    monkeypatch.setattr(kernels, "WIDE_WIDTHS", (81, 1024))
    assert kernels.layernorm_launch(wide, width, tuning) == width_rule


def test_norm_tuning_follows_the_device():
    """Early launch of the next kernel only from compute capability 9; the wide layout for rows
    of 1025-2048 values (Qwen2-VL's 1280, Qwen3-VL-8B's 1152), not Qwen3-VL-2B's 1024 or a merger's 4608."""
    assert kernels.norm_tuning(9).launch_dependents_max_rows == 2048
    assert kernels.norm_tuning(8).launch_dependents_max_rows == kernels.norm_tuning(None).launch_dependents_max_rows == 0
    assert kernels.norm_tuning(8).one_row_max_rows == 512 and kernels.norm_tuning(None).one_row_max_rows == 0
    tuning = kernels.norm_tuning(9)
    rows = kernels.WIDE_MIN_ROWS
    assert all(kernels.layernorm_launch(rows, w, tuning) == kernels.LayerNormLaunch(2, 2) for w in (1152, 1280))
    assert all(kernels.layernorm_launch(rows, w, tuning).warps == 8 for w in (1024, 4608))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_with_an_offset(dtype):
    """``offset``: LayerNorm(x + offset) with the offset added in fp32 and x left as it is (a
    residual stream whose biases are kept aside); a bad offset is refused."""
    rows, width = 37, 80
    g = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(rows, width, generator=g)).to(DEVICE, dtype)
    offset = torch.randn(width, generator=g).to(DEVICE)
    w, b = (1 + 0.2 * torch.randn(width, generator=g)).to(DEVICE, dtype), (0.1 * torch.randn(width, generator=g)).to(DEVICE, dtype)
    expect = F.layer_norm(x.float() + offset, (width,), w.float(), b.float(), eps=1e-6)
    before = x.clone()
    got = kernels.add_layernorm(x, None, w, b, 1e-6, offset=offset)
    assert torch.equal(x, before)
    assert rel_err(got.float(), expect) <= TOL[dtype]
    assert rel_err(got.float(), F.layer_norm(x.float(), (width,), w.float(), b.float(), eps=1e-6)) > 10 * TOL[dtype]
    with pytest.raises(ValueError, match="offset"):
        kernels.add_layernorm(x, None, w, b, 1e-6, offset=offset.to(dtype) if dtype != torch.float32 else offset[:-1])


@pytest.mark.parametrize("shape, dtype", [((64, 1280), torch.bfloat16), ((37, 80), torch.float32),
                                          ((130, 40), torch.bfloat16), ((1, 17), torch.float32)])
def test_prefix_sums_match_torch_cumsum(shape, dtype):
    """The running sums of a stream's kept-aside biases: torch.cumsum in fp32 of the same values,
    for row counts that are not powers of two and column counts that split across programs."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    got = kernels.prefix_sums(x)
    expect = torch.cumsum(x, 0, dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.prefix_sums(x.t() if shape[0] > 1 else x[0])


@pytest.mark.parametrize("dtype, partial_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16)])
def test_add_layernorm_sums_split_k_partials(dtype, partial_dtype):
    """y as [S, T, N] partial products (a split-K GEMM's) plus a bias: summed in fp32, then
    added, exactly as one fp32 sum of the partials and the bias rounded once into x."""
    rows, width, splits = 9, 80, 3
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, width, generator=g).to(DEVICE, dtype)
    parts = torch.randn(splits, rows, width, generator=g).to(DEVICE, partial_dtype)
    y_bias = torch.randn(width, generator=g).to(DEVICE, dtype)
    w, b = torch.ones(width, device=DEVICE, dtype=dtype), torch.zeros(width, device=DEVICE, dtype=dtype)
    expect_x = (x.float() + (parts[0].float() + parts[1].float() + parts[2].float() + y_bias.float())).to(dtype)
    got_x = x.clone()
    got_h = kernels.add_layernorm(got_x, parts, w, b, 1e-6, y_bias=y_bias)
    if DEVICE == "cuda" or dtype == torch.float32:
        torch.testing.assert_close(got_x, expect_x, rtol=1e-6, atol=1e-6)  # fp32 sums may associate differently
    else:
        torch.testing.assert_close(got_x, expect_x, rtol=2 ** -7, atol=0)
    assert rel_err(got_h, F.layer_norm(expect_x.float(), (width,), eps=1e-6)) <= TOL[dtype]
    with pytest.raises(ValueError, match="y must be"):
        kernels.add_layernorm(x.clone(), parts[:, :4], w, b, 1e-6)


def _qkv_case(rows, heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, 3 * heads * head_dim, generator=g).to(DEVICE, dtype)
    angles = (torch.randn(rows, head_dim // 2, generator=g) * 3).to(DEVICE)  # one per rotated pair
    return qkv, angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_in_place(dtype):
    rows, heads, head_dim = 13, 4, 16
    qkv, cos, sin = _qkv_case(rows, heads, head_dim, dtype)
    q, k, v = qkv.clone().view(rows, 3, heads, head_dim).unbind(1)
    expect_q, expect_k = apply_rotary(q, k, cos, sin)
    got_q, got_k, got_v = kernels.rotary_(qkv, cos, sin, heads)
    assert got_q.data_ptr() == qkv.data_ptr()  # views of qkv, rotated in place
    assert rel_err(got_q, expect_q) <= TOL[dtype] and rel_err(got_k, expect_k) <= TOL[dtype]
    assert torch.equal(got_v, v)


def test_rotary_zero_padding_clears_padding_rows_only():
    rows, real, heads, head_dim = 21, 15, 4, 16
    qkv, cos, sin = _qkv_case(rows, heads, head_dim, torch.float32, seed=3)
    qkv[real:] = float("nan")
    segment_ids = torch.full((rows,), -1, dtype=torch.int32, device=DEVICE)
    segment_ids[:real] = torch.arange(real, device=DEVICE) // 5
    q0, k0, v0 = (t.clone() for t in qkv.view(rows, 3, heads, head_dim)[:real].unbind(1))
    q0, k0 = apply_rotary(q0, k0, cos[:real], sin[:real])
    q, k, v = kernels.rotary_(qkv, cos, sin, heads, segment_ids, zero_padding=True)
    assert q.data_ptr() == qkv.data_ptr()
    for t in (q, k, v):
        assert torch.equal(t[real:], torch.zeros(rows - real, heads, head_dim, device=DEVICE))
    assert rel_err(q[:real], q0) <= 1e-6 and rel_err(k[:real], k0) <= 1e-6 and torch.equal(v[:real], v0)
    with pytest.raises(ValueError, match="segment_ids"):
        kernels.rotary_(qkv, cos, sin, heads, zero_padding=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_zero_padding_zeroes_the_non_finite_values_of_v_only(dtype):
    """Every non-finite value of v becomes 0 (FlashAttention 4 multiplies the next segment's
    values by 0); its finite values, and q and k, stay as they were."""
    rows, heads, head_dim = 12, 2, 8
    qkv, cos, sin = _qkv_case(rows, heads, head_dim, dtype, seed=5)
    view = qkv.view(rows, 3, heads, head_dim)
    view[2, 2, 1, 3] = float("nan")
    view[4, 2, 0, 0] = float("inf")
    view[7, 2, 1, 6] = float("-inf")
    view[9, 0, 0, 1] = float("nan")  # in q: left to attention, where it stays inside its segment
    segment_ids = (torch.arange(rows, device=DEVICE) // 4).to(torch.int32)
    expect_v = torch.nan_to_num(view[:, 2].clone(), nan=0.0, posinf=0.0, neginf=0.0)
    expect_q, expect_k = apply_rotary(view[:, 0].clone(), view[:, 1].clone(), cos, sin)
    q, k, v = kernels.rotary_(qkv, cos, sin, heads, segment_ids, zero_padding=True)
    assert torch.equal(v, expect_v)
    assert torch.isnan(q[9]).any() and torch.equal(q[:9].isfinite(), expect_q[:9].isfinite())
    assert rel_err(k, expect_k) <= TOL[dtype]


def test_rotary_lane_masks_padding_keys():
    """q/k get an extra lane; attention through it equals exact attention over the real rows,
    even when the padding rows hold NaN."""
    rows, real, heads, head_dim, lane = 24, 17, 4, 16, 24
    qkv, cos, sin = _qkv_case(rows, heads, head_dim, torch.float32, seed=1)
    qkv[real:] = float("nan")
    segment_ids = torch.full((rows,), -1, dtype=torch.int32, device=DEVICE)
    segment_ids[:real] = 0
    q0, k0, v0 = (t.clone() for t in qkv.view(rows, 3, heads, head_dim)[:real].unbind(1))
    q0, k0 = apply_rotary(q0, k0, cos[:real], sin[:real])
    q, k, v = kernels.rotary_(qkv, cos, sin, heads, segment_ids, lane)
    assert q.shape == (rows, heads, lane) and v.shape == (rows, heads, head_dim)
    assert torch.equal(q[..., head_dim], torch.ones(rows, heads, device=DEVICE))
    assert torch.equal(k[:real, :, head_dim], torch.zeros(real, heads, device=DEVICE))
    assert torch.equal(k[real:, :, head_dim], torch.full((rows - real, heads), kernels.PAD_KEY_SCORE, device=DEVICE))
    assert torch.equal(q[..., head_dim + 1:], torch.zeros(rows, heads, lane - head_dim - 1, device=DEVICE))
    assert torch.equal(q[real:, :, :head_dim], torch.zeros(rows - real, heads, head_dim, device=DEVICE))
    assert torch.equal(v[real:], torch.zeros(rows - real, heads, head_dim, device=DEVICE))
    assert rel_err(q[:real, :, :head_dim], q0) <= 1e-6 and rel_err(k[:real, :, :head_dim], k0) <= 1e-6

    to_bhsd = lambda t: t.transpose(0, 1).unsqueeze(0)
    scale = head_dim ** -0.5
    got = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), scale=scale)[0].transpose(0, 1)
    expect = F.scaled_dot_product_attention(to_bhsd(q0), to_bhsd(k0), to_bhsd(v0), scale=scale)[0].transpose(0, 1)
    assert torch.isfinite(got).all()
    assert rel_err(got[:real], expect) <= 1e-5


def test_rotary_rejects_other_float_widths():
    qkv, cos, sin = _qkv_case(4, 2, 8, torch.float32)
    with pytest.raises(TypeError, match="qkv"):
        kernels.rotary_(qkv.double(), cos, sin, 2)


H200_2B = gemm_tuning("quack", 9, 132, 1280, 5120)  # the tower and GPU its rows and tiles were measured on


def test_rope_epilogue_only_where_it_was_measured_to_win():
    weight = torch.empty(3 * 1280, 1280)
    rows = H200_2B.rope_min_rows
    assert rows == 576
    assert rope_in_gemm(rows, weight, H200_2B) and rope_in_gemm(4 * rows, weight, H200_2B)
    assert not rope_in_gemm(rows - 4, weight, H200_2B)  # below the threshold: cuBLAS + the Triton pass
    assert not rope_in_gemm(rows + 2, weight, H200_2B)  # per-row fp32 vectors need rows % 4 == 0
    assert not rope_in_gemm(rows, weight, dataclasses.replace(H200_2B, backend="cublas"))
    assert not rope_in_gemm(rows, weight[:, :1276], H200_2B)  # not contiguous


def test_the_256_row_bucket_takes_quacks_64_row_tiles():
    from vitgraph.ops.gemm import fc1_kernel, fc1_tile, rope_tile

    qkv, fc1 = torch.empty(3 * 1280, 1280), torch.empty(5120, 1280)
    assert rope_in_gemm(256, qkv, H200_2B) and not rope_in_gemm(256, qkv, dataclasses.replace(H200_2B, backend="cublas"))
    assert rope_tile(256, qkv, H200_2B) == ROPE_SMALL_TILE == Tile(64, 128, True, 2, 1)
    assert fc1_tile(256, fc1, H200_2B) == FC1_SMALL_TILE == Tile(64, 160, True, 2, 1)
    assert fc1_kernel(256, fc1, H200_2B) is not None
    for rows in (64, 252, 260, 288, 480):  # next to it cuBLAS and the Triton passes stay (measured slower)
        assert not rope_in_gemm(rows, qkv, H200_2B) and fc1_kernel(rows, fc1, H200_2B) is None, rows


def test_the_512_row_bucket_takes_the_64_row_tile_for_qkv_only():
    from vitgraph.ops.gemm import fc1_tile, rope_tile

    qkv = torch.empty(3 * 1280, 1280)
    assert rope_in_gemm(512, qkv, H200_2B)
    assert rope_tile(512, qkv, H200_2B) == ROPE_SMALL_TILE
    # fc1 keeps the 128-row tile there (quack from fc1_min_rows = 512, by the wave model)
    assert H200_2B.fc1_min_rows == 512 and fc1_tile(512, torch.empty(5120, 1280), H200_2B) == TILE
    for rows in (448, 480, 508, 516, 544):  # next to it: cuBLAS and the Triton rotary pass
        assert not rope_in_gemm(rows, qkv, H200_2B), rows


def test_rope_tile_follows_the_wave_model():
    from vitgraph.ops.gemm import rope_tile

    (default, _), (wide, _), (wider, _) = H200_2B.rope_tiles
    assert (default, wide.tile_n, wider.tile_n) == (TILE, 192, 240)
    qkv = torch.empty(3 * 1280, 1280)
    # The row counts measured: 1024 rows take 8 x 16 = 128 tiles of 240 (one wave on 132 SMs)
    # against 8 x 24 = 192 of 160; 1536 rows 12 x 20 = 240 of 192 (two waves) against 288 (three).
    assert rope_tile(1024, qkv, H200_2B) == wider
    assert rope_tile(1536, qkv, H200_2B) == wide
    for rows in (1152, 1280, 2048, 3584, 4096):  # the default tile was the fastest there too
        assert rope_tile(rows, qkv, H200_2B) == TILE, rows
    assert rope_tile(512, qkv, dataclasses.replace(H200_2B, rope_small_rows=None)) == TILE  # 96 tiles fit one wave
    # From rope_min_rows (576) to 1024 rows, each pick was the fastest 128-row tile measured
    # after the LayerNorm: 160 wide at 576-640 rows, 192 at 704-768, 240 at 832-896.
    assert rope_tile(640, qkv, H200_2B) == TILE and rope_tile(768, qkv, H200_2B) == wide
    assert rope_tile(896, qkv, H200_2B) == wider
    assert rope_tile(1024, qkv, dataclasses.replace(H200_2B, sm_count=114)) == TILE  # the 128 tiles of 240: two waves
    alone = dataclasses.replace(H200_2B, rope_tiles=H200_2B.rope_tiles[:1])  # the default tile only
    assert rope_tile(1024, qkv, alone) == rope_tile(1536, qkv, alone) == TILE


def test_fc1_tile_follows_the_wave_model():
    from vitgraph.ops.gemm import fc1_tile

    (default, _), (narrow, _) = H200_2B.fc1_tiles
    assert default == TILE
    fc1 = torch.empty(5120, 1280)
    # 1152 rows: 9 x 40 = 360 tiles of 128 and 9 x 32 = 288 of 160, three waves either way;
    # 1664 rows: 520 of 128 and 416 of 160, four waves either way.
    assert fc1_tile(1152, fc1, H200_2B) == fc1_tile(1664, fc1, H200_2B) == narrow
    for rows in (1024, 1280, 1536, 2304, 4096):  # the default tile measured fastest (or within 2%) there
        assert fc1_tile(rows, fc1, H200_2B) == TILE, rows
    assert fc1_tile(1152, fc1, dataclasses.replace(H200_2B, fc1_tiles=H200_2B.fc1_tiles[:1])) == TILE


def test_gemm_tuning_follows_the_widths_and_the_device():
    """The measured rows and bands only for the tower and GPU they were measured on; other widths
    get thresholds from how their output tiles fill the SMs, and no GPU gets no split K."""
    assert (H200_2B.split_k_max_rows, H200_2B.qkv_min_rows, H200_2B.small_rows, H200_2B.split_k_long_rows) == (
        896, 2048, (256, 256), (320, 416))
    qwen3 = gemm_tuning("cublas", 9, 132, 1152, 4304)  # 9 column tiles of 128: split K up to 8 row tiles
    assert qwen3.split_k_max_rows == 1024 and qwen3.small_rows is None and qwen3.split_k_long_rows == ()
    assert gemm_tuning("cublas", 9, 132, 1024, 4096).split_k_max_rows == 1152
    assert qwen3.fc1_min_rows == 128 * 5  # 34 column tiles of 160: 4 row tiles fill 132 SMs
    for table in ("fc1_tiles", "rope_tiles"):  # a wave's work grows with K: every tile's µs per wave
        assert [us for _, us in getattr(qwen3, table)] == pytest.approx(
            [us * 1152 / 1280 for _, us in getattr(H200_2B, table)])
    assert gemm_tuning("cublas", 9, 114, 1280, 5120).small_rows is None  # other SM counts: not measured
    for arch, sms in ((8, 108), (None, None)):
        assert gemm_tuning("cublas", arch, sms, 1280, 5120).split_k_max_rows == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quick_gelu_in_place(dtype):
    x = torch.randn(9, 333, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype) * 3
    expect = quick_gelu(x.float())
    got = kernels.activation_(x, "quick_gelu")
    assert got.data_ptr() == x.data_ptr() and rel_err(got, expect) <= TOL[dtype] / 2


def test_linear_split_k(monkeypatch):
    """Up to split_k_max_rows rows: two partial products over K's halves plus the bias, which
    sum to the plain linear; above it, or where it is 0 (no Hopper), the plain linear."""
    from vitgraph.ops.gemm import GemmTuning, linear_split_k

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(24, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32, generator=g)
    x, w, b = x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)
    tuning = GemmTuning(split_k_max_rows=512)
    parts, bias = linear_split_k(x, w, b, tuning)
    assert parts.shape == (2, 24, 32) and bias is b
    torch.testing.assert_close(parts.sum(0) + b, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    y, bias = linear_split_k(x, w, b, dataclasses.replace(tuning, split_k_max_rows=16))
    assert bias is None and torch.equal(y, F.linear(x, w, b))
    # Long K at split_k_long_rows rows: four partials; shorter K, or other rows: split_k.
    monkeypatch.setattr(gemm, "SPLIT_K_LONG_MIN_K", 64)
    long = dataclasses.replace(tuning, split_k_long_rows=(24,))
    parts, bias = linear_split_k(x, w, b, long)
    assert parts.shape == (4, 24, 32) and bias is b
    torch.testing.assert_close(parts.sum(0) + b, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert linear_split_k(x[:20], w, b, long)[0].shape == (2, 20, 32)  # other rows
    short_x, short_w = x[:, :32].contiguous(), w[:, :32].contiguous()
    assert linear_split_k(short_x, short_w, b, long)[0].shape == (2, 24, 32)  # K below the minimum
    monkeypatch.setattr(gemm, "SPLIT_K_LONG", 1)
    y, bias = linear_split_k(x, w, b, long)  # a split of 1: the plain linear
    assert bias is None and torch.equal(y, F.linear(x, w, b))
    assert linear_split_k(x, w, b, GemmTuning())[1] is None  # the default: never split


@pytest.mark.slow
@pytest.mark.parametrize("padded, split_k, bias_free", [(False, False, False), (True, False, False),
                                                        (True, True, False), (False, False, True), (True, False, True)])
def test_fused_forward_matches_reference(padded, split_k, bias_free):
    """The whole fused forward (fp32, sdpa attention) against the plain one, unpadded and in a
    padded packed layout whose padding rows hold NaN; also with proj and fc2 split in K, and
    with their biases kept out of the residual stream (what runs above the split-K rows)."""
    from vitgraph.ops.gemm import GemmTuning
    from vitgraph.ops.tuning import KernelTuning

    torch.manual_seed(0)
    tower = Qwen2VisionTower(PRESETS["tiny"]).to(DEVICE).eval()
    # Rows up to 512 split K (or none); bias_free: the stream is bias free where they do not.
    gemm = GemmTuning(split_k_max_rows=512 if split_k else 0, bias_free=bias_free)
    tower.set_tuning(KernelTuning(gemm=gemm))
    with torch.no_grad():
        for p in tower.parameters():
            p.add_(0.05 * torch.randn_like(p))
    grids = [(1, 4, 6), (2, 4, 4)]
    real = sum(t * h * w for t, h, w in grids)
    layout = dict(num_tokens=real + 16, num_segments=5) if padded else {}
    batch = tower.build_batch(grids, **layout).to(DEVICE)
    pixels = torch.randn(batch.positions.shape[0], tower.input_width, device=DEVICE)
    pixels[real:] = float("nan")
    with torch.inference_mode():
        expect = tower.forward_reference(pixels, batch)[:real // 4]
        tower.fuse(True)
        assert tower.fused_paths(batch).bias_free == bias_free
        got = tower(pixels, batch)[:real // 4]
    assert torch.isfinite(got).all()
    assert rel_err(got, expect) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True])
def test_warm_up_runs_the_first_block_and_the_merger(fused):
    """``warm_up`` (what a capture runs first) equals the forward of a one-block tower holding
    the first block and the merger, on both paths, and leaves the tower whole."""
    torch.manual_seed(0)
    tower = Qwen2VisionTower(PRESETS["tiny"]).to(DEVICE).eval()
    assert len(tower.blocks) > 1
    one = Qwen2VisionTower(dataclasses.replace(PRESETS["tiny"], depth=1)).to(DEVICE).eval()
    one.load_state_dict({k: v for k, v in tower.state_dict().items() if not k.startswith("blocks.")
                         or k.startswith("blocks.0.")})
    for t in (tower, one):
        t.fuse(fused)
    batch = tower.build_batch([(1, 4, 6), (2, 4, 4)], num_tokens=64, num_segments=4).to(DEVICE)
    pixels = torch.randn(64, tower.input_width, device=DEVICE)
    with torch.inference_mode():
        assert torch.equal(tower.warm_up(pixels, batch), one(pixels, batch))
        assert not torch.equal(tower(pixels, batch), one(pixels, batch))
    assert len(tower.blocks) == PRESETS["tiny"].depth
