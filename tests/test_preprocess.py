"""Preprocessing parity with transformers' Qwen2VLImageProcessorPil, and the video path."""

import random

import numpy as np
import pytest
import torch
from PIL import Image

from vitgraph.preprocess import preprocess_images, preprocess_video, smart_resize


@pytest.fixture(scope="module")
def hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil


def _image(h, w, seed):
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


SIZES = [(224, 224), (448, 448), (37, 53), (28, 28), (10, 10), (1, 150), (120, 3), (599, 1023),
         (1080, 1920), (300, 59999 // 300), (2, 390)]


@pytest.mark.parametrize("min_pixels, max_pixels", [(3136, 1003520), (3136, 12845056), (3136, 200704)])
def test_matches_transformers_pil_processor(hf_processor, min_pixels, max_pixels):
    rng = random.Random(min_pixels + max_pixels)
    sizes = SIZES + [(rng.randint(8, 1500), rng.randint(8, 1500)) for _ in range(12)]
    images = [_image(h, w, i) for i, (h, w) in enumerate(sizes)]
    proc = hf_processor(min_pixels=min_pixels, max_pixels=max_pixels)
    ref = proc(images=[Image.fromarray(a) for a in images], return_tensors="pt")
    pixels, grid = preprocess_images(images, min_pixels=min_pixels, max_pixels=max_pixels)
    assert torch.equal(grid, ref["image_grid_thw"].long())
    diff = (pixels - ref["pixel_values"].float()).abs().max().item()
    assert diff <= 1e-5, f"max abs diff {diff:.3e}"


def test_input_kinds_agree():
    arr = _image(60, 90, 0)
    a = preprocess_images([arr])
    b = preprocess_images([Image.fromarray(arr)])
    c = preprocess_images([torch.from_numpy(arr).permute(2, 0, 1)])
    assert all(torch.equal(a[0], x[0]) and torch.equal(a[1], x[1]) for x in (b, c))
    rgba = Image.fromarray(arr).convert("RGBA")
    assert torch.equal(preprocess_images([rgba])[0], a[0])


def test_smart_resize_rules():
    assert smart_resize(224, 224) == (224, 224)
    assert smart_resize(10, 10) == (56, 56)  # scaled up to min_pixels
    h, w = smart_resize(4000, 6000, max_pixels=1003520)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 1003520
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201)
    with pytest.raises(ValueError, match="empty"):
        smart_resize(0, 10)


@pytest.mark.parametrize("bad, error, words", [
    (np.zeros((0, 10, 3), np.uint8), ValueError, "empty"),
    (np.zeros((10, 10, 4), np.uint8), ValueError, "HxWx3"),
    (np.zeros((10, 10, 3), np.float32), TypeError, "uint8"),
    (torch.zeros(4, 10, 10, dtype=torch.uint8), ValueError, "3xHxW"),
    (np.zeros((1, 300, 3), np.uint8), ValueError, "aspect ratio"),
    ("no-such-cat.png", ValueError, "no such file"),
    (3.5, TypeError, "PIL image"),
])
def test_bad_images(bad, error, words):
    with pytest.raises(error, match=words):
        preprocess_images([bad])


def test_empty_list():
    pixels, grid = preprocess_images([])
    assert pixels.shape == (0, 1176) and grid.shape == (0, 3)


def test_video_two_equal_frames_is_an_image():
    frame = _image(100, 140, 3)
    v_pixels, v_grid = preprocess_video([frame, frame])
    i_pixels, i_grid = preprocess_images([frame])
    assert torch.equal(v_grid, i_grid) and torch.equal(v_pixels, i_pixels)


def test_video_pairs_frames_and_pads_odd_counts():
    frames = [_image(56, 84, s) for s in range(3)]
    pixels, grid = preprocess_video(frames)
    assert grid.tolist() == [[2, 4, 6]] and pixels.shape == (2 * 24, 1176)
    # The second temporal patch is (frame 2, frame 2 repeated): both halves of each row are equal.
    second = pixels[24:].view(24, 3, 2, 196)
    assert torch.equal(second[:, :, 0], second[:, :, 1])
    # The first pairs frames 0 and 1: its halves are each frame's own image rows.
    first = pixels[:24].view(24, 3, 2, 196)
    img0 = preprocess_images([frames[0]])[0].view(24, 3, 2, 196)[:, :, 0]
    img1 = preprocess_images([frames[1]])[0].view(24, 3, 2, 196)[:, :, 0]
    assert torch.equal(first[:, :, 0], img0) and torch.equal(first[:, :, 1], img1)
    with pytest.raises(ValueError, match="same size"):
        preprocess_video([_image(56, 84, 0), _image(56, 56, 1)])
    with pytest.raises(ValueError, match="at least one frame"):
        preprocess_video([])


def test_qwen3_vl_processor_matches_transformers(hf_processor):
    """Qwen3-VL's processor (patch 16: sides of multiples of 32, mean and std 0.5) is
    transformers' Qwen2-VL processor with those settings; so is vitgraph's."""
    from vitgraph.preprocess import QWEN3_VL_PROCESSOR as q3

    rng = random.Random(3)
    sizes = SIZES + [(rng.randint(8, 1500), rng.randint(8, 1500)) for _ in range(8)]
    images = [_image(h, w, i) for i, (h, w) in enumerate(sizes)]
    proc = hf_processor(min_pixels=q3.min_pixels, max_pixels=q3.max_pixels, patch_size=16, merge_size=2,
                        temporal_patch_size=2, image_mean=list(q3.image_mean), image_std=list(q3.image_std))
    ref = proc(images=[Image.fromarray(a) for a in images], return_tensors="pt")
    pixels, grid = preprocess_images(images, processor=q3)
    assert pixels.shape[1] == 1536 and torch.equal(grid, ref["image_grid_thw"].long())
    assert (grid[:, 1:] % 2 == 0).all()
    diff = (pixels - ref["pixel_values"].float()).abs().max().item()
    assert diff <= 1e-5, f"max abs diff {diff:.3e}"


def test_qwen3_vl_video_pairs_frames_into_16_pixel_patches():
    from vitgraph.preprocess import QWEN3_VL_PROCESSOR as q3

    frames = [_image(64, 96, i) for i in range(3)]
    pixels, grid = preprocess_video(frames, processor=q3, min_pixels=32 * 32)  # no upscaling: 64 x 96 stays
    assert grid.tolist() == [[2, 4, 6]] and pixels.shape == (2 * 4 * 6, 1536)
