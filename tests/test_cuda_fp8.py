"""``precision="fp8"`` in CUDA graphs, at the released towers' widths (two blocks: one of each
kind): every bucket replays bitwise equal to eager, a NaN item leaves the others' rows bitwise,
and the error from the fp32 reference stays within 1.1x the floor's (each GEMM's input and weight
rounded to e4m3 at the kernel's granularity, :mod:`vitgraph.models.fp8_floor`).

Needs a GPU of compute capability 8.9 or more; ``python -m pytest -m cuda -s``.
"""

import dataclasses

import pytest
import torch
from helpers import assert_nan_item_keeps_to_its_rows, assert_replays_equal_eager, random_pixels, rel_err

from vitgraph import GraphedVisionEncoder
from vitgraph.checkpoints.loading import build_tower
from vitgraph.models import PRESETS
from vitgraph.models.fp8_floor import reference_and_floor
from vitgraph.models.tower_base import one_block_fields

pytestmark = pytest.mark.cuda

PRESET_NAMES = ["qwen2-vl-2b", "qwen2.5-vl-7b", "qwen3-vl-8b"]
GRIDS = [(1, 32, 32), (1, 20, 28), (2, 16, 16), (1, 8, 12)]


@pytest.fixture(scope="module", params=PRESET_NAMES)
def setup(request):
    needs_fp8()
    config = PRESETS[request.param]
    config = dataclasses.replace(config, **one_block_fields(config))
    torch.manual_seed(0)
    state = build_tower(config, torch.device("cpu"), torch.float32).state_dict()
    encoders = {precision: GraphedVisionEncoder.from_state_dict(
        state, config, device="cuda", dtype=torch.bfloat16, precision=precision, budgets=[1024, 4096], max_items=8,
        progress=False) for precision in ("fp8", "bf16")}
    return request.param, config, state, encoders


def test_replay_is_bitwise_equal_to_eager_in_fp8(setup):
    assert_replays_equal_eager(setup[3]["fp8"].bank)


def test_fp8_graphs_sit_at_the_floor(setup):
    name, config, state, encoders = setup
    reference = build_tower(config, torch.device("cuda"), torch.float32)
    reference.load_state_dict(state)
    pixels = random_pixels(GRIDS, reference.input_width, seed=3).cuda()
    batch = reference.build_batch(GRIDS).to(torch.device("cuda"))
    ref, floor = reference_and_floor(reference, pixels, batch)
    fp8, bf16 = (rel_err(encoders[p].encode(pixels, GRIDS).float(), ref) for p in ("fp8", "bf16"))
    print(f"\n[{name}] from fp32: fp8 graphs {fp8:.3e}, floor {rel_err(floor, ref):.3e}, bf16 graphs {bf16:.3e}")
    assert fp8 <= 1.1 * rel_err(floor, ref)


def test_a_nan_item_leaves_the_others_rows_bitwise_in_fp8(setup):
    assert_nan_item_keeps_to_its_rows(setup[3]["fp8"], GRIDS, item=1, seed=4)


@pytest.mark.parametrize("preset", ["qwen2-vl-2b", "qwen2.5-vl-7b"])
def test_an_fp8_pool_is_no_larger_than_bf16s_at_16384_tokens(preset):
    """At 16384 tokens the FP8 MLP runs fc1 and its activation 4096 rows at a time, so fc1's bf16
    output (gate_up's double width for Qwen2.5-VL) and the whole e4m3 activation take no more than
    bf16's one activation: the graph pool is no larger than bf16's, and replays equal eager."""
    needs_fp8()
    config = PRESETS[preset]
    config = dataclasses.replace(config, **one_block_fields(config))
    torch.manual_seed(0)
    state = build_tower(config, torch.device("cpu"), torch.float32).state_dict()
    encoders = {precision: GraphedVisionEncoder.from_state_dict(
        state, config, device="cuda", dtype=torch.bfloat16, precision=precision, budgets=[16384], max_items=1,
        progress=False) for precision in ("fp8", "bf16")}
    pools = {p: enc.stats()["pool_bytes"] / 2**20 for p, enc in encoders.items()}
    print(f"\n[{preset}] pool at 16384 tokens: fp8 {pools['fp8']:.0f} MiB, bf16 {pools['bf16']:.0f} MiB")
    assert pools["fp8"] <= pools["bf16"]
    assert_replays_equal_eager(encoders["fp8"].bank)


