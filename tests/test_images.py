"""The image path: uint8 rows normalised by the encoder, the torch (device) processor, decoding
of bytes and paths, and bad images refused by name."""

import io
import os
import struct
import time
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from vitgraph import GraphedVisionEncoder
from vitgraph.images.pipeline import image_rows
from vitgraph.ops.normalize import normalize_rows
from vitgraph.images.preprocess import QWEN2_VL_PROCESSOR, QWEN3_VL_PROCESSOR, preprocess_images, preprocess_video, statistics

from helpers import diff_report


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """A seeded photo-like image: smooth colour fields plus grain."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(h // 16, 2), max(w // 16, 2), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BILINEAR)).astype(np.int16)
    return np.clip(smooth + rng.integers(-20, 21, (h, w, 3)), 0, 255).astype(np.uint8)


def encoded(array: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **kw)
    return buf.getvalue()


PRESETS = ["tiny", "qwen2.5-vl-3b", "qwen3-vl-2b"]


@pytest.fixture(scope="module")
def encoders():
    from vitgraph.models import PRESETS as ALL
    from dataclasses import replace

    small = {"tiny": ALL["tiny"],
             "qwen2.5-vl-3b": replace(ALL["qwen2.5-vl-3b"], depth=2, hidden_size=64, num_heads=4,
                                      intermediate_size=96, out_hidden_size=32, fullatt_block_indexes=(1,)),
             "qwen3-vl-2b": replace(ALL["qwen3-vl-2b"], depth=2, hidden_size=64, num_heads=4, intermediate_size=96,
                                    out_hidden_size=32, deepstack_visual_indexes=(0,))}
    return {name: GraphedVisionEncoder.from_config(cfg, device="cpu", dtype=torch.float32, seed=1)
            for name, cfg in small.items()}


@pytest.mark.parametrize("preset", PRESETS)
def test_uint8_rows_equal_float_rows_normalised_on_the_host(encoders, preset):
    """For every family, uint8 rows give the embeddings of the same rows normalised on the host (fp32)."""
    enc = encoders[preset]
    images = [photo(90, 120, 0), photo(64, 64, 1), photo(200, 75, 2)]
    rows, grid = preprocess_images(images, processor=enc.processor, normalize=False)
    floats, grid_f = preprocess_images(images, processor=enc.processor)
    assert rows.dtype == torch.uint8 and floats.dtype == torch.float32 and torch.equal(grid, grid_f)
    got, want = enc.encode(rows, grid), enc.encode(floats, grid)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), diff_report(got, want)
    # and the rows themselves: the same normalisation, to the bit
    assert torch.equal(normalize_rows(rows, *statistics(enc.processor), torch.float32), floats)


def test_uint8_rows_in_bf16_within_bf16_distance(encoders):
    enc32 = encoders["tiny"]
    enc16 = GraphedVisionEncoder(enc32.tower, device="cpu", dtype=torch.bfloat16)
    rows, grid = preprocess_images([photo(120, 150, 3)], processor=enc32.processor, normalize=False)
    floats = preprocess_images([photo(120, 150, 3)], processor=enc32.processor)[0]
    got = enc16.encode(rows, grid).float()
    want = enc16.encode(floats.bfloat16(), grid).float()
    ref = GraphedVisionEncoder(enc16.tower.float(), device="cpu", dtype=torch.float32).encode(floats, grid)
    assert torch.equal(got, want)  # normalised in fp32, rounded once: as the host's fp32 rows cast to bf16
    assert (got - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("kernel_dtype", [torch.float32, torch.bfloat16])
def test_normalize_kernel_matches_torch_ops(kernel_dtype):
    """The Triton kernel (Triton's interpreter here) gives the bits of the torch ops."""
    pytest.importorskip("triton")
    rows = torch.randint(0, 256, (37, 1176), dtype=torch.uint8)
    shift, scale = statistics(QWEN2_VL_PROCESSOR)
    want = normalize_rows(rows, shift, scale, kernel_dtype, kernel=False)
    got = normalize_rows(rows, shift, scale, kernel_dtype, kernel=True)
    out = torch.empty(37, 2 * 1176, dtype=kernel_dtype)[:, :1176]  # a strided output
    strided = normalize_rows(rows, shift, scale, kernel_dtype, out=out, kernel=True)
    assert strided.data_ptr() == out.data_ptr() and torch.equal(strided, got)
    transposed = torch.empty(1176, 37, dtype=kernel_dtype).t()  # dense, not contiguous
    assert torch.equal(normalize_rows(rows, shift, scale, kernel_dtype, out=transposed, kernel=True), got)
    if kernel_dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # the interpreter's bf16 casts truncate: one ulp (the CUDA test asks for the bits)
        ulp = want.float().abs() * 2 ** -7
        assert ((got.float() - want.float()).abs() <= ulp).all()


SIZES = [(224, 224), (37, 53), (480, 640), (720, 1280), (599, 1023), (1, 150), (900, 1440), (28, 28)]


@pytest.mark.parametrize("proc", [QWEN2_VL_PROCESSOR, QWEN3_VL_PROCESSOR], ids=["qwen2", "qwen3"])
def test_device_path_on_cpu_within_measured_distance_of_pil(proc):
    """The torch processor run on CPU tensors against the PIL one: identical grids; pixels
    apart by PIL's fixed-point, two-pass bicubic (measured on photo-like images: at most 4
    uint8 levels, 0.2 levels on average)."""
    images = [photo(h, w, i) for i, (h, w) in enumerate(SIZES)]
    pil, grid_pil = image_rows(images, processor=proc, device="cpu", preprocess="pil")
    dev, grid_dev = image_rows(images, processor=proc, device="cpu", preprocess="device")
    assert torch.equal(grid_pil, grid_dev) and pil.dtype == dev.dtype == torch.uint8
    levels = (pil.int() - dev.int()).abs()
    assert levels.max().item() <= 4 and levels.float().mean().item() <= 0.25, \
        f"max {levels.max().item()} levels, mean {levels.float().mean().item():.3f}"
    # Where no resize happens (224 x 224 is already a multiple of 28 and 32... for 28) the two are equal.
    same, grid = image_rows([photo(224, 224, 9)], processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess="device")
    assert torch.equal(same, image_rows([photo(224, 224, 9)], processor=QWEN2_VL_PROCESSOR, device="cpu",
                                        preprocess="pil")[0])


def test_device_path_videos_match_the_pil_layout():
    """A clip: frames paired into temporal patches, an odd count padded with its last frame;
    no resize (sizes already multiples of 28), so both paths agree to the bit."""
    frames = [photo(56, 84, s) for s in range(3)]
    dev, grid = image_rows(videos=[frames], processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess="device")
    pil = preprocess_video(frames, normalize=False)
    assert grid.tolist() == [[2, 4, 6]] and torch.equal(dev, pil[0])


def test_encode_images_takes_bytes_paths_and_arrays(encoders, tmp_path):
    enc = encoders["tiny"]
    arrays = [photo(100, 130, 5), photo(64, 90, 6)]
    path = tmp_path / "a.png"
    path.write_bytes(encoded(arrays[0]))
    jpeg = encoded(arrays[1], "JPEG", quality=95)
    decoded_jpeg = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
    for preprocess in ("pil", "device"):
        from_forms = enc.encode_images([str(path), jpeg, path], preprocess=preprocess)
        from_arrays = enc.encode_images([arrays[0], decoded_jpeg, arrays[0]], preprocess=preprocess)
        assert len(from_forms) == 3
        for got, want in zip(from_forms, from_arrays):
            assert torch.equal(got, want)
        # a clip's frames in mixed forms: bytes, an array, a tensor
        frames = [encoded(arrays[1]), arrays[1], torch.from_numpy(arrays[1]).permute(2, 0, 1)]
        clip = enc.encode_images(videos=[frames], preprocess=preprocess)[0]
        assert torch.equal(clip, enc.encode_images(videos=[[arrays[1]] * 3], preprocess=preprocess)[0])


def test_exif_orientation_is_applied(encoders):
    """Encoded images are turned upright by their EXIF orientation, as transformers' load_image does."""
    enc = encoders["tiny"]
    array = photo(60, 100, 7)
    image = Image.fromarray(array)
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 270 (clockwise 90) to display upright
    buf = io.BytesIO()
    image.save(buf, "PNG", exif=exif)
    upright = np.ascontiguousarray(np.rot90(array, k=-1))
    assert torch.equal(enc.encode_images([buf.getvalue()])[0], enc.encode_images([upright])[0])


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height but holds almost nothing."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("preprocess", ["pil", "device"])
def test_bad_images_are_refused_by_name_and_the_encoder_stays_usable(encoders, tmp_path, preprocess):
    enc = encoders["tiny"]
    good = photo(64, 64, 8)
    want = enc.encode_images([good], preprocess=preprocess)[0]
    (tmp_path / "folder").mkdir()
    cases = [
        (b"\xff\xd8\xff\xe0 this is not a jpeg", ValueError, r"images\[1\]: not a readable image"),
        (encoded(photo(300, 300, 9), "JPEG")[:3000], ValueError, r"images\[1\]: cannot be decoded"),
        (b"", ValueError, r"images\[1\]: is empty"),
        (np.zeros((10, 10, 3), np.float32), TypeError, r"images\[1\] array must be uint8"),
        (torch.zeros(3, 10, 10, dtype=torch.int32), TypeError, r"images\[1\] tensor must be uint8"),
        (str(tmp_path / "missing.png"), ValueError, r"images\[1\]: .*missing.png: no such file"),
        (tmp_path / "folder", ValueError, r"images\[1\]: .*folder: is a directory"),
        (12, TypeError, r"images\[1\] must be a PIL image"),
    ]
    for bad, error, words in cases:
        with pytest.raises(error, match=words):
            enc.encode_images([good, bad], preprocess=preprocess)
    with pytest.raises(ValueError, match="preprocess must be one of"):
        enc.encode_images([good], preprocess="gpu")
    with pytest.raises(ValueError, match="decode='gpu' needs"):
        enc.encode_images([good], preprocess=preprocess, decode="gpu")
    assert torch.equal(enc.encode_images([good], preprocess=preprocess)[0], want)


def test_decode_auto_decodes_on_the_host_off_cuda(encoders, monkeypatch):
    """The default, decode="auto", tries nvJPEG only with the device preprocessing on CUDA: on the
    CPU the JPEG is PIL's, as decode="host" gives, and the GPU decoder is never asked."""
    from vitgraph.images import decode

    enc, jpeg = encoders["tiny"], encoded(photo(64, 64, 3), "JPEG")
    host = {p: enc.encode_images([jpeg], preprocess=p, decode="host")[0] for p in ("auto", "device", "pil")}
    monkeypatch.setattr(decode, "decode_jpeg_on", lambda *a, **k: pytest.fail("GPU decode asked off CUDA"))
    for preprocess, want in host.items():
        assert torch.equal(enc.encode_images([jpeg], preprocess=preprocess)[0], want)
    with pytest.raises(ValueError, match=r"decode must be one of \('auto', 'host', 'gpu'\), got 'nvjpeg'"):
        enc.encode_images([jpeg], decode="nvjpeg")


def test_huge_declared_png_is_refused_before_decoding(encoders):
    """A PNG declaring 30000 x 30000 is refused from its header: quickly, in bounded memory."""
    enc = encoders["tiny"]
    bomb = _png_header(30000, 30000)
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"images\[0\]: declares"):
        enc.encode_images([bomb])
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 2 and peak < 16 << 20, (seconds, peak)
    big = _png_header(15000, 10000)  # under PIL's own bomb threshold, over vitgraph's ceiling
    with pytest.raises(ValueError, match=r"15000x10000 = 150000000 pixels, above the limit"):
        enc.encode_images([big], preprocess="device")


