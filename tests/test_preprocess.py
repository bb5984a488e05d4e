"""Preprocessing parity with transformers' Qwen2VLImageProcessorPil, and the video path."""

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from vitgraph.images.preprocess import preprocess_images, preprocess_video, smart_resize


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


def _transparent_images():
    """RGBA, LA, a P image with a transparent index, and PNG bytes of the RGBA: alpha from 0 to 255."""
    import io
    rng = np.random.default_rng(7)
    rgba = Image.fromarray(rng.integers(0, 256, size=(70, 90, 4), dtype=np.uint8), "RGBA")
    la = rgba.convert("LA")
    palette = Image.fromarray(rng.integers(0, 8, size=(70, 90), dtype=np.uint8), "P")
    palette.putpalette(list(range(0, 256, 10))[:24])
    palette.info["transparency"] = 3
    png = io.BytesIO()
    rgba.save(png, format="PNG")
    return [rgba, la, palette], png.getvalue()


def test_transparency_composited_onto_white_as_transformers(hf_processor):
    """transformers blends transparent pixels onto white before RGB; dropping alpha would give black."""
    images, png = _transparent_images()
    ref = hf_processor()(images=images, return_tensors="pt")
    pixels, grid = preprocess_images(images)
    assert torch.equal(grid, ref["image_grid_thw"].long())
    assert (pixels - ref["pixel_values"].float()).abs().max().item() <= 1e-5
    from_bytes, _ = preprocess_images([png])
    assert torch.equal(from_bytes, pixels[: len(from_bytes)])


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
    (np.zeros((10, 10, 5), np.uint8), ValueError, "HxWx3"),  # 4 channels: RGBA, taken
    (np.zeros((10, 10, 3), np.float32), TypeError, "uint8"),
    (torch.zeros(2, 10, 10, dtype=torch.uint8), ValueError, "3xHxW"),
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
    from vitgraph.images.preprocess import QWEN3_VL_PROCESSOR as q3

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
    from vitgraph.images.preprocess import QWEN3_VL_PROCESSOR as q3

    frames = [_image(64, 96, i) for i in range(3)]
    pixels, grid = preprocess_video(frames, processor=q3, min_pixels=32 * 32)  # no upscaling: 64 x 96 stays
    assert grid.tolist() == [[2, 4, 6]] and pixels.shape == (2 * 4 * 6, 1536)


