"""Items stay isolated: a NaN or an inf in one item of a step leaves every other item's output
bitwise as it is when that item is finite, in every family, every attention backend and every
layout: the padded layout the graphs use (eager on the CPU; eager and replayed on CUDA)."""

import pytest
import torch
from helpers import TINY_FAMILIES, pixels_for

from vitgraph import GraphedVisionEncoder
from vitgraph.models import family_for
from vitgraph.ops.attention import BACKENDS, available_backends
from vitgraph.ops.gemm import quack_available

# helpers.TINY_FAMILIES' CPU-size towers: Qwen2.5 with windows of 4 x 4 patches between
# full-attention blocks, Qwen3 with a deepstack merger, Qwen3.5 with none.
FAMILIES = [name for name, tiny in TINY_FAMILIES.items() if tiny.cpu is not None]
GRIDS = [(1, 8, 8), (2, 4, 6), (1, 2, 2), (1, 6, 4)]  # item 1 is a two-frame video
POISONS = [float("nan"), float("inf"), float("-inf")]
PADDING = 40  # rows past the items, as a bucket has
CPU_BACKENDS = [b for b in BACKENDS if b in available_backends("cpu")]


def encoder(family: str, attention: str, device: str = "cpu", dtype=torch.float32, **options):
    tiny = TINY_FAMILIES[family]
    config = family_for(tiny.model_type).config.from_dict({"model_type": tiny.model_type, "vision_config": tiny.cpu})
    return GraphedVisionEncoder.from_config(config, device=device, dtype=dtype, attention=attention,
                                            progress=False, **options)


