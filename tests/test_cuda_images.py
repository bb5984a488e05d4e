"""The image path on a GPU: uint8 rows normalised on the device and replayed from graphs, the
torch processor against transformers' torchvision processors on the same GPU, and GPU JPEG
decoding against PIL (equal). Run with ``python -m pytest -m cuda -s tests/test_cuda_images.py``
(``-s`` shows the numbers)."""

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from test_images import photo
from helpers import run_eager
from vitgraph import GraphedVisionEncoder
from vitgraph.engine.planner import padded_batch
from vitgraph.images.pipeline import image_rows
from vitgraph.ops.normalize import normalize_rows
from vitgraph.images.preprocess import QWEN2_VL_PROCESSOR, QWEN3_VL_PROCESSOR, preprocess_images, statistics

pytestmark = pytest.mark.cuda

SIZES = [(224, 224), (37, 53), (480, 640), (720, 1280), (1080, 1920), (599, 1023), (1, 150), (900, 1440),
         (2400, 3200)]


@pytest.fixture(scope="module")
def graph_enc():
    return GraphedVisionEncoder.from_config("tiny", device="cuda", dtype=torch.bfloat16, mode="graph",
                                            budgets=[256, 1024, 4096], max_items=8, progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalize_kernel_gives_the_bits_of_torch_ops(dtype):
    rows = torch.randint(0, 256, (1537, 1536), dtype=torch.uint8, device="cuda")
    shift, scale = statistics(QWEN3_VL_PROCESSOR, "cuda")
    assert torch.equal(normalize_rows(rows, shift, scale, dtype, kernel=True),
                       normalize_rows(rows, shift, scale, dtype, kernel=False))


def test_uint8_rows_replay_as_float_rows_normalised_on_the_host(graph_enc):
    """uint8 rows in graph mode: bitwise the embeddings of the same rows normalised on the host
    (fp32, then cast to bf16 by the copy into the graph's buffer), in every bucket hit."""
    images = [photo(h, w, i) for i, (h, w) in enumerate([(224, 224), (300, 500), (60, 90), (448, 448)])]
    for chunk in ([images[0]], images[:3], images):
        rows, grid = preprocess_images(chunk, normalize=False)
        floats = preprocess_images(chunk)[0]
        got = graph_enc.encode(rows, grid)
        assert torch.equal(got, graph_enc.encode(floats, grid))
        assert torch.equal(got, graph_enc.encode(rows.cuda(), grid))  # rows already on the device
    stats = graph_enc.stats()
    assert sum(b["replays"] for b in stats["buckets"].values()) >= 6, stats["buckets"]


def test_graph_replay_equals_eager_for_images(graph_enc):
    eager = GraphedVisionEncoder(graph_enc.tower, device="cuda", dtype=torch.bfloat16, mode="eager")
    images = [photo(200, 300, 1), photo(100, 100, 2)]
    rows, grid = graph_enc.image_rows(images)
    assert rows.is_cuda and rows.dtype == torch.uint8  # the device path is the default on CUDA
    # eager on the graph's padded buffers is what the replay holds: the bank's own check
    bank = graph_enc.bank
    plan = graph_enc.plan(grid)
    assert all(step.bucket is not None for step in plan.steps)
    for step in plan.steps:
        bank.load(step.bucket, graph_enc.device_rows(rows[step.token_offset:step.token_offset + step.tokens]),
                  bank.stage(padded_batch(bank.model, step.bucket, step.grids)))
        want = run_eager(bank, step.bucket).clone()
        got = bank.replay(step.bucket)
        assert torch.equal(got[:step.tokens // 4], want[:step.tokens // 4])
    exact, padded = eager.encode(rows, grid).float(), graph_enc.encode(rows, grid).float()
    assert ((exact - padded).norm() / exact.norm()).item() < 2e-2  # bf16: padded and exact layouts round apart


def _hf_processor(proc):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torchvision")
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as cls

    if proc.patch_size == 16:  # Qwen3-VL's checkpoints name Qwen2-VL's class; newer transformers may have its own
        try:
            from transformers.models.qwen3_vl.image_processing_qwen3_vl import Qwen3VLImageProcessor as cls
        except ImportError:
            pass
    return cls(size={"shortest_edge": proc.min_pixels, "longest_edge": proc.max_pixels}, patch_size=proc.patch_size,
               temporal_patch_size=proc.temporal_patch_size, merge_size=proc.merge_size,
               image_mean=list(proc.image_mean), image_std=list(proc.image_std)), transformers


def _has_cap(cls) -> bool:
    """Whether transformers' video processor class can cap each frame's pixels."""
    return "cap_pixels_per_frame" in getattr(getattr(cls, "valid_kwargs", None), "__annotations__", {})


def _assert_clips_match(hf, image, video, clips, label: str, **call) -> None:
    """Each ``(frames, (h, w))`` clip through transformers' video processor ``hf`` and through
    vitgraph's device path: grids identical, rows equal to 1e-5 after normalisation."""
    for frames, (h, w) in clips:
        clip = np.stack([photo(h, w, i) for i in range(frames)])
        ref = hf(videos=[clip], do_sample_frames=False, device="cuda", return_tensors="pt", **call)
        rows, grid = image_rows(videos=[list(clip)], processor=image, video_processor=video,
                                device=torch.device("cuda"), preprocess="device")
        assert torch.equal(grid, ref["video_grid_thw"].long().cpu()), (grid, ref["video_grid_thw"])
        ours = normalize_rows(rows, *statistics(video, "cuda"), torch.float32)
        diff = (ours - ref["pixel_values_videos"].to("cuda", torch.float32)).abs().max().item()
        print(f"\n{label}, {frames} frames of {h}x{w}: grid {grid.tolist()}, max |diff| {diff:.3e}")
        assert diff <= 1e-5


def test_qwen3_vl_clips_match_transformers_video_processor_on_the_gpu():
    """Qwen3-VL's video processor sizes a clip by its pixels over all frames: a clip past the
    limit is shrunk frame by frame as transformers' torchvision video processor shrinks it; rows
    equal to 1e-5 after normalisation, grids identical."""
    from dataclasses import replace

    pytest.importorskip("torchvision")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from vitgraph.models import QWEN3_VL_VIDEO_PROCESSOR

    video = replace(QWEN3_VL_VIDEO_PROCESSOR, max_pixels=2_000_000)
    hf = Qwen3VLVideoProcessor(size={"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels},
                               patch_size=16, temporal_patch_size=2, merge_size=2,
                               image_mean=list(video.image_mean), image_std=list(video.image_std))
    # Newer transformers can cap each frame's pixels too (off by default, a warning when unset).
    cap = {"cap_pixels_per_frame": False} if _has_cap(Qwen3VLVideoProcessor) else {}
    _assert_clips_match(hf, QWEN3_VL_PROCESSOR, video, ((8, (720, 1280)), (5, (360, 640)), (2, (32, 40))),
                        "uncapped", **cap)  # shrunk, kept, grown


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_capped_clips_match_transformers_video_processors_on_the_gpu(kind):
    """cap_pixels_per_frame with a small max_video_tokens: each clip's frames shrunk as
    transformers' own video processor (Qwen2-VL's per frame, Qwen3-VL's per clip) shrinks them;
    grids identical, rows equal to 1e-5. Skips where transformers has no such cap."""
    import importlib
    from dataclasses import replace

    pytest.importorskip("torchvision")
    from vitgraph.models import QWEN3_VL_VIDEO_PROCESSOR

    name = "Qwen2VLVideoProcessor" if kind == "qwen2_vl" else "Qwen3VLVideoProcessor"
    cls = getattr(importlib.import_module(f"transformers.models.{kind}.video_processing_{kind}"), name)
    if not _has_cap(cls):
        pytest.skip(f"this transformers' {name} has no cap_pixels_per_frame")
    image = QWEN2_VL_PROCESSOR if kind == "qwen2_vl" else QWEN3_VL_PROCESSOR
    base = image if kind == "qwen2_vl" else QWEN3_VL_VIDEO_PROCESSOR
    video = replace(base, min_pixels=4096, max_pixels=8_000_000, cap_pixels_per_frame=True, max_video_tokens=300)
    hf = cls(size={"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels}, patch_size=video.patch_size,
             temporal_patch_size=2, merge_size=2, image_mean=list(video.image_mean), image_std=list(video.image_std),
             cap_pixels_per_frame=True, max_video_tokens=video.max_video_tokens)
    # capped (8 and 3 frames: an odd count padded after sizing), at the cap, under it
    _assert_clips_match(hf, image, video, ((8, (720, 1280)), (3, (720, 1280)), (4, (480, 640)), (2, (64, 80))),
                        f"{name}, capped")


@pytest.mark.parametrize("proc", [QWEN2_VL_PROCESSOR, QWEN3_VL_PROCESSOR], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("content", ["photo", "noise"])
def test_device_processor_matches_transformers_torchvision_on_the_gpu(proc, content):
    """The oracle: transformers' torchvision processor run on the same GPU; rows equal to 1e-5
    after normalisation, grids identical."""
    hf, _ = _hf_processor(proc)
    images = [photo(h, w, i) if content == "photo" else
              np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8) for i, (h, w) in enumerate(SIZES)]
    ref = hf(images=[Image.fromarray(a) for a in images], device="cuda", return_tensors="pt")
    rows, grid = image_rows(images, processor=proc, device=torch.device("cuda"), preprocess="device")
    ours = normalize_rows(rows, *statistics(proc, "cuda"), torch.float32)
    assert torch.equal(grid, ref["image_grid_thw"].long().cpu())
    diff = (ours - ref["pixel_values"].to("cuda", torch.float32)).abs()
    print(f"\n{content} {proc.patch_size}-px patches: max |diff| {diff.max().item():.3e}, "
          f"values differing {(diff > 0).float().mean().item():.2e}")
    assert diff.max().item() <= 1e-5


GPU_JPEGS = [({}, "baseline"), ({"progressive": True}, "progressive"), ({"restart_marker_blocks": 2}, "restarts"),
             ({"quality": 50}, "q50"), ({}, "extended")]


def test_gpu_jpeg_decode_equals_pil():
    """nvJPEG's planes, upsampled and converted as libjpeg-turbo does, against PIL's pixels: equal,
    for 4:4:4, 4:2:2, 4:2:0 and greyscale, baseline, progressive and with restart markers, at odd
    and even sizes (4:2:2's filter has no CPU oracle: this is its test). Where nvJPEG refuses a
    file the host decodes it (None): counted, printed, and exactly the progressive ones and the grey
    ones declared 2x2, which nvJPEG decodes otherwise than libjpeg."""
    from test_jpeg_color import extended_sequential, jpeg
    from vitgraph.images.decode import decode_jpeg_on, gpu_jpeg_decoder

    if gpu_jpeg_decoder() is None:
        pytest.skip("no libnvjpeg loads here")
    report, host_only = [], []
    sizes, modes = 7, 5
    for i, (h, w) in enumerate([(480, 640), (720, 1280), (1080, 1920), (37, 53), (2, 2), (5, 3), (17, 40)]):
        for subsampling, mode in ((0, "RGB"), (1, "RGB"), (2, "RGB"), (0, "L"), (2, "L")):
            for save, kind in GPU_JPEGS:
                blob = jpeg(h, w, seed=i, subsampling=subsampling, mode=mode, **save)
                if kind == "extended":  # SOF1, the other sequential Huffman frame (tables 2 and 3)
                    blob = extended_sequential(blob)
                gpu = decode_jpeg_on(blob, "img", torch.device("cuda"))
                label = (h, w, (f"L {subsampling}" if mode == "L" else ("4:4:4", "4:2:2", "4:2:0")[subsampling]), kind)
                if gpu is None:
                    host_only.append(label)
                    continue
                host = torch.from_numpy(np.asarray(Image.open(io.BytesIO(blob)).convert("RGB")))
                levels = (gpu.permute(1, 2, 0).cpu().int() - host.int()).abs()
                report.append((*label, levels.max().item(), (levels > 0).sum().item()))
    for orientation in range(2, 9):  # EXIF turns: applied on the GPU, as ImageOps.exif_transpose
        image = Image.open(io.BytesIO(jpeg(37, 53, seed=orientation)))
        exif = image.getexif()
        exif[0x0112] = orientation
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", exif=exif, quality=90)
        blob = buffer.getvalue()
        gpu = decode_jpeg_on(blob, "img", torch.device("cuda"))
        host = torch.from_numpy(np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(blob))).convert("RGB")))
        levels = (gpu.permute(1, 2, 0).cpu().int() - host.int()).abs() if gpu is not None else None
        report.append((37, 53, "4:2:0", f"exif {orientation}", levels.max().item() if levels is not None else -1, 0))
    print(f"\n{len(report)} JPEGs decoded on the GPU, {len(host_only)} left to the host: {host_only}")
    apart = [r for r in report if r[-2] > 0]
    print("apart from PIL:", apart or "none")
    # the host's: progressive (nvJPEG's are up to 3 levels off) and grey declared 2x2 (garbled)
    assert not apart and all(r[-2] == 0 for r in report)
    assert host_only == [label for label in host_only if label[3] == "progressive" or label[2] == "L 2"]
    host_per_size = (modes - 1) * 1 + len(GPU_JPEGS)  # the progressive of each other mode; every grey 2x2
    assert len(host_only) == sizes * host_per_size
    assert len(report) == sizes * (modes * len(GPU_JPEGS) - host_per_size) + 7  # and the EXIF turns


def test_encode_images_with_gpu_decode(graph_enc, monkeypatch):
    from vitgraph.images.decode import gpu_jpeg_decoder

    if gpu_jpeg_decoder() is None:
        pytest.skip("no libnvjpeg loads here")
    blobs = []
    for i in range(3):  # JPEGs the GPU decodes as PIL does: the embeddings are equal
        buf = io.BytesIO()
        Image.fromarray(photo(300 + 50 * i, 400, i)).save(buf, "JPEG", quality=92, subsampling=0)
        blobs.append(buf.getvalue())
    chroma = io.BytesIO()  # 4:2:0: libjpeg-turbo's chroma filter, on the GPU
    Image.fromarray(photo(320, 400, 7)).save(chroma, "JPEG", quality=92, subsampling=2)
    png = io.BytesIO()
    Image.fromarray(photo(120, 120, 9)).save(png, "PNG")
    progressive = io.BytesIO()
    Image.fromarray(photo(200, 260, 5)).save(progressive, "JPEG", quality=92, progressive=True)
    blobs += [chroma.getvalue(), png.getvalue(), progressive.getvalue()]  # the PNG and the progressive: host
    from vitgraph.images import decode

    assert [decode.decode_jpeg_on(b, "b", torch.device("cuda")) is not None for b in blobs] == [True] * 4 + [False] * 2
    host = graph_enc.encode_images(blobs, decode="host")
    nvjpeg, decoded = decode.gpu_jpeg_decoder(), []
    planes = nvjpeg.planes
    monkeypatch.setattr(nvjpeg, "planes", lambda *a: decoded.append(planes(*a)) or decoded[-1])
    for given in ({"decode": "gpu"}, {}):  # the default, "auto", is "gpu" here
        gpu = graph_enc.encode_images(blobs, **given)
        assert [h.shape for h in host] == [g.shape for g in gpu]
        for i in range(6):
            assert torch.equal(host[i], gpu[i]), (given, i)
        assert len(decoded) == 4 and all(p is not None for p in decoded), given  # the four JPEGs, by nvJPEG
        decoded.clear()
    graph_enc.encode_images(blobs, preprocess="pil")
    assert not decoded  # the host preprocessing decodes on the host


def test_corrupt_jpegs_through_the_gpu_decode_are_refused_or_decoded_and_leave_it_usable(graph_enc):
    """Bytes flipped in the entropy-coded data (headers and EOI intact, so the gate lets nvJPEG see
    them), markers dropped in: each is decoded to the right shape or left to the host (None),
    never a crash; encode_images returns embeddings or a ValueError naming the item, and a good
    JPEG encodes as before after them all. How many GPU decodes differ from PIL's lenient decode
    of the same corrupt bytes is printed (libjpeg conceals errors its own way)."""
    from test_jpeg_color import jpeg
    from vitgraph.images.decode import decode_jpeg_on, gpu_jpeg_decoder

    if gpu_jpeg_decoder() is None:
        pytest.skip("no libnvjpeg loads here")
    good = jpeg(120, 160, seed=1, quality=90)
    want = graph_enc.encode_images([good])[0]
    rng = np.random.default_rng(0)
    decoded = host = apart = refused = 0
    for i in range(240):
        blob = bytearray(jpeg(120, 160, seed=i % 8, subsampling=(0, 1, 2)[i % 3], quality=90))
        start = blob.rindex(b"\xff\xda") + 12  # into the scan's data
        for at in rng.integers(start, len(blob) - 2, size=int(rng.integers(1, 6))):
            blob[at] = int(rng.integers(0, 256))
        if i % 4 == 0:  # a marker in the middle of the data: RST, EOI or SOI
            at = int(rng.integers(start, len(blob) - 2))
            blob[at:at + 2] = (b"\xff\xd3", b"\xff\xd9", b"\xff\xd8")[i % 3]
        blob = bytes(blob)
        got = decode_jpeg_on(blob, "img", torch.device("cuda"))
        if got is None:
            host += 1
        else:
            decoded += 1
            assert got.dtype == torch.uint8 and tuple(got.shape) == (3, 120, 160)
            try:
                pil = np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))
                apart += int(not np.array_equal(got.permute(1, 2, 0).cpu().numpy(), pil))
            except OSError:
                apart += 1
        try:
            out = graph_enc.encode_images([good, blob])
            assert len(out) == 2 and torch.equal(out[0], want)
        except ValueError as err:
            assert "images[1]" in str(err)
            refused += 1
    print(f"\ncorrupt JPEGs: {decoded} decoded on the GPU ({apart} apart from PIL's), {host} left to the host, "
          f"{refused} refused by encode_images")
    assert torch.equal(graph_enc.encode_images([good])[0], want)
