"""``check_finite=True`` (``encode``, ``submit``): float rows holding NaN or inf are refused with a
ValueError naming the items; the default encodes them (their own items come back non-finite);
the encoder stays usable. The GPU test also prints the check's cost (``-s``)."""

import time

import pytest
import torch

from vitgraph import GraphedVisionEncoder

GRIDS = [(1, 4, 4), (1, 2, 6), (2, 4, 2)]  # 16, 12 and 16 rows


def rows(enc, seed=0, device="cpu"):
    tokens = sum(t * h * w for t, h, w in GRIDS)
    return torch.randn(tokens, enc.tower.input_width, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.fixture(scope="module")
def enc():
    encoder = GraphedVisionEncoder.from_config("tiny", device="cpu")
    yield encoder
    encoder.close()


def test_the_default_encodes_non_finite_rows_in_their_own_item_only(enc):
    pixels = rows(enc)
    pixels[20, 3] = float("nan")  # item 1 (rows 16:28)
    per_item = enc.per_item(enc.encode(pixels, GRIDS), GRIDS)
    assert [bool(torch.isfinite(p).all()) for p in per_item] == [True, False, True]


@pytest.mark.parametrize("bad, named", [({20: float("nan")}, "item(s) 1 (grid_thw[1] = (1, 2, 6))"),
                                        ({0: float("inf"), 43: -float("inf")},
                                         "item(s) 0 (grid_thw[0] = (1, 4, 4)), 2 (grid_thw[2] = (2, 4, 2))")])
def test_check_finite_refuses_the_call_naming_the_items(enc, bad, named):
    good = rows(enc)
    expected = enc.encode(good, GRIDS)
    pixels = good.clone()
    for row, value in bad.items():
        pixels[row, 7] = value
    with pytest.raises(ValueError, match="check_finite=True refuses") as err:
        enc.encode(pixels, GRIDS, check_finite=True)
    assert named in str(err.value)
    with pytest.raises(ValueError, match="check_finite=True refuses") as err:
        enc.submit(pixels, GRIDS, check_finite=True).result(timeout=60)
    assert named in str(err.value)
    # the encoder is usable, and a finite call's answer is unchanged by the check
    assert torch.equal(enc.encode(good, GRIDS, check_finite=True), expected)
    assert torch.equal(enc.submit(good, GRIDS, check_finite=True).result(timeout=60), expected)


def test_check_finite_passes_uint8_rows_and_empty_calls_and_takes_only_a_bool(enc):
    uint8 = torch.randint(0, 256, (sum(t * h * w for t, h, w in GRIDS), enc.tower.input_width), dtype=torch.uint8)
    assert torch.equal(enc.encode(uint8, GRIDS, check_finite=True), enc.encode(uint8, GRIDS))
    assert enc.encode(torch.empty(0, enc.tower.input_width), [], check_finite=True).shape[0] == 0
    for value in ("yes", 1, None):
        with pytest.raises(TypeError, match="check_finite must be a bool"):
            enc.encode(rows(enc), GRIDS, check_finite=value)
        with pytest.raises(TypeError, match="check_finite must be a bool"):
            enc.submit(rows(enc), GRIDS, check_finite=value).result(timeout=60)


@pytest.mark.cuda
def test_check_finite_on_the_gpu_names_the_item_and_reports_its_cost():
    """Rows on the device, a 2B tower: refused by item; the check's cost (median of 20 calls
    with and without it, synchronised) is printed, not asserted."""
    enc = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda")
    grids = [(1, 32, 32)] * 8  # 8192 rows
    pixels = torch.randn(8192, enc.tower.input_width, device="cuda", dtype=enc.dtype)
    bad = pixels.clone()
    bad[5 * 1024 + 3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"item\(s\) 5 \(grid_thw\[5\]"):
        enc.encode(bad, grids, check_finite=True)
    assert torch.equal(enc.encode(pixels, grids, check_finite=True), enc.encode(pixels, grids))

    def median_ms(check: bool) -> float:
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            start = time.perf_counter()
            enc.encode(pixels, grids, check_finite=check)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[10]

    median_ms(True)
    off, on = median_ms(False), median_ms(True)
    print(f"\ncheck_finite on 8192 bf16 rows (2B tower, {torch.cuda.get_device_name()}): "
          f"{off:.3f} ms off, {on:.3f} ms on, +{on - off:.3f} ms")
    enc.close()
