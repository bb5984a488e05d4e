"""GPU behaviour of the reference-forward families in CUDA graphs: Qwen2.5-VL (window
attention, two padded segmentations, window gathers) and Qwen3-VL (interpolation taps,
deepstack outputs in the one output). Every bucket replays bitwise equal to eager on the same
buffers, NaN in the pool and the padding rows never reaches a returned row with any attention
kernel, bf16 graphs stay within transformers' own bf16 distance of the fp32 reference, and
1,000 mixed calls match eager.

Run on a CUDA machine with ``python -m pytest -m cuda -s`` (``-s`` shows the numbers).
"""

import random

import pytest
import torch
from helpers import diff_report, randomize_, rel_err, run_eager

from vitgraph import GraphedVisionEncoder
from vitgraph.engine.planner import padded_batch
from vitgraph.ops.attention import available_backends

pytestmark = pytest.mark.cuda

# head_dim 80 (Qwen2.5-VL's) and 72 (Qwen3-VL-8B's), small enough to capture in seconds.
# Qwen2.5: full attention in the first and last blocks, windows in between; Qwen3: a deepstack
# merger after the first block and after the last, and an 8 x 8 position grid. The "released"
# layouts start with a plain block as released checkpoints do (Qwen2.5-VL's full attention at
# 7, 15, 23, 31; Qwen3-VL's mergers after 8, 16, 24): a capture's warm-up must reach the other
# kind. Qwen3.5: Qwen3-VL's tower with no deepstack merger.
_RELEASED = {"qwen2_5_vl_released": ("qwen2_5_vl", dict(fullatt_block_indexes=[3])),
             "qwen3_vl_released": ("qwen3_vl", dict(depth=4, deepstack_visual_indexes=[1, 3])),
             "qwen3_5": ("qwen3_vl", {})}