def test_wrong_row_dtype_is_refused(encoders):
    enc = encoders["tiny"]
    rows = torch.zeros(64, enc.tower.input_width, dtype=torch.int16)
    with pytest.raises(TypeError, match="floating point .* or uint8"):
        enc.encode(rows, [(1, 8, 8)])
    assert enc.encode(rows.to(torch.uint8), [(1, 8, 8)]).shape == (16, enc.output_width)


def test_empty_inputs():
    enc = GraphedVisionEncoder.from_config("tiny", device="cpu")
    assert enc.encode_images([]) == [] and enc.encode_images(videos=[]) == []
    with pytest.raises(ValueError, match=r"videos\[0\] must have at least one frame"):
        enc.encode_images(videos=[[]])


def _dds_alpha_only() -> bytes:
    """A 1,152-byte DDS file PIL identifies and then cannot decode (NotImplementedError inside PIL)."""
    header = (struct.pack("<7I", 124, 0x100F, 16, 16, 64, 0, 0) + b"\0" * 44
              + struct.pack("<2I4s5I", 32, 0x1, b"\0" * 4, 32, 0xff0000, 0xff00, 0xff, 0xff000000)
              + struct.pack("<5I", 0x1000, 0, 0, 0, 0))
    return b"DDS " + header + b"\0" * 1024


