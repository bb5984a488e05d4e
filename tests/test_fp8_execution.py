"""``precision="fp8"``: the blocks' four GEMMs in FP8 (rowwise activations, per-channel weights,
``torch._scaled_mm``), on the CPU through torch's own FP8 kernel and Triton's interpreter. The
rounding is the kernel's, the error is the floor's (the reference with each GEMM's input rounded
to e4m3 at the same granularity), a non-finite item keeps to its rows, and what cannot run FP8
is refused by name. The GPU side (graphs, speed) is in test_cuda_fp8.py."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_FAMILIES, assert_nan_item_keeps_to_its_rows, random_pixels, rel_err

from vitgraph import GraphedVisionEncoder
from vitgraph.models import family_for
from vitgraph.models.fp8_floor import fp8_floor, reference_and_floor
from vitgraph.ops import fp8 as fp8_ops
from vitgraph.ops.fp8 import E4M3_MAX, MIN_SCALE, fake_quantize_rows, fake_quantize_weight, linear_fp8, \
    quantize_linear_, quantize_rows

FAMILIES = [name for name, tiny in TINY_FAMILIES.items() if tiny.cpu is not None]
GRIDS = [(1, 8, 8), (2, 4, 6)]


def config_of(family: str, **changes):
    tiny = TINY_FAMILIES[family]
    vision = {**tiny.cpu, **changes}
    return family_for(tiny.model_type).config.from_dict({"model_type": tiny.model_type, "vision_config": vision})


def test_each_row_is_scaled_by_its_own_maximum():
    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 1.0])[:, None]
    x[3] = 0.0
    x[4, 5] = float("nan")
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    for row in (0, 1, 2, 5):  # its largest value lands on e4m3's largest
        assert q[row].float().abs().max().item() == E4M3_MAX
        assert torch.equal(scale[row], x[row].abs().max().reshape(1) * (1.0 / E4M3_MAX))
    assert scale[3].item() == MIN_SCALE and not q[3].float().any()  # an all-zero row: zeros
    assert scale[4].isnan().all() and q[4].float().isnan().all()  # NaN spoils its own row only
    assert torch.isfinite(q[[0, 1, 2, 3, 5]].float()).all()
    dequantized = q.float() * scale
    rows = [0, 1, 2, 5]
    assert ((dequantized[rows] - x[rows]).abs() <= x[rows].abs().amax(1, keepdim=True) / 16).all()  # 3 mantissa bits


@pytest.mark.parametrize("rows", [1, 5])
def test_each_group_of_128_columns_is_scaled_by_its_own_maximum(rows):
    """quantize_groups: per row and 128 columns (a short last group at 300 wide), the scales laid
    out as cuBLAS takes them (stride (1, T), one row too), a NaN spoiling its own group only."""
    from vitgraph.ops.fp8 import group_scales, quantize_groups

    torch.manual_seed(2)
    x = torch.randn(rows, 300) * torch.tensor([1e-3] * 128 + [30.0] * 128 + [1.0] * 44)
    x[0, 130] = float("nan")
    q, scale = quantize_groups(x)
    assert q.shape == (rows, 300) and scale.shape == (rows, 3) and scale.stride() == (1, rows)
    assert scale[0, 1].isnan() and q[0, 128:256].float().isnan().all()
    assert torch.isfinite(scale[:, [0, 2]]).all() and torch.isfinite(q[:, :128].float()).all()
    for r in range(rows):
        for g, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
            if (r, g) != (0, 1):
                assert torch.equal(scale[r, g], x[r, cols].abs().max() * (1.0 / E4M3_MAX))
                assert q[r, cols].float().abs().max().item() == E4M3_MAX
    ok = torch.ones_like(x, dtype=torch.bool)
    ok[0, 128:256] = False
    dequantized = q.float() * group_scales(scale, 300)
    assert ((dequantized - x).abs()[ok] <= (group_scales(scale, 300) * E4M3_MAX / 16)[ok]).all()  # 3 mantissa bits


@pytest.mark.parametrize("rows", [5, 32])
def test_a_grouped_linear_is_the_product_of_its_groups(rows):
    """A grouped FP8 linear: each operand's every 128 columns times its own scale, one product
    (rows padded to whole 16s first, as cuBLAS takes them: the padding never reaches the output)."""
    from vitgraph.ops.fp8 import Fp8Weight, group_scales, quantize_groups

    torch.manual_seed(rows)
    linear = torch.nn.Linear(300, 48)
    linear.fp8 = Fp8Weight(*quantize_groups(linear.weight.detach() * torch.linspace(0.1, 10, 300)))
    x = torch.randn(rows, 300)
    q, scale = quantize_groups(x)
    got = linear_fp8((q, scale), linear)
    wide = (q.float() * group_scales(scale, 300)) @ (linear.fp8.q.float() * group_scales(linear.fp8.scale, 300)).t()
    assert got.shape == (rows, 48) and torch.equal(got, (wide + linear.bias.to(torch.bfloat16).float()).bfloat16())
    assert torch.equal(linear_fp8(x, linear, torch.float32), got.float())  # a tensor is quantized in groups


def test_an_fp8_linear_is_the_gemm_of_the_rounded_operands():
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 48)
    weight = linear.weight.detach().clone()
    quantize_linear_(linear)
    fp8_ops.release_float_(linear)
    assert linear.weight.is_meta and linear.weight.shape == weight.shape  # only the e4m3 copy is held
    assert fp8_ops.held_bytes(linear) == 64 * 48 + 4 * 48 + 4 * 48  # e4m3 weight, its scales, the fp32 bias
    x = torch.randn(32, 64)
    expected = F.linear(fake_quantize_rows(x), fake_quantize_weight(weight), linear.bias)
    got = linear_fp8(x, linear)
    assert got.dtype == x.dtype and rel_err(got, expected) < 4e-3  # the GEMM's bf16 output: the only other rounding
    assert linear.fp8[0].dtype == torch.float8_e4m3fn and linear.fp8[1].shape == (1, 48)
    assert "fp8" not in str(list(linear.state_dict()))  # not in state dicts


@pytest.mark.slow
@pytest.mark.parametrize("outliers", [False, True], ids=["plain", "outlier-channels"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_forward_sits_at_the_floor(family, outliers):
    """The FP8 encoder's distance from the fp32 reference is the floor's (rounding each GEMM's input
    and weight to e4m3), not more: within 1.1x of it (the issue's bound), with a few outlier
    channels in the GEMMs' inputs too (four channels of every norm 30x the rest)."""
    plain = GraphedVisionEncoder.from_config(config_of(family), device="cpu", progress=False)
    tower = plain.tower  # the FP8 encoder's tower keeps no float weights of its own
    if outliers:
        with torch.no_grad():
            for block in tower.blocks:
                for norm in (block.norm1, block.norm2):
                    norm.weight[[1, 5, 9, 13]] *= 30
    fp8 = GraphedVisionEncoder.from_state_dict(tower.state_dict(), config_of(family), device="cpu", precision="fp8",
                                               fuse=True, progress=False)
    assert all(fp8_ops.released(linear) for block in fp8.tower.blocks for linear in fp8.tower.block_linears(block))
    pixels = random_pixels(GRIDS, tower.input_width, 1)
    batch = tower.build_batch(GRIDS)
    reference, floor = reference_and_floor(tower, pixels, batch)
    with torch.inference_mode():
        assert torch.equal(tower.forward_reference(pixels, batch), reference)  # the floor restores the weights
    got = fp8.encode(pixels, GRIDS)
    errors = rel_err(got, reference), rel_err(floor, reference)
    print(f"\n[{family}{' outliers' if outliers else ''}] fp8 {errors[0]:.3e}, floor {errors[1]:.3e}")
    assert errors[1] > 1e-3 and errors[0] <= 1.1 * errors[1]
    assert fp8.stats()["precision"] == "fp8"


@pytest.mark.slow
def test_a_nan_item_keeps_to_its_rows_in_fp8():
    enc = GraphedVisionEncoder.from_config(config_of("qwen2_5_vl"), device="cpu", precision="fp8", fuse=True,
                                           progress=False)
    assert assert_nan_item_keeps_to_its_rows(enc, GRIDS, item=1, seed=2).isnan().all()


def test_what_cannot_run_fp8_is_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="precision must be one of"):
        GraphedVisionEncoder.from_config("tiny", device="cpu", precision="int8")
    with pytest.raises(ValueError, match="precision='fp8' runs its GEMMs on cuBLAS"):
        GraphedVisionEncoder.from_config("tiny", device="cpu", precision="fp8", gemm="quack")
    with pytest.raises(ValueError, match="use fuse=True or None"):
        GraphedVisionEncoder.from_config("tiny", device="cpu", precision="fp8", fuse=False)
    with pytest.raises(ValueError, match=r"multiples of 16; the Qwen2VisionTower has linears \(in, out\) \[\(72"):
        GraphedVisionEncoder.from_config(dataclasses.replace(config_of("qwen2_vl"), embed_dim=72, num_heads=2),
                                         device="cpu", precision="fp8", fuse=True)
    with pytest.raises(ValueError, match="use dtype bf16"):
        GraphedVisionEncoder.from_config("tiny", device="cpu", dtype=torch.float16, precision="fp8", fuse=True)
    from vitgraph.runtime.options import check_fp8_device
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(ValueError, match=r"compute capability 8.9 or more .* has \(8, 0\)"):
        check_fp8_device(torch.device("cuda"))
    for capability in ((8, 9), (10, 0)):  # Ada, Blackwell: no 1x128 scaling in cuBLAS
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        with pytest.raises(ValueError, match=rf"groups of 128 columns, .* Hopper only; .* \({capability[0]}, "):
            fp8_ops.check_grouped_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8_ops.check_grouped_device(torch.device("cuda"))
    fp8_ops.check_grouped_device(torch.device("cpu"))
    monkeypatch.delattr(torch.nn.functional, "scaled_mm")  # a torch before the block scalings
    with pytest.raises(ValueError, match=r"through torch.nn.functional.scaled_mm, which torch .* does not have"):
        fp8_ops.check_grouped_device(torch.device("cuda"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # no fused forward on a CPU then
    monkeypatch.setattr("vitgraph.ops.kernels.interpreted", lambda: False)
    with pytest.raises(ValueError, match="precision='fp8' runs in the fused forward"):
        GraphedVisionEncoder.from_config("tiny", device="cpu", precision="fp8")


def test_an_fp8_linear_refuses_scales_of_the_other_scaling():
    """Rowwise scales into a grouped weight (or the reverse) would be read at the wrong places."""
    from vitgraph.ops.fp8 import Fp8Weight, quantize_groups

    torch.manual_seed(3)
    x = torch.randn(16, 300)
    grouped, rowwise = torch.nn.Linear(300, 32), torch.nn.Linear(300, 32)
    grouped.fp8 = Fp8Weight(*quantize_groups(grouped.weight.detach()))
    quantize_linear_(rowwise)
    with pytest.raises(ValueError, match=r"scales \(16, 1\) do not fit a grouped weight \(32, 300\)"):
        linear_fp8(quantize_rows(x), grouped)
    with pytest.raises(ValueError, match=r"scales \(16, 3\) do not fit a rowwise weight"):
        linear_fp8(quantize_groups(x), rowwise)


def test_fp8_takes_no_quack_kernel():
    """With quack's tuning, an FP8 tower compiles no quack kernel: its GEMMs are cuBLAS's FP8 ones."""
    from vitgraph.checkpoints.loading import build_tower
    from vitgraph.engine.planner import Bucket, padded_batch
    from vitgraph.models import PRESETS, tower_dims
    from vitgraph.runtime.tuning import tuning_for

    tower = build_tower(dataclasses.replace(PRESETS["qwen2.5-vl-7b"], depth=2, fullatt_block_indexes=(1,)),
                        torch.device("cpu"), torch.bfloat16)
    tuning = tuning_for(tower_dims(tower.config), 9, 132)
    tower.set_attention_backend("fa4")
    tower.fused = True
    tower.set_tuning(dataclasses.replace(tuning.kernels, gemm=dataclasses.replace(tuning.gemm, backend="quack")))
    batch = padded_batch(tower, Bucket(4096, 16), [])
    assert {"qkv_rope", "fc1"} <= {op for op, _ in tower.jit_kernels(batch)}
    tower.set_precision("fp8", keep_float=True)
    assert {op for op, _ in tower.jit_kernels(batch)} == {"attention", "attention_2"}
    assert not tower.fused_paths(batch).bias_free and not tower.fused_paths(batch).rope_epilogue
    tower.set_precision("bf16")
    assert "qkv_rope" in {op for op, _ in tower.jit_kernels(batch)}
    tower.set_precision("fp8")  # the float weights released: no way back but a new load
    with pytest.raises(ValueError, match="float weights were released .* keep_float=True"):
        tower.forward_reference(torch.zeros(batch.positions.shape[0], tower.input_width), batch)
    with pytest.raises(ValueError, match="float weights were released"):
        with fp8_floor(tower):
            pass
    assert tower.to(torch.float32).blocks[0].attn.qkv.weight.is_meta  # Module.to leaves them be
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.qkv's float weight was released .* load the checkpoint"):
        tower.set_precision("bf16")
    assert {op for op, _ in tower.jit_kernels(batch)} == {"attention", "attention_2"}



def test_the_bench_reads_a_float_twin_of_an_fp8_encoder():
    """``vitgraph bench --precision fp8``: wrapping the FP8 tower in a second encoder keeps its
    released weights released (Module.to leaves meta tensors), and transformers' tower, which the
    FP8 tower cannot give float weights to, holds a bf16 load's instead: its rows are the plain
    tower's, not garbage from meta weights."""
    from vitgraph.bench import common
    from vitgraph.bench.args import latency_parser
    from vitgraph.cli_args import resolve_model_args
    from vitgraph.ops.fp8 import held_bytes

    args = latency_parser().parse_args(["--preset", "tiny", "--device", "cpu", "--precision", "fp8"])
    resolve_model_args(args)
    runners, eager, _ = common.build_systems(args, ["vitgraph_eager", "hf_eager"], 1024, precision="fp8", fuse=True)
    twin = common.float_twin(args, eager, fuse=True)
    assert eager.options.precision == "fp8" and twin.options.precision == "bf16"
    assert held_bytes(eager.tower) < 0.75 * held_bytes(twin.tower)
    grids = [(1, 8, 8)]
    pixels = random_pixels(grids, eager.tower.input_width, 5)
    plain = twin.encode(pixels, grids)
    assert rel_err(runners["hf_eager"](pixels, grids), plain) < 1e-5  # transformers' tower on the float twin
    assert 1e-3 < rel_err(runners["vitgraph_eager"](pixels, grids), plain) < 0.15  # FP8's rounding, bounded


@pytest.mark.slow
def test_the_fp8_bench_writes_a_block_checkpoint_that_runs_grouped(tmp_path):
    """benchmarks/fp8.py --weights block: the weights written as a hub-layout block FP8 checkpoint
    load back as they were dequantized (the bf16 encoder equals the fp32 reference), and the FP8
    encoder runs them grouped, at its floor."""
    import importlib.util
    from pathlib import Path

    from vitgraph.checkpoints.loading import build_tower

    spec = importlib.util.spec_from_file_location("fp8_bench", Path(__file__).parents[1] / "benchmarks" / "fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tiny = TINY_FAMILIES["qwen3_vl"]
    config = family_for(tiny.model_type).config.from_dict({"model_type": tiny.model_type, "vision_config": tiny.cuda})
    torch.manual_seed(0)
    state = build_tower(config, torch.device("cpu"), torch.float32).state_dict()
    encoders, reference = bench.build_encoders(config, state, torch.device("cpu"), torch.float32, tmp_path)
    assert (tmp_path / "config.json").is_file() and encoders["fp8"].tower.fp8_grouped
    pixels = random_pixels(GRIDS, reference.input_width, 1)
    batch = reference.build_batch(GRIDS)
    ref, floor = reference_and_floor(reference, pixels, batch)
    assert rel_err(encoders["bf16"].encode(pixels, GRIDS), ref) < 1e-5
    assert rel_err(encoders["fp8"].encode(pixels, GRIDS), ref) <= 1.1 * rel_err(floor, ref)


@pytest.mark.slow
@pytest.mark.parametrize("preset, plain", [("qwen2-vl-2b", ("proj", "fc1", "fc2")),
                                           ("qwen2.5-vl-7b", ("proj", "down_proj")),
                                           ("qwen3-vl-8b", ("proj", "linear_fc1", "linear_fc2"))])
def test_a_block_checkpoints_linears_in_row_order_keep_128x128_scales(tmp_path, preset, plain):
    """At the released widths (two blocks), a 128x128 block checkpoint's linears whose rows the
    tower keeps in order (proj and the MLP's, short last blocks included) keep the 128x128 blocks
    (the faster GEMM); the interleaved qkv and Qwen2.5-VL's joined, padded gate_up read per row."""
    import importlib.util
    from pathlib import Path

    from vitgraph.checkpoints.loading import build_tower
    from vitgraph.models import PRESETS
    from vitgraph.models.tower_base import one_block_fields

    spec = importlib.util.spec_from_file_location("fp8_bench", Path(__file__).parents[1] / "benchmarks" / "fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = dataclasses.replace(PRESETS[preset], **one_block_fields(PRESETS[preset]))
    torch.manual_seed(0)
    state = build_tower(config, torch.device("cpu"), torch.float32).state_dict()
    ckpt = bench.write_block_checkpoint(config, state, tmp_path)
    tower = GraphedVisionEncoder.from_pretrained(ckpt, device="cpu", precision="fp8", fuse=True, progress=False).tower
    kept = {name.rsplit(".", 1)[1] for name, m in tower.named_modules() if getattr(m, "fp8", None) is not None
            and m.fp8.blocks is not None}
    assert kept == set(plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp8_mlp_of_many_rows_runs_in_chunks_to_the_same_rows(family, monkeypatch):
    """Past ``FP8_MLP_ROWS`` rows, the MLP's first GEMM and its activation run a chunk of rows at a
    time (fc1's bf16 output held for one chunk: the pool's bound), into one e4m3 activation: the
    same output as in one piece, a short last chunk included."""
    from vitgraph.models import fused_loop

    enc = GraphedVisionEncoder.from_config(config_of(family), device="cpu", precision="fp8", fuse=True,
                                           progress=False)
    pixels = random_pixels(GRIDS, enc.tower.input_width, 4)
    whole = enc.encode(pixels, GRIDS)
    shapes = []
    gemm = fp8_ops.linear_fp8
    monkeypatch.setattr(fp8_ops, "linear_fp8", lambda x, linear, *a: shapes.append(x[0].shape[0]) or gemm(x, linear, *a))
    monkeypatch.setattr(fused_loop, "FP8_MLP_ROWS", 24)
    chunked = enc.encode(pixels, GRIDS)
    tokens = sum(t * h * w for t, h, w in GRIDS)  # 112: four chunks of 24 and one of 16, per block
    assert shapes.count(24) == 4 * len(enc.tower.blocks) and shapes.count(tokens % 24) == len(enc.tower.blocks)
    assert torch.equal(chunked, whole)


@pytest.mark.parametrize("rows, groups", [(300, 10), (128, 3), (5, 1), (1152, 34)])
def test_block_scales_are_cublas_128x128_layout_of_the_groups(rows, groups):
    """Grouped scales whose aligned 128-row blocks share their values, as cuBLAS's 128x128 blocks of
    the GEMM's second operand: ``[round_up(G, 4), ceil(N / 128)]``, stride ``(1, round_up(G, 4))``,
    block ``(k, n)`` the scale of rows ``128 n ...`` and group ``k``; back to the groups exactly; and
    none where a block's rows differ."""
    from vitgraph.ops.fp8 import Fp8Weight, block_scales, column_major, with_blocks

    per_block = torch.rand(-(-rows // 128), groups) + 0.5
    grouped = column_major(per_block.repeat_interleave(128, 0)[:rows])
    blocks = block_scales(grouped)
    padded = -(-groups // 4) * 4
    assert blocks.shape == (padded, per_block.shape[0]) and blocks.stride() == (1, padded)
    assert blocks.dtype == torch.float32 and torch.equal(blocks[:groups], per_block.t())
    assert torch.equal(blocks.t()[:, :groups].repeat_interleave(128, 0)[:rows], grouped)  # back to the groups
    if rows > 1:
        changed = grouped.clone()
        changed[rows - 1, groups - 1] *= 2  # the last block's last row differs from its first
        assert block_scales(changed) is None
    q = torch.zeros(rows, 128 * groups, dtype=torch.float8_e4m3fn)
    assert torch.equal(with_blocks(Fp8Weight(q, grouped)).blocks, blocks)  # a CPU has no GEMM to check them



def test_128x128_scales_are_dropped_where_the_device_gemm_disagrees(monkeypatch):
    """with_blocks' check on the device (here its GEMM stood in for): blocks whose products differ
    from 1x128's, or that cuBLAS refuses, are not kept."""
    from vitgraph.ops import fp8 as ops
    from vitgraph.ops.fp8 import Fp8Weight, column_major

    weight = Fp8Weight(torch.randn(128, 256).to(torch.float8_e4m3fn), column_major(torch.ones(128, 2)))
    blocked = weight._replace(blocks=ops.block_scales(weight.scale))
    real = ops._grouped_mm
    assert ops._blocks_disagree(weight, blocked) is None
    monkeypatch.setattr(ops, "_grouped_mm", lambda q, s, w, b: real(q, s, w, b) * (1 if w.blocks is None else 1.5))
    assert "relative difference 5.0e-01" in ops._blocks_disagree(weight, blocked)

    def refused(q, s, w, b):
        if w.blocks is not None:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return real(q, s, w, b)

    monkeypatch.setattr(ops, "_grouped_mm", refused)
    assert ops._blocks_disagree(weight, blocked) == "CUBLAS_STATUS_NOT_SUPPORTED"

    def shape_refused(q, s, w, b):  # torch's TORCH_CHECK_VALUE on a scale's shape is a ValueError
        if w.blocks is not None:
            raise ValueError("scale_b must have shape ...")
        return real(q, s, w, b)

    monkeypatch.setattr(ops, "_grouped_mm", shape_refused)
    assert ops._blocks_disagree(weight, blocked) == "scale_b must have shape ..."