FAMILIES = {
    "qwen2_5_vl": dict(depth=4, hidden_size=320, num_heads=4, intermediate_size=640, out_hidden_size=256,
                       window_size=112, fullatt_block_indexes=[0, 3], hidden_act="silu", patch_size=14,
                       temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
    "qwen3_vl": dict(depth=3, hidden_size=288, num_heads=4, intermediate_size=576, out_hidden_size=128,
                     num_position_embeddings=64, deepstack_visual_indexes=[0, 2], hidden_act="gelu_pytorch_tanh",
                     patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
}
FAMILIES.update({name: {**FAMILIES[base], **changes} for name, (base, changes) in _RELEASED.items()})
del FAMILIES["qwen3_5"]["deepstack_visual_indexes"]  # Qwen3.5's configs may have no such field
MODEL_TYPES = {name: name.removesuffix("_released") for name in FAMILIES}
BUDGETS = [64, 128, 256, 512, 1024]
MAX_ITEMS = 8
_HERE = available_backends("cuda") if torch.cuda.is_available() else ()
# Every packed backend, each skipped with a reason where this machine's GPU lacks it.
PACKED = [pytest.param(b, marks=pytest.mark.skipif(b not in _HERE,
                                                   reason=f"needs the {b} attention backend on a CUDA GPU"))
          for b in ("fa4", "cudnn", "varlen")]


def hf_model(family: str):
    if MODEL_TYPES[family] == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Model)
    elif MODEL_TYPES[family] == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig as Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel as Model
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Model
    cfg = Config(**FAMILIES[family])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(3)
    return randomize_(Model(cfg).float().eval())


def hf_reference(model, family, pixels, grids):
    """The fp32 reference in vitgraph's layout (Qwen3: main, then each deepstack feature)."""
    with torch.no_grad():
        out = model(pixels, grid_thw=torch.tensor(grids))
    if getattr(out, "deepstack_features", None):
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
    return out.pooler_output


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def weights(family):
    model = hf_model(family)
    state = {"visual." + k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, state, {"model_type": MODEL_TYPES[family], "vision_config": FAMILIES[family]}


def make(weights, **options):
    _, state, config = weights
    options = {"device": "cuda", "dtype": torch.bfloat16, "budgets": BUDGETS, "max_items": MAX_ITEMS,
               "dense_max_tokens": BUDGETS[-1], "route_to_faster_buckets": False, "progress": False, **options}
    return GraphedVisionEncoder.from_state_dict(state, config, **options)


@pytest.fixture(scope="module")
def graph_enc(weights):
    return make(weights, mode="graph")


@pytest.fixture(scope="module")
def eager_enc(weights):
    return make(weights, mode="eager")


def random_grids(rng, n, max_frames=3, max_side=16):
    """Even sides of 2..max_side patches: most are no multiple of the 8-patch window, so windows
    are cut by the frame's edge."""
    return [(rng.choice([1] * 4 + list(range(2, max_frames + 1))), 2 * rng.randint(1, max_side // 2),
             2 * rng.randint(1, max_side // 2)) for _ in range(n)]


def pixels_for(enc, grids, seed):
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, enc.config.patch_width, generator=torch.Generator().manual_seed(seed)).cuda()


def test_graphs_are_captured_for_every_bucket(graph_enc):
    stats = graph_enc.stats()
    assert stats["mode"] == "graph" and stats["dropped_buckets"] == {}
    assert [b.name for b in graph_enc.bank.buckets] == [f"{b}x{n}" for b in BUDGETS
                                                        for n in (1, min(MAX_ITEMS, b // 4))]
    print(f"\n[{type(graph_enc.tower).__name__}] attention={graph_enc.attention} buckets={len(graph_enc.buckets)} "
          f"pool {stats['pool_bytes'] / 2**20:.1f} MiB")


def test_every_bucket_replay_is_bitwise_equal_to_eager_on_the_same_buffers(graph_enc):
    """Every output column (Qwen3: the deepstack features too), every bucket, dense and packed."""
    bank, rng = graph_enc.bank, random.Random(0)
    for bucket in bank.buckets:
        grids = []
        while len(grids) < bucket.max_segments:
            g = random_grids(rng, 1, max_frames=1, max_side=min(16, int(bucket.tokens ** 0.5)))[0]
            if sum(t * h * w for t, h, w in grids) + g[1] * g[2] > 0.75 * bucket.tokens:
                break
            grids.append(g)
        grids = grids or [(1, 2, 2)]
        tokens = sum(t * h * w for t, h, w in grids)
        staged = bank.stage(padded_batch(bank.model, bucket, grids))
        bank.load(bucket, pixels_for(graph_enc, grids, bucket.tokens).bfloat16(), staged)
        replayed = bank.replay(bucket)[:tokens // 4].clone()
        eager = run_eager(bank, bucket)[:tokens // 4]
        assert replayed.shape[1] == graph_enc.output_width
        assert torch.equal(replayed, eager), f"bucket {bucket.name}: {diff_report(replayed, eager)}"
        print(f"\n[bitwise] bucket {bucket.name:>7}: {len(grids)} frames, {tokens} tokens, replay == eager")


@pytest.mark.parametrize("backend", PACKED)
def test_bf16_graphs_match_the_fp32_reference(weights, family, backend):
    model = weights[0]
    enc = make(weights, mode="graph", attention=backend)
    rng = random.Random(5)
    worst = 0.0
    for trial in range(6):
        grids = random_grids(rng, rng.randint(1, 4))
        pixels = pixels_for(enc, grids, 50 + trial)
        ref = hf_reference(model, family, pixels.cpu(), grids)
        got = enc.encode(pixels, grids).float().cpu()
        assert torch.isfinite(got).all() and rel_err(got, ref) <= 3e-2, (grids, diff_report(got, ref))
        worst = max(worst, rel_err(got, ref))
    assert enc.stats()["mode"] == "graph" and sum(b["replays"] for b in enc.stats()["buckets"].values()) > 0
    print(f"\n[{family} {backend}] bf16 graphs vs fp32 transformers: worst rel {worst:.2e}")


@pytest.mark.parametrize("backend", PACKED)
def test_poisoned_pool_and_padding_never_reach_outputs(weights, backend):
    """Run the largest graph on NaN pixels with no real segment (every activation in the shared
    pool becomes NaN), poison the static pixel buffer's padding rows, then encode: FlashAttention
    4 reads key rows past a window's or frame's end, weighted 0, and 0 * NaN is NaN."""
    enc = make(weights, mode="graph", attention=backend, dense_max_tokens=None)
    eager_enc = make(weights, mode="eager", attention=backend)  # the same kernels, so the bound is tight
    bank = enc.bank
    largest = bank.buckets[-1]
    bank.static_pixels.fill_(float("nan"))
    bank.load(largest, bank.static_pixels[:0], bank.stage(padded_batch(bank.model, largest, [])))
    bank.replay(largest)
    torch.cuda.synchronize()
    bank.static_pixels.fill_(float("nan"))
    rng = random.Random(2)
    for trial in range(30):
        grids = random_grids(rng, rng.randint(1, 4))
        pixels = pixels_for(enc, grids, 100 + trial)
        got = enc.encode(pixels, grids)
        assert torch.isfinite(got).all(), f"NaN leaked for {grids}"
        assert rel_err(got, eager_enc.encode(pixels, grids)) <= 1e-2


def test_thousand_mixed_calls(graph_enc, eager_enc):
    """Graphs against eager calls of the same weights. Their row counts differ (a bucket's
    against the call's), so cuBLAS may take other kernels, and Qwen2.5's proj and down_proj sum
    K's halves from bf16 partials: up to 1.04e-2 apart on an H200, so the bound is transformers'
    own bf16 distance from fp32 (1.5e-2); each side's distance from fp32 is checked above."""
    rng = random.Random(4)
    mismatches = []
    for call in range(1000):
        grids = random_grids(rng, rng.randint(1, 6), max_frames=4, max_side=24)
        pixels = pixels_for(graph_enc, grids, call)
        got, ref = graph_enc.encode(pixels, grids), eager_enc.encode(pixels, grids)
        if got.shape != ref.shape or not torch.isfinite(got).all() or rel_err(got, ref) > 1.5e-2:
            mismatches.append((call, grids, diff_report(got, ref)))
    stats = graph_enc.stats()
    print(f"\n[1000 calls {type(graph_enc.tower).__name__}] mismatches={len(mismatches)} replays="
          f"{sum(b['replays'] for b in stats['buckets'].values())} eager={stats['eager_fallbacks']}")
    assert not mismatches, mismatches[:3]


def test_split_gives_main_and_deepstack_views(graph_enc, family):
    grids = [(1, 8, 8), (2, 4, 6)]
    emb = graph_enc.encode(pixels_for(graph_enc, grids, 7), grids)
    main, deepstack = graph_enc.split(emb)
    parts = len(FAMILIES[family].get("deepstack_visual_indexes", ()))
    assert len(deepstack) == parts and main.shape == (emb.shape[0], FAMILIES[family]["out_hidden_size"])
    assert all(d.data_ptr() >= emb.data_ptr() and d.shape == main.shape for d in deepstack)