def test_hostile_forms_get_named_errors_and_odd_buffers_work(encoders, tmp_path):
    enc = encoders["tiny"]
    good = photo(64, 96, 10)
    want = enc.encode_images([good])[0]
    cases = [
        ([good, _dds_alpha_only()], ValueError, r"images\[1\]: not a readable image"),  # PIL's NotImplementedError
        ([good, str(tmp_path / "a\0b.png")], ValueError, r"images\[1\]: .*cannot be read"),
        ([good, np.zeros((1, 300, 3), np.uint8)], ValueError, r"images\[1\]: image aspect ratio"),
        ([[good, good]], TypeError, r"images\[0\] must be a PIL image"),  # a list is not an image (nor a clip)
        ([torch.from_numpy(good).permute(2, 0, 1).to_sparse()], ValueError, r"images\[0\] tensor must be dense"),
    ]
    os.mkfifo(tmp_path / "fifo")
    cases.append(([str(tmp_path / "fifo")], ValueError, r"images\[0\]: .*fifo: is not a regular file"))
    for preprocess in ("pil", "device"):
        for images, error, words in cases:
            with pytest.raises(error, match=words):
                enc.encode_images(images, preprocess=preprocess)
    strided = memoryview(bytearray(encoded(good) * 2))[::2]  # not C-contiguous
    assert not strided.c_contiguous
    assert torch.equal(enc.encode_images([memoryview(encoded(good))])[0], want)
    with pytest.raises(ValueError, match=r"images\[0\]: not a readable image"):
        enc.encode_images([strided])  # read as bytes: every other byte of two PNGs is no PNG
    with pytest.raises(ValueError, match="meta device"):
        enc.device_rows(torch.empty(4, enc.tower.input_width, dtype=torch.uint8, device="meta"))
    assert torch.equal(enc.encode_images([good])[0], want)