def needs_fp8(hopper: bool = False):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability 8.9 or more)")
    if hopper and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("grouped (1x128) FP8 GEMMs run on Hopper (cuBLAS)")


@pytest.mark.parametrize("grouped", [False, True], ids=["rows", "groups"])
@pytest.mark.parametrize("width", [1280, 4304, 96])
def test_the_quantizing_kernels_round_as_torch_does(width, grouped):
    """The kernels that hand FP8 GEMMs their inputs (vitgraph.ops.fp8_kernels) give the e4m3 values
    and scales of vitgraph.ops.fp8.quantize_rows (grouped: quantize_groups, a short last group at
    4304, one group narrower than 128 at 96), bit for bit: attention's output, the norms' and the
    activations' (with a zero row and a NaN row among them), in more than one launch layout."""
    needs_fp8()
    from vitgraph.ops import kernels
    from vitgraph.ops.fp8 import quantize_groups, quantize_rows as by_rows
    from vitgraph.ops.fp8_kernels import activation_fp8, add_norm_fp8, quantize_rows_fp8
    from vitgraph.ops.kernels import LayerNormLaunch

    quantize_rows = quantize_groups if grouped else by_rows

    def same(got, expected, what, near=False):  # NaN where NaN (its sign bit may differ), the same bits elsewhere
        nan = expected[0].float().isnan()
        assert torch.equal(got[0].float().isnan(), nan), what
        bits, want = got[0].view(torch.uint8)[~nan], expected[0].view(torch.uint8)[~nan]
        if not near:
            assert torch.equal(bits, want), what
            torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0, equal_nan=True, msg=what)
            return
        # The norms' QUANT variant sums its rows in another order than the plain kernel, so a
        # normalized value may differ in its last bf16 bit: then one e4m3 step, rarely (an H100
        # showed 1-2 of 1.15-3.5 million); a layout or scale bug would differ everywhere.
        steps = (bits.to(torch.int16) - want.to(torch.int16)).abs()
        assert int(steps.max()) <= 1 and int((steps > 0).sum()) <= bits.numel() // 10_000, what
        torch.testing.assert_close(got[1], expected[1], rtol=2.0 ** -7, atol=0, equal_nan=True, msg=what)

    torch.manual_seed(0)
    x = torch.randn(1001, width, device="cuda", dtype=torch.bfloat16) * 3
    x[5] = 0
    x[7, 3] = float("nan")
    x[9, -1] = 1e4  # an outlier in the last (short) group
    for launch in (LayerNormLaunch(1, 8), LayerNormLaunch(4, 8)):
        same(quantize_rows_fp8(x, launch, grouped=grouped), quantize_rows(x), f"rows {launch}")
    w, b = torch.randn(width, device="cuda"), torch.randn(width, device="cuda")
    for rms in (False, True):
        stream = torch.randn(1001, width, device="cuda", dtype=torch.bfloat16)
        got = add_norm_fp8(stream.clone(), x, w, b, 1e-6, rms=rms, grouped=grouped)
        same(got, quantize_rows(kernels.add_layernorm(stream.clone(), x, w, b, 1e-6, rms=rms)), f"norm rms={rms}",
             near=True)
    for name, launch in (("quick_gelu", LayerNormLaunch(1, 8)), ("gelu_pytorch_tanh", LayerNormLaunch(2, 8)),
                         ("silu", LayerNormLaunch(1, 8))):
        same(activation_fp8(x, name, False, launch, grouped), quantize_rows(kernels.activation_(x.clone(), name)),
             f"{name} {launch}")
    same(activation_fp8(x, "silu", True, grouped=grouped), quantize_rows(kernels.silu_mul(x)), "silu * up")
    # Into rows 300:700 of a larger pair (the chunked MLP's): its scales' column stride is the pair's.
    from vitgraph.ops.fp8_kernels import fp8_outputs
    whole = fp8_outputs(1001, width, grouped, x.device)
    whole[0].view(torch.uint8).fill_(0x7F)  # e4m3 NaN: rows outside the slice must keep it
    whole[1].fill_(float("nan"))
    activation_fp8(x[300:700], "quick_gelu", False, grouped=grouped, out=(whole[0][300:700], whole[1][300:700]))
    same((whole[0][300:700], whole[1][300:700]), quantize_rows(kernels.activation_(x[300:700].clone(), "quick_gelu")),
         "into rows of a larger pair")
    outside = torch.cat([torch.arange(300), torch.arange(700, 1001)]).cuda()
    assert whole[0][outside].float().isnan().all() and whole[1][outside].isnan().all(), "rows outside the slice"