def item_rows(grids, unit=1):
    """Each item's ``(start, stop)`` rows, in pixel rows / ``unit``."""
    spans, start = [], 0
    for t, h, w in grids:
        spans.append((start // unit, (start + t * h * w) // unit))
        start += t * h * w
    return spans


def poisoned(pixels, grids, item, value, seed=0):
    """``pixels`` with ``value`` in a few places of ``item``'s rows (a copy)."""
    start, stop = item_rows(grids)[item]
    out = pixels.clone()
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(start, stop, (3,), generator=g)
    cols = torch.randint(0, pixels.shape[1], (3,), generator=g)
    out[rows, cols] = value
    return out


def padded_forward(tower, pixels, grids):
    """The tower's forward on the padded layout a bucket gives (spare rows, frame slots and a
    loose ``max_seqlen``), NaN in the padding rows; the rows of the items."""
    real = pixels.shape[0]
    pad = torch.full((PADDING, pixels.shape[1]), float("nan"), device=pixels.device, dtype=pixels.dtype)
    batch = tower.build_batch(grids, num_tokens=real + PADDING, num_segments=len(grids) + 3,
                              max_seqlen=real + PADDING)
    with torch.no_grad():
        return tower(torch.cat([pixels, pad]), batch.to(pixels.device))[:real // tower.merge_unit]


def assert_isolated(run, enc, pixels, grids, label):
    """For each item and poison: every other item's output is bitwise the clean one's, and the
    poisoned item's is not finite."""
    clean = run(pixels)
    spans = item_rows(grids, enc.tower.merge_unit)
    assert torch.isfinite(clean).all(), label
    for item in range(len(grids)):
        for value in POISONS:
            got = run(poisoned(pixels, grids, item, value))
            for other, (start, stop) in enumerate(spans):
                if other == item:
                    assert not torch.isfinite(got[start:stop]).all(), f"{label}: item {item} {value} came out finite"
                else:
                    assert torch.equal(got[start:stop], clean[start:stop]), (
                        f"{label}: {value} in item {item} changed item {other}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_non_finite_item_leaves_the_others_bitwise_unchanged_on_the_cpu(family, backend):
    enc = encoder(family, backend)
    pixels = pixels_for(enc, GRIDS, 7, "cpu")
    assert_isolated(lambda p: padded_forward(enc.tower, p, GRIDS), enc, pixels, GRIDS, f"{family}/{backend} padded")
    # The exact layout, one segment after another, and through the encoder's own call.
    assert_isolated(lambda p: enc.encode(p, GRIDS), enc, pixels, GRIDS, f"{family}/{backend} encode")


def test_the_masked_product_keeps_segments_apart():
    """attend's dense masked product on its own: a non-finite q, k or v in one segment leaves the
    other segments' rows bitwise unchanged and marks its own segment's rows NaN."""
    from vitgraph.ops.attention import attend

    class Batch:  # three segments and two padding rows
        cu_seqlens = torch.tensor([0, 5, 9, 16, 16], dtype=torch.int32)
        segment_ids = torch.tensor([0] * 5 + [1] * 4 + [2] * 7 + [-1] * 2, dtype=torch.int32)
        max_seqlen, segment_lengths, padded, dense = 18, None, True, False

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(18, 2, 8, generator=g) for _ in range(3))
    clean = attend("sdpa", q, k, v, Batch())
    for which in range(3):
        for value in POISONS:
            qkv = [q.clone(), k.clone(), v.clone()]
            qkv[which][6, 1, 3] = value  # segment 1
            got = attend("sdpa", *qkv, Batch())
            assert torch.equal(got[:5], clean[:5]) and torch.equal(got[9:16], clean[9:16]), (which, value)
            assert got[5:9].isnan().all(), (which, value)


_CUDA_HERE = available_backends("cuda") if torch.cuda.is_available() else ()
# Every backend, each skipped with a reason where this machine's GPU lacks it.
CUDA_BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(b not in _CUDA_HERE,
                                                          reason=f"needs the {b} attention backend on a CUDA GPU"))
                 for b in BACKENDS]


# quack's GEMMs at every row count: qkv's rotary epilogue (it zeroes v's non-finite values itself).
QUACK_EVERYWHERE = {"gemm.fc1_min_rows": 0, "gemm.qkv_min_rows": 0, "gemm.rope_min_rows": 0}


@pytest.mark.cuda
@pytest.mark.parametrize("fuse", [True, False, "quack"])
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_non_finite_item_leaves_the_others_bitwise_unchanged_on_cuda(family, backend, fuse):
    """Every backend, in bf16, fused and reference forward (and the fused one with quack's GEMM
    epilogues at every size): the padded layout eager (packed and, for one item alone, a one-slot
    layout), then replayed from graphs (dense and packed buckets, the cudnn backend's ragged
    attention and the dense variants)."""
    tuning = {"buckets.dense_max_tokens": 1024, "routing.faster_buckets": False}
    if fuse == "quack":
        if not quack_available("cuda"):
            pytest.skip("quack's GEMMs: the fused forward on a Hopper GPU with quack-kernels")
        fuse, tuning = True, {**tuning, **QUACK_EVERYWHERE}
    kwargs = dict(budgets=[64, 256, 1024], max_items=8, tuning=tuning)
    enc = encoder(family, backend, "cuda", torch.bfloat16, mode="graph", fuse=fuse, **kwargs)
    if tuning.get("gemm.rope_min_rows") == 0:
        assert enc.tuning.gemm.backend == "quack"
    pixels = pixels_for(enc, GRIDS, 7, "cuda", torch.bfloat16)
    label = f"{family}/{backend}/fuse={fuse}/gemm={enc.tuning.gemm.backend}"
    assert_isolated(lambda p: padded_forward(enc.tower, p, GRIDS), enc, pixels, GRIDS, f"{label} padded")
    assert_isolated(lambda p: enc.encode(p, GRIDS).clone(), enc, pixels, GRIDS, f"{label} graph")
    one = GRIDS[:1] + GRIDS[2:3]  # small items alone in a step: dense buckets where there are
    assert_isolated(lambda p: enc.encode(p, one).clone(), enc, pixels[:sum(t * h * w for t, h, w in one)], one,
                    f"{label} graph, small")