def test_a_small_file_that_inflates_is_bounded_by_max_image_pixels(encoders):
    """A 9000 x 9000 PNG header (81 MP) passes the library's default ceiling but not a lower one,
    which a server sets (vitgraph.serve: 2**26): refused before a byte is inflated."""
    enc = encoders["tiny"]
    with pytest.raises(ValueError, match=r"images\[0\]: declares 9000x9000 = 81000000 pixels, above the limit of 67108864"):
        enc.encode_images([_png_header(9000, 9000)], max_image_pixels=1 << 26)
    for bad in (0, True, 2.5, 1 << 29):
        with pytest.raises(ValueError, match="max_image_pixels must be an int"):
            enc.encode_images([photo(32, 32, 0)], max_image_pixels=bad)


@pytest.mark.parametrize("preprocess", ["pil", "device"])
def test_one_lazily_opened_image_listed_many_times_is_safe_across_threads(tmp_path, preprocess):
    """A PIL image loads in place and is not thread-safe while it does: the same opened file
    listed eight times, decoded by eight threads, gives eight equal items."""
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "photo.png"
    path.write_bytes(encoded(photo(600, 800, 11)))
    want, _ = image_rows([photo(600, 800, 11)], processor=QWEN2_VL_PROCESSOR, device="cpu", preprocess=preprocess)
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            rows, grids = image_rows([Image.open(path)] * 8, processor=QWEN2_VL_PROCESSOR, device="cpu",
                                     preprocess=preprocess, executor=pool)
            assert len(grids) == 8
            assert all(torch.equal(part, want) for part in rows.split(len(want)))


@pytest.mark.parametrize("preprocess", ["pil", "device"])
def test_a_call_checks_only_the_limits_of_the_kinds_it_holds(preprocess):
    """Qwen3-VL's video minimum (4096) is below its image minimum (65536): a max_pixels between
    them serves a videos-only call, and is refused (by name) for images."""
    from vitgraph.models import QWEN3_VL_VIDEO_PROCESSOR
    from vitgraph.images.preprocess import clip_smart_resize

    frames = [photo(64, 64, 3)] * 4
    kw = dict(processor=QWEN3_VL_PROCESSOR, video_processor=QWEN3_VL_VIDEO_PROCESSOR, device="cpu",
              preprocess=preprocess, max_pixels=20000)
    _, grids = image_rows(videos=[frames], **kw)
    h, w = clip_smart_resize(4, 64, 64, 32, 2, 4096, 20000)
    assert grids.tolist() == [[2, h // 16, w // 16]]
    with pytest.raises(ValueError, match="min_pixels"):
        image_rows([frames[0]], videos=[frames], **kw)
    with pytest.raises(TypeError, match="max_pixels"):  # the arguments themselves, with nothing to size
        image_rows([], processor=QWEN3_VL_PROCESSOR, device="cpu", max_pixels="20000")