@pytest.mark.parametrize("blocks", [False, True], ids=["1x128", "128x128"])
@pytest.mark.parametrize("rows", [1, 200, 4095])
@pytest.mark.parametrize("out_features, in_features", [(3840, 1280), (1152, 4304), (1280, 3456), (4304, 1152)])
def test_a_grouped_gemm_is_the_product_of_its_groups(rows, out_features, in_features, blocks):
    """cuBLAS's 1x128 x 1x128 GEMM (as vitgraph lays out the scales) gives the fp32 product of the
    rounded operands, each group times its own scale, to bf16's rounding: a scale read from the
    wrong place would be off by far more (at odd row counts and a short last group too). So does
    1x128 x 128x128 for a weight whose 128-row blocks share their scales (a block checkpoint's),
    whose layout with_blocks keeps only where it agrees with 1x128 on the device."""
    needs_fp8(hopper=True)
    from vitgraph.ops.fp8 import (E4M3, E4M3_MAX, Fp8Weight, column_major, group_scales, linear_fp8,
                                  quantize_groups, with_blocks)

    torch.manual_seed(rows)
    columns = 1 + 3 * torch.rand(1, in_features, device="cuda")  # groups of differing ranges
    x = torch.randn(rows, in_features, device="cuda") * columns
    linear = torch.nn.Linear(in_features, out_features, device="cuda")
    weight = linear.weight.detach() * columns
    if blocks:  # one scale per 128 x 128 block (the last ones cropped), spread over its rows
        tiles = torch.nn.functional.pad(weight, (0, -in_features % 128, 0, -out_features % 128))
        per_block = tiles.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).abs().amax((1, 3)) / E4M3_MAX
        spread = per_block.repeat_interleave(128, 0)[:out_features]
        q = (weight / group_scales(spread, in_features)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        linear.fp8 = with_blocks(Fp8Weight(q, column_major(spread)))
        assert linear.fp8.blocks is not None, "128x128 scales disagreed with 1x128 on this device"
    else:
        linear.fp8 = with_blocks(Fp8Weight(*quantize_groups(weight)))
        assert linear.fp8.blocks is None  # rows of their own scales
    q, scale = quantize_groups(x)
    got = linear_fp8((q, scale), linear)
    expected = ((q.float() * group_scales(scale, in_features))
                @ (linear.fp8.q.float() * group_scales(linear.fp8.scale, in_features)).t() + linear.bias)
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), expected) < 4e-3


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_a_block_checkpoint_runs_grouped_in_graphs(tmp_path, family):
    """A block FP8 checkpoint (128 x 128) with precision="fp8": its own e4m3 weights in grouped
    GEMMs, replay = eager bitwise (a 1020-token bucket's rows padded to whole 16s inside its graph),
    at the floor of rounding its activations in groups, a NaN item keeping to its rows."""
    needs_fp8(hopper=True)
    from test_fp8_loading import BLOCK, float_state, quantize, write

    ckpt = write(tmp_path / "fp8", family, quantize(float_state(family, "cuda"), (128, 128))[0], BLOCK, size="cuda")
    enc = GraphedVisionEncoder.from_pretrained(ckpt, device="cuda", dtype=torch.bfloat16, precision="fp8",
                                               budgets=[1020, 2048], max_items=8, progress=False)
    assert enc.tower.fp8_grouped
    assert_replays_equal_eager(enc.bank)
    reference = GraphedVisionEncoder.from_pretrained(ckpt, device="cuda", dtype=torch.float32, fuse=False,
                                                     progress=False).tower
    grids = [(1, 16, 16), (2, 8, 12), (1, 4, 4)]
    pixels = random_pixels(grids, reference.input_width, seed=5).cuda()
    batch = reference.build_batch(grids).to(torch.device("cuda"))
    ref, floor = reference_and_floor(reference, pixels, batch)
    got = rel_err(enc.encode(pixels, grids).float(), ref)
    print(f"\n[{family} block FP8] from fp32: grouped graphs {got:.3e}, floor {rel_err(floor, ref):.3e}")
    assert got <= 1.1 * rel_err(floor, ref)
    assert_nan_item_keeps_to_its_rows(enc, grids, item=1, seed=6)