def _transformers_qwen3_video_smart_resize():
    """transformers' own Qwen3-VL video ``smart_resize``, read from its module's source: the module
    needs torchvision to import, which CPU machines may lack; the function needs only math."""
    import ast
    import importlib.util
    import math

    spec = importlib.util.find_spec("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    tree = ast.parse(open(spec.origin).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
    namespace = {"math": math}
    exec(compile(ast.Module([node], []), spec.origin, "exec"), namespace)
    return namespace["smart_resize"]


def test_qwen3_vl_clips_are_sized_as_transformers_sizes_them():
    """The clip's pixels (frames x height x width) within the video processor's limits, as
    transformers' Qwen3-VL video processor computes each frame's size."""
    from vitgraph.images.preprocess import clip_smart_resize

    reference = _transformers_qwen3_video_smart_resize()
    rng = np.random.default_rng(0)
    cases = [(16, 1080, 1920, 4096, 25165824), (64, 1080, 1920, 4096, 25165824), (5, 720, 1280, 4096, 2_000_000),
             (2, 20, 900, 4096, 25165824), (3, 40, 60, 200_000, 25165824), (8, 31, 33, 4096, 25165824)]
    cases += [(int(rng.integers(2, 200)), int(rng.integers(32, 3000)), int(rng.integers(32, 3000)),
               int(rng.integers(1, 100_000)), int(rng.integers(100_000, 60_000_000))) for _ in range(300)]
    for frames, h, w, low, high in cases:
        want = reference(frames, h, w, temporal_factor=2, factor=32, min_pixels=low, max_pixels=high)
        assert clip_smart_resize(frames, h, w, 32, 2, low, high) == tuple(want), (frames, h, w, low, high)


@pytest.mark.slow
def test_qwen3_vl_video_processor_bounds_the_whole_clip():
    """A 16-frame 1080p clip under Qwen3-VL's video processor: every frame is shrunk so that the
    clip fits the processor's pixels (per frame it would fit as it is), on both preprocessing paths."""
    from vitgraph.images.pipeline import image_rows
    from vitgraph.models import QWEN3_VL_VIDEO_PROCESSOR as video
    from vitgraph.images.preprocess import QWEN3_VL_PROCESSOR, clip_smart_resize

    frames = [_image(1080, 1920, i) for i in range(16)]
    h, w = clip_smart_resize(16, 1080, 1920, 32, 2, video.min_pixels, video.max_pixels)
    assert h * w < 1080 * 1920 * 0.8  # shrunk: 16 frames of 1080p hold 33M pixels, the limit is 25M
    _, grid = preprocess_video(frames, processor=video, normalize=False)
    assert grid.tolist() == [[8, h // 16, w // 16]]
    for path in ("pil", "device"):
        rows, got = image_rows(videos=[frames], processor=QWEN3_VL_PROCESSOR, video_processor=video, device="cpu",
                               preprocess=path)
        assert got.tolist() == [[8, h // 16, w // 16]] and rows.shape[0] == 8 * (h // 16) * (w // 16), path
    # An image keeps its own per-image sizing; a per-frame processor sizes each frame alone.
    _, image_grid = preprocess_images([frames[0]], processor=QWEN3_VL_PROCESSOR)
    _, per_frame = preprocess_video(frames, processor=replace(video, clip_pixels=False), normalize=False)
    assert per_frame.tolist() == [[8, 1088 // 16, 1920 // 16]] and image_grid.tolist() == [[1, 1088 // 16, 1920 // 16]]


def _transformers_frame_cap(module: str):
    """The ``if cap_pixels_per_frame:`` block of transformers' video processor ``resize`` in
    ``module``, read from its source (the module needs torchvision to import), as a function of
    the clip's frames, its size limits and the processor's token budget -> the max_pixels it sets."""
    import ast
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.find_spec(f"transformers.models.{module}")
    tree = ast.parse(open(spec.origin).read())
    resize = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "resize"]
    blocks = [n for f in resize for n in ast.walk(f) if isinstance(n, ast.If) and isinstance(n.test, ast.Name)
              and n.test.id == "cap_pixels_per_frame"]
    if not blocks:  # transformers means to drop the flag once capping is its default
        pytest.skip(f"this transformers' {module} resizes without a cap_pixels_per_frame block")
    assert len(blocks) == 1, f"{module}: {len(blocks)} cap_pixels_per_frame blocks in resize"
    code = compile(ast.Module(blocks[0].body, []), spec.origin, "exec")

    def cap(frames, low, high, factor, temporal, max_video_tokens):
        namespace = {"max_pixels": high, "size": SimpleNamespace(shortest_edge=low, longest_edge=high),
                     "videos": SimpleNamespace(shape=(1, frames, 3, 64, 64)), "num_frames": frames,
                     "self": SimpleNamespace(max_video_tokens=max_video_tokens), "max_video_tokens": None,
                     "factor": factor, "temporal_factor": temporal}
        exec(code, namespace)
        return namespace["max_pixels"]
    return cap


@pytest.mark.parametrize("module, clip_pixels", [("qwen2_vl.video_processing_qwen2_vl", False),
                                                 ("qwen3_vl.video_processing_qwen3_vl", True)])
def test_cap_pixels_per_frame_caps_as_transformers_video_processors_do(module, clip_pixels):
    from vitgraph.images.preprocess import ProcessorConfig, clip_max_pixels

    reference = _transformers_frame_cap(module)
    rng = np.random.default_rng(1)
    for patch, tokens in [(14, 128000), (16, 768)] + [(int(rng.choice([14, 16])), int(rng.integers(1, 200_000)))
                                                      for _ in range(40)]:
        proc = ProcessorConfig(patch_size=patch, min_pixels=1, max_pixels=1 << 28, clip_pixels=clip_pixels,
                               cap_pixels_per_frame=True, max_video_tokens=tokens)
        for frames, low, high in [(2, 4096, 25165824), (3, 3136, 12845056), (768, 4096, 25165824)] + [
                (int(rng.integers(2, 400)), int(rng.integers(1, 70_000)), int(rng.integers(70_000, 30_000_000)))
                for _ in range(25)]:  # Qwen3-VL's processor refuses clips shorter than its temporal patch
            want = reference(frames, low, high, proc.factor, proc.temporal_patch_size, tokens)
            assert clip_max_pixels(proc, frames, low, high) == want, (frames, low, high, patch, tokens)
            assert clip_max_pixels(replace(proc, cap_pixels_per_frame=False), frames, low, high) == high
        # vitgraph pads a one-frame clip to the temporal patch: capped per frame as the padded clip
        padded = 2 if clip_pixels else 1
        assert clip_max_pixels(proc, 1, 4096, 25165824) == reference(padded, 4096, 25165824, proc.factor, 2, tokens)


@pytest.mark.parametrize("path", ["pil", "device"])
def test_a_capped_video_processor_sizes_every_clip_by_its_frame_count(path):
    """Qwen3-VL's video processor with cap_pixels_per_frame: 8 frames of 1080p (16.6M pixels, in
    the 25M limit as they are) get 768 tokens' worth of pixels each, on both preprocessing paths
    and in preprocess_video; two frames of 640x480 (300 tokens each) stay as they are."""
    from vitgraph.images.pipeline import image_rows
    from vitgraph.models import QWEN3_VL_VIDEO_PROCESSOR
    from vitgraph.images.preprocess import QWEN3_VL_PROCESSOR, clip_max_pixels, clip_smart_resize

    video = replace(QWEN3_VL_VIDEO_PROCESSOR, cap_pixels_per_frame=True)
    frames, short = [_image(1080, 1920, 0)] * 8, [_image(480, 640, 1)] * 2
    high = clip_max_pixels(video, 8, video.min_pixels, video.max_pixels)
    assert high == 768 * 32 * 32 * 8 < video.max_pixels
    h, w = clip_smart_resize(8, 1080, 1920, 32, 2, video.min_pixels, high)
    _, grid = image_rows(videos=[frames, short], processor=QWEN3_VL_PROCESSOR, video_processor=video,
                         device="cpu", preprocess=path)
    assert grid.tolist()[0] == [4, h // 16, w // 16] and (h // 32) * (w // 32) <= 768
    assert grid.tolist()[1] == [1, 480 // 16, 640 // 16]
    assert preprocess_video(frames, processor=video, normalize=False)[1].tolist() == grid.tolist()[:1]


def _class_defaults(module: str, cls: str) -> dict:
    """The class-level settings of a transformers processor class, read from its module's source
    (the video modules need torchvision to import); names resolve in transformers.image_utils."""
    import ast
    import importlib.util

    import transformers.image_utils as image_utils

    spec = importlib.util.find_spec(f"transformers.models.{module}")
    node = next(n for n in ast.parse(open(spec.origin).read()).body if isinstance(n, ast.ClassDef) and n.name == cls)
    values = {}
    for item in node.body:
        if isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
            try:
                values[item.targets[0].id] = eval(compile(ast.Expression(item.value), spec.origin, "eval"),
                                                  vars(image_utils))
            except NameError:  # e.g. the resampling enum: not a field vitgraph holds
                pass
    return values


@pytest.mark.parametrize("module, cls", [("qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
                                         ("qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor"),
                                         ("qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor")])
def test_what_a_processor_file_leaves_out_takes_the_transformers_class_default(module, cls):
    from vitgraph.images.processor_files import IMAGE_CLASS, VIDEO_CLASSES

    ours = VIDEO_CLASSES.get(cls, IMAGE_CLASS)
    want = _class_defaults(module, cls)
    assert (ours.min_pixels, ours.max_pixels) == (want["size"]["shortest_edge"], want["size"]["longest_edge"])
    assert ours.image_mean == pytest.approx(tuple(want["image_mean"]))
    assert ours.image_std == pytest.approx(tuple(want["image_std"]))
    assert ours.max_video_tokens == want.get("max_video_tokens", ours.max_video_tokens)
    assert ours.clip_pixels == (cls == "Qwen3VLVideoProcessor")
