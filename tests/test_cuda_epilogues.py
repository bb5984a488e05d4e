"""quack's GEMM epilogues in every family's graphs, at the released towers' widths (two blocks:
one of each kind): qkv with the rotary, the MLP's first GEMM with its activation (Qwen2-VL's
QuickGELU, Qwen3's GELU-tanh) or with ``silu(gate) * up`` (Qwen2.5-VL's SwiGLU, its [gate; up]
rows read as pairs). The forward takes them, replays bitwise equal to eager, stays as close to
the fp32 reference as the cuBLAS path, and keeps a NaN item away from the others' rows.

Needs a Hopper GPU and quack-kernels (the ``fa4`` extra); ``python -m pytest -m cuda -s``.
"""

import dataclasses

import pytest
import torch
from helpers import assert_nan_item_keeps_to_its_rows, assert_replays_equal_eager, random_pixels, rel_err

from vitgraph import GraphedVisionEncoder
from vitgraph.checkpoints.loading import build_tower
from vitgraph.engine.planner import padded_batch
from vitgraph.models import PRESETS
from vitgraph.models.tower_base import one_block_fields

pytestmark = pytest.mark.cuda

PRESET_NAMES = ["qwen2-vl-2b", "qwen2.5-vl-7b", "qwen3-vl-8b", "qwen3.5-768"]
GRIDS = [(1, 32, 32), (1, 20, 28), (2, 16, 16), (1, 8, 12)]  # 2,160 tokens: the 4,096 bucket


def _quack_or_skip():
    from vitgraph.ops.gemm import quack_available

    if not torch.cuda.is_available() or not quack_available("cuda"):
        pytest.skip("needs a Hopper GPU and quack-kernels (the fa4 extra)")


@pytest.fixture(scope="module", params=PRESET_NAMES)
def weights(request):
    _quack_or_skip()
    config = PRESETS[request.param]
    config = dataclasses.replace(config, **one_block_fields(config))
    torch.manual_seed(0)
    tower = build_tower(config, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # norms and biases away from 1 and 0, as trained ones are
        for name, p in tower.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.05 * torch.randn_like(p))
    return request.param, config, tower.state_dict()


def encoder(weights, gemm):
    _, config, state = weights
    return GraphedVisionEncoder.from_state_dict(state, config, device="cuda", dtype=torch.bfloat16, gemm=gemm,
                                                budgets=[1024, 4096], max_items=8, progress=False)


@pytest.fixture(scope="module")
def encoders(weights):
    return encoder(weights, "quack"), encoder(weights, "cublas")


def test_the_forward_takes_the_epilogues(encoders, weights):
    quack, plain = encoders
    for enc, expect in ((quack, {"qkv_rope", "fc1"}), (plain, set())):
        bucket = enc.bank.buckets[-1]
        ops = {op for op, _ in enc.tower.jit_kernels(padded_batch(enc.tower, bucket, []))}
        assert expect <= ops and not (ops & {"qkv_rope", "fc1"}) - expect, (weights[0], enc.tuning.gemm.backend, ops)


def test_replay_is_bitwise_equal_to_eager(encoders):
    assert_replays_equal_eager(encoders[0].bank)


def test_as_close_to_fp32_as_the_cublas_path(encoders, weights):
    name, config, state = weights
    reference = build_tower(config, torch.device("cuda"), torch.float32)
    reference.load_state_dict(state)
    pixels = random_pixels(GRIDS, reference.input_width, seed=3).cuda()
    with torch.inference_mode():
        ref = reference.forward_reference(pixels, reference.build_batch(GRIDS).to(torch.device("cuda")))
    errors = [rel_err(enc.encode(pixels, GRIDS).float(), ref) for enc in encoders]
    print(f"\n[{name}] bf16 graphs vs fp32: epilogues {errors[0]:.3e}, cuBLAS {errors[1]:.3e}")
    assert errors[0] <= 1.1 * errors[1] and errors[0] < 2e-2


def test_a_nan_item_leaves_the_others_rows_bitwise(encoders):
    assert not torch.isfinite(assert_nan_item_keeps_to_its_rows(encoders[0], GRIDS, item=1, seed=4)).all()


@pytest.mark.parametrize("activation, gated, n, k", [("quick_gelu", False, 5120, 1280),
                                                     ("gelu_pytorch_tanh", False, 4304, 1152),
                                                     ("silu", True, 2 * 3456, 1280)],
                         ids=["qwen2-vl-2b fc1", "qwen3-vl-8b linear_fc1", "qwen2.5-vl-7b gate_up"])
def test_mlp_epilogue_against_the_fp32_math(activation, gated, n, k):
    """The MLP's first GEMM with its activation in quack's epilogue, at the released widths (Qwen2.5's
    gate_up padded to 3456 per half): as close to the fp32 math as cuBLAS plus the Triton pass, and
    a graph replay on new inputs equal to an eager call."""
    _quack_or_skip()
    from vitgraph.ops import kernels
    from vitgraph.ops.activations import ACTIVATIONS
    from vitgraph.ops.gemm import GemmTuning, linear_act

    tuning = GemmTuning(backend="quack")
    torch.manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1
    for rows in (1024, 4096):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        f32 = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        f = torch.nn.functional.linear(x, weight, bias)
        if gated:
            gate, up = f32.chunk(2, dim=-1)
            ref, plain = ACTIVATIONS[activation](gate) * up, kernels.silu_mul(f)
        else:
            ref, plain = ACTIVATIONS[activation](f32), kernels.activation_(f, activation)
        got = linear_act(x, weight, bias, activation, gated, tuning)
        errors = rel_err(got.float(), ref), rel_err(plain.float(), ref)
        print(f"\n[{activation} gated={gated}] rows={rows}: epilogue {errors[0]:.3e}, cuBLAS + Triton {errors[1]:.3e}")
        assert got.shape == plain.shape and errors[0] <= 1.1 * errors[1]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = linear_act(x, weight, bias, activation, gated, tuning)
        x.copy_(torch.randn_like(x))  # new input: the replay must really run the GEMM
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, linear_act(x, weight, bias, activation, gated, tuning))
